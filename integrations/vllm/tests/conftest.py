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


@pytest.fixture(scope="session")
def run(model, tmp_path_factory):
    """``run(mode, storage_url=None)``: engine_driver.py's record of one engine, by step name (run once per mode)."""
    import json

    from vllm_run import run_python, tail

    cache: dict = {}

    def go(mode: str, storage: str | None = None) -> dict:
        if mode not in cache:
            out = tmp_path_factory.mktemp(mode)
            log = out / "engine.log"
            args = ["-m", "engine_driver", mode, str(out / "result.json"), str(model)] + ([storage] if storage else [])
            rc = run_python(args, log, timeout=240)
            assert rc == 0, f"{mode} engine exited {rc}:\n{tail(log)}"
            cache[mode] = {s["name"]: s for s in json.loads((out / "result.json").read_text())["steps"]}
        return cache[mode]

    return go
