"""Where the jit tests run: compiled on CUDA, else on the CPU under the Triton interpreter.

Triton reads ``TRITON_INTERPRET`` when a kernel is first defined, and this plugin defines its
kernels on first use, so defaulting it here (before any test transfers) is enough. It is only
defaulted where there is no CUDA; CI runs ``TRITON_INTERPRET=1 python -m pytest``.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def jit_device() -> str:
    """The device type the kernels run on here, or skip (saying why) where they cannot run."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1: the kernels cannot run here")
