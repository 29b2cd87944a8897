"""vLLM's OpenAI-compatible server with HicacheOffloadingSpec, over HTTP on 127.0.0.1.

Started as ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` looks its own version up
under the distribution name ``vllm``, which the CPU build is not called), in its own process group,
bounded in time, killed with its group afterwards.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from vllm_run import env, stop

pytest.importorskip("vllm", reason="vLLM's server tests run in integrations/vllm/dev's environment")

from engine_driver import BLOCK, GEN, PREFIX  # noqa: E402
from tiny_model import prompt_ids  # noqa: E402

HITS, LOADED = "vllm:external_prefix_cache_hits_total", "vllm:kv_offload_load_bytes_total"
LAYERS, PAGE = 2, 8192  # tiny_model's Llama: 1 KV head x 2 (K, V) x 32 tokens x 32 dims x 4 bytes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(base: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def scrape(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and " " in line:
            name, value = line.rsplit(" ", 1)
            key = name.split("{", 1)[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


@pytest.fixture(scope="module")
def server(model, run, tmp_path_factory):
    # The device blocks the offline engine took on this CPU (conftest.fit_device_blocks: derived from what
    # the engine reported, where the test's 16 do not hold 480 tokens): the server gets the same cache.
    blocks = run("baseline")["engine"]["device_blocks"]
    port = free_port()
    # The README's turn-on line: vLLM's own --kv-offloading-size (GiB; 64 MiB here) and the spec named, nothing
    # else (vLLM fills in the connector and its role; hicache-vllm's general plugin registered the name).
    kv = {"kv_connector_extra_config": {"spec_name": "HicacheOffloadingSpec"}}
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--block-size", str(BLOCK), "--num-gpu-blocks-override", str(blocks),
            "--max-model-len", "384", "--max-num-seqs", "4", "--max-num-batched-tokens", "512",
            "--enable-prefix-caching", "--dtype", "float32", "--seed", "0", "--enforce-eager",
            "--enable-prompt-tokens-details",
            "--kv-offloading-size", "0.0625", "--kv-transfer-config", json.dumps(kv)]  # fmt: skip
    log = tmp_path_factory.mktemp("server") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env(), start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited {proc.returncode}:\n" + log.read_text()[-4000:])
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("the server was not up within 240 s:\n" + log.read_text()[-4000:])
            time.sleep(1)
        yield base, str(model)
    finally:
        stop(proc)


def complete(base: str, model: str, ids: list[int]) -> tuple[list[int], int]:
    body = {"model": model, "prompt": ids, "max_tokens": GEN, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    r = post(base, "/v1/completions", body)
    details = (r.get("usage") or {}).get("prompt_tokens_details") or {}
    return list(r["choices"][0]["token_ids"]), int(details.get("cached_tokens") or 0)


def test_server_reloads_an_evicted_prefix_with_equal_outputs_and_metrics(server, run):
    base_run = run("baseline")
    url, model = server
    a = prompt_ids(1, PREFIX)
    first, cached_first = complete(url, model, a)
    assert first == base_run["A"]["tokens"][0]
    for s in (2, 3, 4):
        tokens, _ = complete(url, model, prompt_ids(s, PREFIX))
        assert tokens == base_run[f"evict {s}"]["tokens"][0]
    before = scrape(url)
    again, cached = complete(url, model, a)
    after = scrape(url)
    assert cached >= 224, f"the server reused {cached} of {PREFIX} prefix tokens"
    assert again == base_run["A again"]["tokens"][0]
    hits = after.get(HITS, 0) - before.get(HITS, 0)
    loaded = after.get(LOADED, 0) - before.get(LOADED, 0)
    assert hits == cached
    assert loaded == cached // BLOCK * LAYERS * PAGE
