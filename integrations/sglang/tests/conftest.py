"""SGLang 0.5.23's own code drives hicache's host pools; these fixtures only set SGLang up.

Device pools live on ``HICACHE_TEST_DEVICE`` (``cpu`` by default; ``cuda`` on a GPU
machine). On the CPU the ``kernel`` io backend's Triton kernels run under the interpreter.
"""

from __future__ import annotations

import importlib.util
import os
import sys

DEVICE = os.environ.get("HICACHE_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    # Before anything imports triton: the interpreter is chosen at import time.
    os.environ.setdefault("TRITON_INTERPRET", "1")
elif importlib.util.find_spec("sgl_kernel") is None:
    # On a GPU SGLang imports sgl_kernel at module level (its own host pools' transfer kernels), and
    # sglang-kernel 0.4.10 loads only beside torch 2.14.1. Where it is missing (the GPU machine's
    # image holds torch 2.11), SGLang is shown no CUDA device, so it takes the code paths it takes on
    # a CPU machine, as in the CPU runs of this suite; everything else (hicache, its plugins, torch
    # itself, these tests) sees the GPU, so the device pools are CUDA tensors and the bytes move
    # through hicache's CUDA implementations.
    import torch

    _is_available = torch.cuda.is_available

    def _cuda_is_available() -> bool:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return False if caller == "sglang" or caller.startswith("sglang.") else _is_available()

    torch.cuda.is_available = _cuda_is_available

import pytest  # noqa: E402

#: SGLang keeps 10 GiB of host memory back from every HiCache pool it sizes; the pools here take a few
#: MiB, and a 24 GiB test machine with servers running beside the suite may have less than 10 GiB free,
#: which would refuse every pool. The e2e servers set the same through HICACHE_SGLANG_HOST_RESERVE_GIB.
TEST_HOST_RESERVE_BYTES = 1 << 29


@pytest.fixture(autouse=True, scope="session")
def adapter():
    """hicache_sglang.install() for the whole session: SGLang's build_kv_host_pool is hicache's."""
    import hicache_sglang
    import sglang.srt.mem_cache.pool_host.base as host_base

    reserve = host_base.HICACHE_HOST_MEMORY_RESERVE_BYTES
    host_base.HICACHE_HOST_MEMORY_RESERVE_BYTES = TEST_HOST_RESERVE_BYTES
    hicache_sglang.install()
    yield hicache_sglang
    hicache_sglang.uninstall()
    host_base.HICACHE_HOST_MEMORY_RESERVE_BYTES = reserve


def pytest_report_header(config) -> list[str]:
    import hicache_sglang

    mode = "CPU-platform mode (no sgl_kernel)" if DEVICE != "cpu" and importlib.util.find_spec("sgl_kernel") is None \
        else "as installed"  # fmt: skip
    return [f"hicache-sglang: SGLang {hicache_sglang.sglang_version()}, device pools on {DEVICE}, SGLang {mode}"]


def pytest_configure(config) -> None:
    # SGLang warns on import about CUDA-only features it would not use here; keep the report readable.
    for module in ("sglang", "torch", "transformers"):
        config.addinivalue_line("filterwarnings", f"ignore::UserWarning:{module}")
        config.addinivalue_line("filterwarnings", f"ignore::FutureWarning:{module}")
