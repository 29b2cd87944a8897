"""vLLM 0.32's own offline engine with HicacheOffloadingSpec: evictions, reloads, preemptions, L3, metrics.

Each engine runs ``engine_driver.py`` in a process of its own (vLLM's EngineCore and Worker processes
under it, killed with its process group). A tiny random Llama made by the test; greedy decoding;
outputs compared token for token with the same engine without a connector.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM's engine tests run in integrations/vllm/dev's environment")

from hicache_vllm.page_oracle import page_bytes  # noqa: E402

from hicache_core.storage.page_format import HEADER_SIZE  # noqa: E402
from hicache_core.verification.page_checksum import GROUP_TOKENS  # noqa: E402

LAYERS, KV_HEADS, HEAD, BLOCK = 2, 1, 32, 32  # tiny_model.make_llama
PAGE = page_bytes(num_kv_heads=KV_HEADS, block_size=BLOCK, head_size=HEAD, element_size=4)  # float32


def delta(steps, name, before, metric) -> float:
    return steps[name]["metrics"].get(metric, 0) - steps[before]["metrics"].get(metric, 0)


def test_evicted_prefix_comes_back_from_the_host_tier_with_equal_outputs(run, l3):
    base, hi = run("baseline"), run("hicache", l3)
    assert base["A again"]["cached"] == [0], "the baseline's device cache should have evicted the prefix"
    cached = hi["A again"]["cached"][0]
    assert cached >= 224, f"only {cached} of 256 prefix tokens came back"
    assert hi["A again"]["tokens"] == base["A again"]["tokens"] == base["A"]["tokens"]
    assert hi["A twice"]["tokens"] == base["A twice"]["tokens"]
    for name in ("A", "evict 2", "evict 3", "evict 4"):
        assert hi[name]["tokens"] == base[name]["tokens"], name


def test_vllm_metrics_show_the_loads(run, l3):
    hi = run("hicache", l3)
    cached = hi["A again"]["cached"][0]
    assert delta(hi, "A again", "evict 4", "vllm:external_prefix_cache_hits") == cached
    # Bytes over the device link: every loaded block, every layer, a whole page each.
    assert delta(hi, "A again", "evict 4", "vllm:kv_offload_load_bytes") == cached // BLOCK * LAYERS * PAGE
    # Stores: the 8 whole blocks of each of A, evict 2, 3 and 4. A store's bytes are counted when the worker
    # reports it done, on a later engine step, so a busy machine may not have counted evict 4's by the end of
    # evict 4 (CI of 302ead7 saw 24 pages there); "A again" stores nothing new and runs 17 steps after it.
    assert hi["A again"]["metrics"].get("vllm:kv_offload_store_bytes", 0) >= 4 * 8 * LAYERS * PAGE


def test_batch_with_preemptions_equals_the_engine_without_a_connector(run, l3):
    base, hi = run("baseline"), run("hicache", l3)
    assert delta(base, "batch", "A again", "vllm:num_preemptions") > 0, "the batch did not preempt: no test"
    assert delta(hi, "batch", "A again", "vllm:num_preemptions") > 0
    assert hi["batch"]["tokens"] == base["batch"]["tokens"]


def test_l3_events_name_the_blocks_vllm_publishes(run, l3):
    """The L3 engine (run as a GPU server runs) published vLLM's own KV events and hicache's beside them; both
    streams, received by SUB sockets and decoded with vLLM's own classes (engine_driver.EventTap): every block
    hicache announces in L3 (medium STORAGE, the S3 store named) is a block vLLM announced in its GPU tier, by
    the same hash, so a router's index matches the two; and every block vLLM's own offloading manager announced
    in the host tier (medium CPU) is announced in L3, where it was written through."""
    hi = run("hicache", l3)
    streams = hi["kv_events"]
    assert streams is not None, "the L3 engine ran without its KV events"
    for name, stream in streams.items():
        assert stream["seqs"] == list(range(len(stream["seqs"]))), f"{name}: the replay skipped a batch"
        assert stream["live"] > 0 and stream["live_as_replayed"], f"{name}: the SUB socket got other bytes"
    ours, theirs = streams["hicache"]["events"], streams["vllm"]["events"]

    def hashes(events, kind, medium):
        return {h for e in events if e["type"] == kind and e["medium"] == medium for h in e["hashes"]}

    gpu, cpu = hashes(theirs, "BlockStored", "GPU"), hashes(theirs, "BlockStored", "CPU")
    stored = hashes(ours, "BlockStored", "STORAGE")
    assert ours[0]["type"] == "AllBlocksCleared", "a (re)started publisher first voids what it said"
    assert {e["type"] for e in ours[1:]} == {"BlockStored"}, "nothing left L3 in this run"
    assert {(e["medium"], e["locality"]) for e in ours[1:]} == {("STORAGE", "REMOTE")}
    (store,) = {e["ownership"] for e in ours[1:]}  # which store holds the pages: every instance that reaches it
    assert store.startswith("s3://") and "?" not in store, store  # names it alike; no credentials, no query
    # A, evict 2, 3 and 4: 8 whole blocks each, written through to L3.
    assert len(stored) >= 4 * 8, len(stored)
    assert all(isinstance(h, int) for h in stored)  # vLLM's default: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    assert stored <= gpu, f"{len(stored - gpu)} L3 blocks are named by no GPU-tier event of vLLM's"
    # A store job is finished (and vLLM's manager announces its blocks in the host tier) only once its pages
    # are written through and acknowledged, which is when hicache announces them: none is missing from L3.
    assert cpu and cpu <= stored, f"{len(cpu - stored)} of vLLM's host-tier blocks were never announced in L3"


def test_corrupted_loads_change_the_outputs(run):
    base, bad = run("baseline"), run("corrupt")
    assert bad["A again"]["cached"][0] >= 224, "the negative control must load the prefix to mean anything"
    assert bad["A"]["tokens"] == base["A"]["tokens"]
    assert bad["A again"]["tokens"] != base["A again"]["tokens"], "random KV bytes did not change the outputs"


def _first_header(s3):
    """The header of one page the engines stored in ``s3`` (read with botocore, beside the engines' client)."""
    import botocore.session

    from hicache_core.storage.page_format import unpack_header

    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=s3.endpoint, region_name="us-east-1", aws_access_key_id=s3.env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=s3.env["AWS_SECRET_ACCESS_KEY"])  # fmt: skip
    key = client.list_objects_v2(Bucket=s3.bucket, MaxKeys=1)["Contents"][0]["Key"]
    head = client.get_object(Bucket=s3.bucket, Key=key, Range=f"bytes=0-{HEADER_SIZE - 1}")["Body"].read()
    return unpack_header(head)


