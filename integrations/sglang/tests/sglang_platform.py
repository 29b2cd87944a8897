"""What SGLang is shown of the machine, set before SGLang is imported (by conftest, and by test subprocesses).

On a GPU SGLang imports ``sgl_kernel`` at module level (its own host pools' transfer kernels), and
sglang-kernel 0.4.10 loads only beside torch 2.14.1. Where it is missing (the GPU machine's image
holds torch 2.11), SGLang is shown no CUDA device, so it takes the code paths it takes on a CPU
machine, as in the CPU runs of this suite; everything else (hicache, its plugins, torch itself,
these tests) sees the GPU, so the device pools are CUDA tensors and the bytes move through
hicache's CUDA implementations. SGLang's own CUDA kernels cannot run in that mode.
"""

from __future__ import annotations

import importlib.util
import os
import sys

DEVICE = os.environ.get("HICACHE_TEST_DEVICE", "cpu")
#: SGLang is shown no GPU although the device pools are on one (see the module docstring).
SGLANG_SEES_NO_GPU = DEVICE != "cpu" and importlib.util.find_spec("sgl_kernel") is None


def apply() -> None:
    """Triton's interpreter on CPU pools; on a GPU without ``sgl_kernel``, no GPU for SGLang's modules."""
    if DEVICE == "cpu":
        # Before anything imports triton: the interpreter is chosen at import time.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif SGLANG_SEES_NO_GPU:
        import torch

        if getattr(torch.cuda.is_available, "hicache_sglang_platform", False):
            return
        is_available = torch.cuda.is_available

        def cuda_is_available() -> bool:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            return False if caller == "sglang" or caller.startswith("sglang.") else is_available()

        cuda_is_available.hicache_sglang_platform = True  # type: ignore[attr-defined]
        torch.cuda.is_available = cuda_is_available
