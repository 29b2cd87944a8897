"""Where the kernel tests run: on CUDA compiled, else on the CPU under the Triton interpreter.

Triton reads ``TRITON_INTERPRET`` when a kernel is first defined, and this plugin defines
its kernels on first use, so setting it here (before any test runs a transfer) is enough.
It is only defaulted on machines without CUDA: CI runs ``TRITON_INTERPRET=1 python -m pytest``.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def kernel_device() -> str:
    """The device type the kernel runs on here, or skip (with the reason) where it cannot run."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1: the kernel cannot run here")


@pytest.fixture(autouse=True)
def only_this_plugin(monkeypatch):
    """These tests are about hicache-kernel: keep hicache-jit (which outranks it for one-layer operations) out."""
    from hicache_core.registry import reset_registry

    monkeypatch.setenv("HICACHE_PLUGINS", "kernel,direct")
    reset_registry()
    yield
    reset_registry()
