"""Runs vLLM's own offline engine (``vllm.LLM``) through one scenario and writes what it saw as JSON.

A separate process per engine (vLLM spawns its EngineCore and Worker processes, which needs a main
module): ``python engine_driver.py MODE OUT MODEL [STORAGE_URL]``, MODE one of

* ``baseline``: no connector;
* ``hicache``: HicacheOffloadingSpec (with L3 at STORAGE_URL when given);
* ``corrupt``: the negative control's spec (random bytes on every load);
* ``restart``: HicacheOffloadingSpec over STORAGE_URL in a fresh engine: the prefix first, from L3;
* ``reload``: HicacheOffloadingSpec over STORAGE_URL; after "A again", the weights are reloaded in place
  from ``HICACHE_TEST_RELOAD_TO`` (``collective_rpc("reload_weights")``, then vLLM's own
  ``reset_prefix_cache()``), and A is sent once more ("A after reload"); no batch.

Scenario: prefix A, twice (the second from vLLM's device prefix cache);
B, C, D (A leaves the 15-block device cache); A again; then a batch that does
not fit the device cache (preemptions). Greedy, fixed lengths, float32.

Each step records vLLM's metrics; with ``HICACHE_TEST_S3_METRICS`` (the SeaweedFS server's Prometheus
URL) and ``HICACHE_TEST_S3_BUCKET`` also the objects and bytes the S3 server sent from that bucket so far.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from tiny_model import prompt_ids  # noqa: E402

BLOCK = 32
DEVICE_BLOCKS = 16  # one is vLLM's null block: 15 usable, 480 tokens
#: The blocks actually asked of the engine: DEVICE_BLOCKS, or as many as give this CPU's engine the same
#: 480 tokens of device cache (tests/conftest.py's fit_device_blocks derives it from the engine's own report).
ENGINE_BLOCKS = int(os.environ.get("HICACHE_TEST_DEVICE_BLOCKS", DEVICE_BLOCKS))
MAX_MODEL_LEN = 384
# The prefix; the MLA run takes one that is not a whole number of blocks (see test_mla_model_reloads_byte_exact).
PREFIX = int(os.environ.get("HICACHE_TEST_PREFIX", "256"))
GEN = 16
BATCH = [prompt_ids(100 + i, 64) for i in range(8)]
BATCH_GEN = 160


def engine_args(mode: str, model: str, storage_url: str | None) -> dict:
    from vllm.config import KVTransferConfig

    args = dict(model=model, block_size=BLOCK, num_gpu_blocks_override=ENGINE_BLOCKS, max_model_len=MAX_MODEL_LEN,
                max_num_seqs=4, max_num_batched_tokens=512, enable_prefix_caching=True,
                dtype=os.environ.get("HICACHE_TEST_DTYPE", "float32"),
                seed=0, disable_log_stats=False, enforce_eager=True)  # fmt: skip
    if mode == "baseline":
        return args
    extra = {"spec_module_path": "hicache_vllm", "spec_name": "HicacheOffloadingSpec", "cpu_bytes_to_use": 64 << 20}
    if mode == "corrupt":
        extra.update(spec_module_path="corrupting_spec", spec_name="CorruptingOffloadingSpec")
    if storage_url:
        extra["hicache_storage_url"] = storage_url
    args["kv_transfer_config"] = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                                  kv_connector_extra_config=extra)  # fmt: skip
    return args


#: Counters also recorded per label value (``name{label=value}``), beside their sum under ``name``.
BY_LABEL = {"vllm:prompt_tokens_cached_by_source": "source"}


def metrics(llm) -> dict:
    out: dict = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if isinstance(value, (int, float)):
            out[m.name] = out.get(m.name, 0) + value
            label = BY_LABEL.get(m.name)
            if label is not None:
                key = f"{m.name}{{{label}={m.labels.get(label)}}}"
                out[key] = out.get(key, 0) + value
    return out


def s3_sent() -> dict | None:
    """What the SeaweedFS server sent for the test's bucket so far, by its own metrics (``None``: no S3 here).

    ``objects``: GETs that sent a body (SeaweedFS counts a HEAD as a GET request, but a HEAD sends no
    first byte); ``bytes``: the bodies' bytes.
    """
    url, bucket = os.environ.get("HICACHE_TEST_S3_METRICS"), os.environ.get("HICACHE_TEST_S3_BUCKET")
    if not url:
        return None
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        lines = r.read().decode().splitlines()

    def total(*want: str) -> int:
        return sum(int(float(line.rsplit(" ", 1)[1])) for line in lines if all(w in line for w in want))

    bucket_label = f'bucket="{bucket}"'
    return {"objects": total("SeaweedFS_s3_time_to_first_byte_millisecond_count{", bucket_label, 'type="GET"'),
            "bytes": total("SeaweedFS_s3_bucket_traffic_sent_bytes_total{", bucket_label)}  # fmt: skip


def main() -> None:
    mode, out_path, model = sys.argv[1], sys.argv[2], sys.argv[3]
    storage_url = sys.argv[4] if len(sys.argv) > 4 else None
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_args(mode, model, storage_url))
    sp = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    a = prompt_ids(1, PREFIX)
    # What the engine made of the test's sizes on this CPU (vLLM adjusts them per attention backend).
    cache = llm.llm_engine.vllm_config.cache_config
    engine = {"block_size": cache.block_size, "prefix_caching": bool(cache.enable_prefix_caching),
              "device_blocks": ENGINE_BLOCKS}  # fmt: skip
    record: dict = {"mode": mode, "engine": engine, "steps": [], "s3_sent_before": s3_sent()}

    def run(name, prompts, params=sp):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        record["steps"].append({"name": name, "tokens": [list(o.outputs[0].token_ids) for o in outs],
                                "cached": [o.num_cached_tokens for o in outs], "metrics": metrics(llm),
                                "s3_sent": s3_sent()})  # fmt: skip

    if mode == "restart":
        run("A from L3", [a])
    run("A", [a])
    run("A twice", [a])  # from vLLM's own device prefix cache: the same compute path as a reload
    for s in (2, 3, 4):
        run(f"evict {s}", [prompt_ids(s, PREFIX)])
    run("A again", [a])
    if mode == "reload":
        llm.collective_rpc("reload_weights", kwargs={"weights_path": os.environ["HICACHE_TEST_RELOAD_TO"]})
        llm.reset_prefix_cache()  # vLLM's device prefix cache: vLLM asks for this after a weight update
        record["steps"].append({"name": "reloaded", "tokens": [], "cached": [], "metrics": metrics(llm)})
        run("A after reload", [a])
    elif not os.environ.get("HICACHE_TEST_NO_BATCH"):  # the MLA run: bf16 MLA decode on a CPU is slow
        run("batch", BATCH, SamplingParams(temperature=0, max_tokens=BATCH_GEN, ignore_eos=True))
    Path(out_path).write_text(json.dumps(record))


if __name__ == "__main__":
    main()
