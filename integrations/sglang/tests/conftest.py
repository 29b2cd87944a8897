"""SGLang 0.5.23's own code drives hicache's host pools; these fixtures only set SGLang up.

Device pools live on ``HICACHE_TEST_DEVICE`` (``cpu`` by default; ``cuda`` on a GPU
machine). On the CPU the ``kernel`` io backend's Triton kernels run under the interpreter.
"""

from __future__ import annotations

import os

if os.environ.get("HICACHE_TEST_DEVICE", "cpu") == "cpu":
    # Before anything imports triton: the interpreter is chosen at import time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def adapter():
    """hicache_sglang.install() for the whole session: SGLang's build_kv_host_pool is hicache's."""
    import hicache_sglang

    hicache_sglang.install()
    yield hicache_sglang
    hicache_sglang.uninstall()


def pytest_configure(config) -> None:
    # SGLang warns on import about CUDA-only features it would not use here; keep the report readable.
    for module in ("sglang", "torch", "transformers"):
        config.addinivalue_line("filterwarnings", f"ignore::UserWarning:{module}")
        config.addinivalue_line("filterwarnings", f"ignore::FutureWarning:{module}")
