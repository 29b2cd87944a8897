"""Runs vLLM's own offline engine through a paused agent session and writes what it saw as JSON.

``python -m retention_driver MODE OUT MODEL L3_DIR L3_CAPACITY``: HicacheOffloadingSpec over a small host tier
(:data:`HOST_CHUNKS`) and ``file://L3_DIR?capacity=L3_CAPACITY``. MODE:

* ``retain``: session s1's prompt carries ``kv_transfer_params={"hicache": HINT}``;
* ``cache_control``: it carries Dynamo's ``{"cache_control": {"type": "ephemeral", "ttl": "10m"}}`` and
  ``{"hicache": {"session": "s1"}}``;
* ``plain``: no hint anywhere (vLLM's LRU on both tiers);
* ``malformed``: one prompt whose hint has a field hicache does not know (refused: served without a lease), then
  another prompt (the engine serves on).

Scenario (greedy, fixed lengths): "s1" (session s1's prompt, 8 whole blocks); "s0" (another prompt, after it:
more recently used); "other 1..3" (prompts enough to overflow the host tier and L3); "s1 again". After each
step the L3 directory's pages are listed (once every store job of the step has landed), and, after the
others, the worker's L3 store's lease book is read (``collective_rpc``) with vLLM's metrics.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from engine_driver import BLOCK, ENGINE_BLOCKS, GEN, MAX_MODEL_LEN, metrics  # noqa: E402
from tiny_model import prompt_ids  # noqa: E402

PROMPT = 256  # 8 whole blocks: the pages each prompt stores
LAYERS, PAGE = 2, 8192  # tiny_model's Llama: 1 KV head x 2 (K, V) x 32 tokens x 32 dims x 4 bytes
HOST_CHUNKS = 24  # three prompts' pages: the fourth evicts
HINT = {"priority": 90, "ttl": "10m", "session": "s1"}
SUFFIX = ".page"  # hicache_storage_file's page files


def pages(root: Path) -> list[str]:
    """The page hashes the file store holds (``<namespace>/<2 hex>/<hash>.page``)."""
    return sorted(p.name[: -len(SUFFIX)] for p in root.glob(f"*/*/*{SUFFIX}"))


def settled(root: Path, at_least: int, patience_s: float = 60.0) -> list[str]:
    """The store's pages once at least ``at_least`` are there and nothing changed for a moment (store jobs of
    the step just ended may still be writing through when ``generate`` returns)."""
    deadline = time.monotonic() + patience_s
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        now = pages(root)
        if now != last:
            last, since = now, time.monotonic()
        elif len(now) >= at_least and time.monotonic() - since >= 1.0:
            return now
        time.sleep(0.1)
    raise TimeoutError(f"the L3 store did not settle with {at_least} pages: {len(last or [])}")


def l3_leases(worker, hashes: list[str]) -> dict:
    """On the worker (``collective_rpc``): its L3 store's lease book, and the weight of each of ``hashes`` it leases."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    store = get_kv_transfer_group().connector_worker.worker.mover.storage
    weights = {h: store.leases.weight_of(store.namespace.key(h)) for h in hashes}
    return {"stats": store.leases.stats(), "eviction": store.eviction,
            "weights": {h: w for h, w in weights.items() if w is not None}}  # fmt: skip


def main() -> None:
    mode, out_path, model, root, capacity = sys.argv[1], Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), sys.argv[5]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of l3_leases (a test's look inside)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    extra = {"spec_module_path": "hicache_vllm", "spec_name": "HicacheOffloadingSpec",
             "cpu_bytes_to_use": HOST_CHUNKS * LAYERS * PAGE,
             "hicache_storage_url": f"file://{root}?capacity={capacity}"}  # fmt: skip
    llm = LLM(model=model, block_size=BLOCK, num_gpu_blocks_override=ENGINE_BLOCKS, max_model_len=MAX_MODEL_LEN,
              max_num_seqs=4, max_num_batched_tokens=512, enable_prefix_caching=True,
              dtype=os.environ.get("HICACHE_TEST_DTYPE", "float32"), seed=0, disable_log_stats=False,
              enforce_eager=True, kv_transfer_config=KVTransferConfig(
                  kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra))  # fmt: skip
    plain = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    params = {"retain": {"hicache": HINT},
              "cache_control": {"hicache": {"session": "s1"}, "cache_control": {"type": "ephemeral", "ttl": "10m"}},
              "malformed": {"hicache": {**HINT, "pinned": True}}}.get(mode)  # fmt: skip
    hinted = plain if params is None else SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True,
                                                         extra_args={"kv_transfer_params": params})  # fmt: skip
    record: dict = {"mode": mode, "steps": {}}

    def run(name: str, prompt: list[int], sp, stored: int) -> None:
        (out,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        record["steps"][name] = {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens,
                                 "pages": settled(root, stored), "metrics": metrics(llm)}  # fmt: skip

    s1 = prompt_ids(11, PROMPT)
    if mode == "malformed":  # refused: the request is served without a lease, and the engine lives on
        run("s1", s1, hinted, 8)
        record["l3_leases"] = llm.collective_rpc(l3_leases, args=(pages(root),))[0]
        run("s0", prompt_ids(12, PROMPT), plain, 16)
        out_path.write_text(json.dumps(record))
        return
    run("s1", s1, hinted, 8)
    run("s0", prompt_ids(12, PROMPT), plain, 16)
    for i in range(1, 4):
        run(f"other {i}", prompt_ids(12 + i, PROMPT), plain, 20)
    if mode != "plain":
        record["l3_leases"] = llm.collective_rpc(l3_leases, args=(pages(root),))[0]
    run("s1 again", s1, hinted, 20)
    out_path.write_text(json.dumps(record))


if __name__ == "__main__":
    main()
