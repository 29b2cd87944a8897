"""SGLang 0.5.23's own code drives hicache's host pools; these fixtures only set SGLang up.

Device pools live on ``HICACHE_TEST_DEVICE`` (``cpu`` by default; ``cuda`` on a GPU
machine). On the CPU the ``kernel`` io backend's Triton kernels run under the interpreter.
"""

from __future__ import annotations

from sglang_platform import DEVICE, SGLANG_SEES_NO_GPU, apply

apply()

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

    mode = "CPU-platform mode (no sgl_kernel)" if SGLANG_SEES_NO_GPU else "as installed"
    return [f"hicache-sglang: SGLang {hicache_sglang.sglang_version()}, device pools on {DEVICE}, SGLang {mode}"]


def pytest_configure(config) -> None:
    # SGLang warns on import about CUDA-only features it would not use here; keep the report readable.
    for module in ("sglang", "torch", "transformers"):
        config.addinivalue_line("filterwarnings", f"ignore::UserWarning:{module}")
        config.addinivalue_line("filterwarnings", f"ignore::FutureWarning:{module}")
