"""hicache-vllm's tests. Device tensors live on ``HICACHE_TEST_DEVICE`` (``cpu`` by default; ``cuda`` on
the GPU machine, which has no vLLM: the block mover's tests need none, the engine tests skip there)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

DEVICE = os.environ.get("HICACHE_TEST_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def model(tmp_path_factory):
    """The tiny random Llama (and tokenizer) the engine tests serve."""
    from tiny_model import make_llama

    return make_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="session")
def l3(tmp_path_factory):
    """One file:// store for the session: the first engine writes it, a restarted one reads it."""
    return f"file://{tmp_path_factory.mktemp('l3')}"


#: The MLA engines: bf16 (vLLM's CPU MLA backends want it), and no preemption batch (bf16 MLA decode is slow here).
MLA_ENV = {"HICACHE_TEST_DTYPE": "bfloat16", "HICACHE_TEST_NO_BATCH": "1", "HICACHE_TEST_PREFIX": "272"}


@pytest.fixture(scope="session")
def mla_model(tmp_path_factory):
    """A tiny random DeepSeek-V2 (multi-head latent attention; vLLM's CPU MLA backends want bf16, 512 + 64)."""
    from tiny_model import make_mla

    return make_mla(tmp_path_factory.mktemp("mla") / "tiny-deepseek-v2")


@pytest.fixture(scope="session")
def run(model, mla_model, tmp_path_factory):
    """``run(mode, storage_url=None, mla=False)``: engine_driver.py's record of one engine, by step name (once each)."""
    import json

    from vllm_run import run_python, tail

    cache: dict = {}

    def go(mode: str, storage: str | None = None, mla: bool = False) -> dict:
        key = (mode, mla)
        if key not in cache:
            out = tmp_path_factory.mktemp(mode + ("-mla" if mla else ""))
            log = out / "engine.log"
            path = mla_model if mla else model
            args = ["-m", "engine_driver", mode, str(out / "result.json"), str(path)] + ([storage] if storage else [])
            rc = run_python(args, log, timeout=480, extra_env=MLA_ENV if mla else None)
            assert rc == 0, f"{mode} engine exited {rc}:\n{tail(log)}"
            cache[key] = {s["name"]: s for s in json.loads((out / "result.json").read_text())["steps"]}
        return cache[key]

    return go
