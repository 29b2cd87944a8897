"""Where the jit tests run: compiled on CUDA, else on the CPU under the Triton interpreter.

Triton reads ``TRITON_INTERPRET`` when a kernel is first defined, and this plugin defines its
kernels on first use, so defaulting it here (before any test transfers) is enough. It is only
defaulted where there is no CUDA; CI runs ``TRITON_INTERPRET=1 python -m pytest``.
"""

from __future__ import annotations

import pytest

from hicache_core.testing.guarded import default_to_interpreter, triton_test_device

default_to_interpreter()


@pytest.fixture
def jit_device() -> str:
    """The device type the kernels run on here, or skip (saying why) where they cannot run."""
    return triton_test_device()
