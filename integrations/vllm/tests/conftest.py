"""hicache-vllm's tests. Device tensors live on ``HICACHE_TEST_DEVICE`` (``cpu`` by default; ``cuda`` on
the GPU machine, which has no vLLM: the block mover's tests need none, the engine tests skip there)."""

from __future__ import annotations

import os
import secrets
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

DEVICE = os.environ.get("HICACHE_TEST_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).parent))
#: storage-s3's test helpers (its SeaweedFS server), as benchmarks/s3_bench.py takes them.
S3_TESTS = Path(__file__).resolve().parents[3] / "plugins" / "storage-s3" / "tests"


def pytest_configure(config):
    """SIGTERM (a CI timeout, CI stopping its background jobs) ends the session like Ctrl-C, so the engines, the
    server and SeaweedFS are still stopped by their fixtures: each runs in a session of its own, which a signal
    to the suite's process group misses."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


@pytest.fixture(scope="session")
def model(tmp_path_factory):
    """The tiny random Llama (and tokenizer) the engine tests serve."""
    from tiny_model import make_llama

    return make_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


#: What a GPU server runs by default that a CPU engine does not: host-tier verification (on CUDA it is on
#: unless turned off); with it, the cluster key's file (HICACHE_L3_KEY_FILE, per session).
AS_GPU_SERVER = {"HICACHE_VERIFY": "1"}


@dataclass(frozen=True)
class S3Store:
    """The engines' L3: an s3:// URL on a real SeaweedFS, the credentials its processes get, its metrics."""

    url: str
    env: dict[str, str]  # the standard AWS variables, for the engine's processes
    metrics: str  # the server's Prometheus URL: what it served, counted by the server itself
    bucket: str
    endpoint: str

    def url_for(self, prefix: str) -> str:
        """Another prefix in the same bucket."""
        return f"s3://{self.bucket}/{prefix}?endpoint={self.endpoint}"


@pytest.fixture(scope="session")
def s3_store(tmp_path_factory):
    """A real SeaweedFS (``weed server -s3``) on 127.0.0.1 for the session, with a bucket for L3.

    Its engines run as a GPU server runs by default (:data:`AS_GPU_SERVER`): host-tier verification on and the
    pages keyed with the cluster key, beside the host-tier and reload engines, which keep the CPU defaults.
    """
    pytest.importorskip("hicache_storage_s3", reason="hicache-storage-s3 is not installed")
    sys.path.insert(0, str(S3_TESTS))
    key_file = tmp_path_factory.mktemp("cluster-key") / "cluster.key"
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    import seaweedfs_server as weed

    from hicache_core.testing.servers import free_port

    metrics_port = free_port()
    server = weed.SeaweedFS(tmp_path_factory.mktemp("seaweedfs"), extra=(f"-metricsPort={metrics_port}",)).start()
    try:
        bucket = server.create_bucket("vllm-l3")
        env = {"AWS_ACCESS_KEY_ID": weed.ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": weed.SECRET_KEY,
               "HICACHE_TEST_S3_METRICS": f"http://127.0.0.1:{metrics_port}/metrics",
               "HICACHE_TEST_S3_BUCKET": bucket, **AS_GPU_SERVER, "HICACHE_L3_KEY_FILE": str(key_file)}  # fmt: skip
        yield S3Store(server.url(bucket, "kv"), env, env["HICACHE_TEST_S3_METRICS"], bucket, server.endpoint)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def l3(s3_store):
    """The session's L3, on S3 (a real SeaweedFS): the first engine writes it, a restarted one reads it.

    The engine tests' L3 is s3:// rather than file://: the spec hands any URL to the same storage
    layer, each extra engine costs about a minute here, and file:// and redis:// are covered where
    the block mover writes through and a new worker reads back (test_mover.py).
    """
    return s3_store.url


#: The MLA engines: bf16 (vLLM's CPU MLA backends want it), and no preemption batch (bf16 MLA decode is slow here).
MLA_ENV = {"HICACHE_TEST_DTYPE": "bfloat16", "HICACHE_TEST_NO_BATCH": "1", "HICACHE_TEST_PREFIX": "272"}


@pytest.fixture(scope="session")
def mla_model(tmp_path_factory):
    """A tiny random DeepSeek-V2 (multi-head latent attention; vLLM's CPU MLA backends want bf16, 512 + 64)."""
    from tiny_model import make_mla

    return make_mla(tmp_path_factory.mktemp("mla") / "tiny-deepseek-v2")


def fit_device_blocks(log: str, blocks: int) -> int | str | None:
    """What to do after an engine refused to start, from what the engine said (its log).

    vLLM checks that one request of ``max_model_len`` fits the device cache. How many bytes a
    block of that cache holds per token depends on the CPU (the attention backend vLLM picks: with
    AMX or without), so ``num_gpu_blocks_override`` blocks hold more tokens on one x86-64 CPU than on
    another. When the engine refuses with "the estimated maximum model length is N", the blocks are
    scaled so the engine holds the tokens the scenario was written for (15 usable blocks, 480
    tokens): the same evictions, on any CPU. Returns the block count to ask for, a ``str`` (the
    engine's reason) when no size can help here (not enough memory for the KV cache at all), or
    ``None`` when the failure is something else.
    """
    import re

    from engine_driver import BLOCK, DEVICE_BLOCKS

    found = re.search(r"the estimated maximum model length is (\d+)", log)
    if found:
        fits = int(found.group(1))  # tokens the engine's cache holds with `blocks` blocks
        want = (DEVICE_BLOCKS - 1) * BLOCK
        return 1 + -(-(blocks - 1) * want // max(fits, 1))
    for reason in (r"Available memory on node [^\n]*", r"No available memory for the cache blocks[^\n]*"):
        found = re.search(reason, log)
        if found:
            return found.group(0)
    return None


#: The device blocks each engine kind (Llama, MLA) needs on this CPU, once an engine has said so.
_engine_blocks: dict[bool, int] = {}


@pytest.fixture(scope="session")
def run(model, mla_model, tmp_path_factory, request):
    """``run(mode, storage_url=None, mla=False, path=None, env=None)``: engine_driver.py's record of one engine, by step
    name (once each); ``path`` another model than the session's, ``env`` more of the engine's environment.

    An s3:// store's engines get its credentials in the standard AWS variables, and count its GETs.
    """
    import json

    from vllm_run import run_python, tail

    cache: dict = {}

    def go(mode: str, storage: str | None = None, mla: bool = False, path=None, env: dict | None = None) -> dict:
        key = (mode, mla, str(path))
        if key not in cache:
            out = tmp_path_factory.mktemp(mode + ("-mla" if mla else ""))
            log = out / "engine.log"
            path = path or (mla_model if mla else model)
            args = ["-m", "engine_driver", mode, str(out / "result.json"), str(path)] + ([storage] if storage else [])
            from engine_driver import DEVICE_BLOCKS

            blocks = _engine_blocks.get(mla, DEVICE_BLOCKS)
            s3_env = request.getfixturevalue("s3_store").env if storage and storage.startswith("s3://") else {}
            for attempt in range(2):
                extra = {**(MLA_ENV if mla else {}), **s3_env, **(env or {}), "HICACHE_TEST_DEVICE_BLOCKS": str(blocks)}
                rc = run_python(args, log, timeout=480, extra_env=extra)
                if rc == 0:
                    break
                fitted = fit_device_blocks(log.read_text(errors="replace"), blocks)
                if isinstance(fitted, str):
                    pytest.skip(f"vLLM's CPU engine cannot run the {mode} scenario on this machine: {fitted}")
                assert fitted is not None and attempt == 0, f"{mode} engine exited {rc} ({blocks} blocks):\n{tail(log)}"
                blocks = fitted
            _engine_blocks[mla] = blocks
            record = json.loads((out / "result.json").read_text())
            # the steps by name, what the engine made of the test's sizes under "engine", its KV events (if any)
            cache[key] = {"engine": record["engine"], "s3_sent_before": record["s3_sent_before"],
                          "kv_events": record.get("kv_events"), **{s["name"]: s for s in record["steps"]}}  # fmt: skip
        return cache[key]

    return go