def test_restarted_engine_serves_the_prefix_from_s3(run, l3, s3_store):
    """The first engine wrote its offloaded pages through to S3 (a real SeaweedFS) and exited; a fresh engine,
    its host tier empty, serves prefix A from the object store: the S3 server sends one object per page (the
    page's header and its layers' bytes), vLLM counts the tokens as from disk, and the outputs equal those of
    the engine without a connector."""
    assert l3.startswith("s3://"), l3
    base = run("baseline")
    run("hicache", l3)  # the first engine wrote its offloaded pages through to L3, then exited
    again = run("restart", l3)
    first = again["A from L3"]
    cached = first["cached"][0]
    assert cached >= 224, f"a restarted engine found {cached} prefix tokens in L3"
    pages = cached // BLOCK
    assert first["metrics"].get("vllm:external_prefix_cache_hits", 0) == cached
    assert first["metrics"].get("vllm:prompt_tokens_cached_by_source{source=disk}", 0) == cached
    sent = {k: first["s3_sent"][k] - again["s3_sent_before"][k] for k in ("objects", "bytes")}
    # The S3 engines run verified (conftest.AS_GPU_SERVER): each object carries the page's checksum row, an
    # 8-byte word per group of up to GROUP_TOKENS items of a layer; a vLLM page (kind vllm_page) is one item,
    # its layer's whole block.
    row = 8 * LAYERS * -(-1 // GROUP_TOKENS)
    assert sent == {"objects": pages, "bytes": pages * (HEADER_SIZE + LAYERS * PAGE + row)}, (sent, pages)
    header = _first_header(s3_store)  # written keyed, with the checksum row: as a GPU server writes it
    assert header.keyed and header.verify_words * 8 == row, header
    assert first["metrics"].get("vllm:kv_offload_load_bytes", 0) == pages * LAYERS * PAGE
    assert first["tokens"] == base["A"]["tokens"]
    assert again["A again"]["tokens"] == base["A again"]["tokens"]


def test_mla_model_reloads_byte_exact(run):
    """DeepSeek-V2's latent cache (vLLM's AMX/CPU MLA backends, bf16, 576-wide rows) through the same kind.

    In bf16 a prefix computed afresh and a prefix reused run different kernels, and so does a different
    split between cached and computed tokens. So the 272-token prefix (8 whole blocks and 16 tokens) is
    compared with vLLM's own device prefix-cache hit of it ("A twice": the same 8 blocks cached, the same
    16 tokens computed): identical bytes give identical tokens there.

    That reference needs vLLM's device prefix cache and 32-token blocks. On an x86-64 CPU without AMX,
    vLLM serves MLA with its reference CPU_MLA backend, which forces 16-token blocks and turns prefix
    caching off ("MLA is enabled on a non-GPU platform; forcing chunked prefill and prefix caching to
    be disabled"): the engine reports it, and the test skips with that reason."""
    base = run("baseline", mla=True)
    engine = base["engine"]
    if not engine["prefix_caching"] or engine["block_size"] != BLOCK:
        pytest.skip(
            f"vLLM's CPU engine here serves MLA with {engine['block_size']}-token blocks and prefix caching "
            f"{'on' if engine['prefix_caching'] else 'off'} (its reference CPU_MLA backend, on an x86-64 CPU without "
            "AMX: 'MLA is enabled on a non-GPU platform; forcing chunked prefill and prefix caching to be "
            "disabled'): the test's reference, vLLM's own device prefix-cache hit of 8 whole 32-token blocks, "
            "does not exist here"
        )
    hi = run("hicache", mla=True)
    cached = hi["A again"]["cached"][0]
    assert cached == base["A twice"]["cached"][0] == 256, f"{cached} MLA prefix tokens came back"
    mla_page = BLOCK * (512 + 64) * 2  # one latent + rope row per token, bf16
    assert delta(hi, "A again", "evict 4", "vllm:kv_offload_load_bytes") == cached // BLOCK * LAYERS * mla_page
    assert hi["A again"]["tokens"] == base["A twice"]["tokens"] == hi["A twice"]["tokens"]


def test_after_an_in_place_reload_no_page_of_the_old_weights_is_loaded(run, model, tmp_path_factory):
    """vLLM's ``reload_weights`` to a second checkpoint of the same architecture (other random weights).

    Before it, the prefix comes back from the host tier (and is in L3, ``file://``); after it, the engine
    answers as an engine started on the second checkpoint, token for token, loading nothing through the
    connector: the host tier was dropped and L3's keys moved to a new weight version.
    """
    import os

    from tiny_model import make_llama

    second = make_llama(tmp_path_factory.mktemp("model-2") / "tiny-llama-2", seed=1)
    store = tmp_path_factory.mktemp("reload-l3")
    reference = run("baseline", path=second, env={"HICACHE_TEST_NO_BATCH": "1"})
    hi = run("reload", f"file://{store}", env={"HICACHE_TEST_RELOAD_TO": str(second)})
    assert hi["A again"]["cached"][0] >= 224, "the prefix did not come back from the host tier before the reload"
    assert reference["A"]["tokens"] != hi["A"]["tokens"], "the two checkpoints give the same tokens: no test"
    assert hi["A after reload"]["tokens"] == reference["A"]["tokens"]
    assert hi["A after reload"]["cached"] == [0]
    for metric in ("vllm:external_prefix_cache_hits", "vllm:kv_offload_load_bytes"):
        assert delta(hi, "A after reload", "reloaded", metric) == 0, metric
    # L3: the first weights' pages under one namespace, the second's under another (".w-reload-<token>")
    namespaces = {d.name: sum(len(f) for _, _, f in os.walk(d)) for d in store.iterdir() if d.is_dir()}
    assert len(namespaces) == 2 and all(n > 0 for n in namespaces.values()), namespaces
    assert sum(".w-reload-" in name for name in namespaces) == 1, namespaces
