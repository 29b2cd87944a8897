"""A device function whose module sees ``triton.language.core`` only (not ``triton.language``).

tests/test_triton_interpreter_patch.py calls it from a kernel whose module imports ``triton.language``:
the launch patches ``triton.language`` only, so this call must still patch ``triton.language.core``.
"""

import triton
from triton.language import core


@triton.jit
def double_at(ptr, offsets):
    return core.load(ptr + offsets) * 2
