"""Where the kernel tests run: on CUDA compiled, else on the CPU under the Triton interpreter.

Triton reads ``TRITON_INTERPRET`` when a kernel is first defined, and this plugin defines
its kernels on first use, so setting it here (before any test runs a transfer) is enough.
It is only defaulted on machines without CUDA: CI runs ``TRITON_INTERPRET=1 python -m pytest``.
"""

from __future__ import annotations

import pytest

from hicache_core.testing.guarded import default_to_interpreter, triton_test_device

default_to_interpreter()


@pytest.fixture
def kernel_device() -> str:
    """The device type the kernel runs on here, or skip (with the reason) where it cannot run."""
    return triton_test_device()


@pytest.fixture(autouse=True)
def only_this_plugin(monkeypatch):
    """These tests are about hicache-kernel: keep hicache-jit (which outranks it for one-layer operations) out."""
    from hicache_core.plugins.registry import reset_registry

    monkeypatch.setenv("HICACHE_PLUGINS", "kernel,direct")
    reset_registry()
    yield
    reset_registry()
