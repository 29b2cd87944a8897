"""SGLang's pin front door (``hicache_sglang.retention``): SGLang's page hashes, hicache's leases, strict bodies.

The oracle for the hashes is SGLang's own radix tree and cache controller (the kit's ``build_fixture``
with hicache's ``file://`` store through SGLang's ``dynamic`` backend): the keys it writes to the store,
read back as the store's files and from the tree. A pin is served by the same ``HicacheStorage`` SGLang
made; the IPC structs go through SGLang's own msgpack encoder and decoder.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

PAGE = 4


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Any]:
    """SGLang's radix cache with its HiCache and hicache's file:// L3 (with a capacity: its evictions follow leases)."""
    from hicache_sglang.storage import extra_config
    from radix_kit import kit_pointed_at, make_case
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from sglang.test.kits.unified_radix_cache.fixtures import build_fixture

    case = make_case(PAGE)
    try:
        with kit_pointed_at("mha", "page_first", "kernel", 0), \
                get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1):  # fmt: skip
            cache, alloc, rtp = build_fixture(case.cfg)
            args = ServerArgs(model_path="dummy", served_model_name="pins", page_size=PAGE,
                              hicache_io_backend="kernel", hicache_mem_layout="page_first",
                              hicache_write_policy="write_through", hicache_storage_backend="dynamic",
                              hicache_storage_backend_extra_config=extra_config(
                                  f"file://{tmp_path / 'l3'}?capacity=4MiB"),
                              hicache_storage_prefetch_policy="wait_complete")  # fmt: skip
            set_global_server_args_for_scheduler(args)
            cache.init_hicache(args, cache.cache_init_params)
            case.addCleanup(cache.cache_controller.storage_backend.close)
            case.addCleanup(cache.release_host_resources)
            case.addCleanup(cache.cache_controller._stop_storage_threads)
            yield case, cache, alloc, rtp, tmp_path / "l3"
    finally:
        case.doCleanups()


def _written(case: Any, cache: Any, alloc: Any, rtp: Any, tokens: list[int], **namespace: str) -> list[str]:
    """``tokens`` through SGLang's tree into L3; the page hashes its controller wrote, in chain order."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    case._insert(cache, alloc, rtp, tokens, **namespace)
    leaf = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens), **namespace))).last_device_node
    case._backup_node(cache, leaf)
    case._write_path_to_l3(cache, leaf)
    case._flush_l3_backups(cache)
    return case._all_page_hashes(cache, leaf)


def _files(l3: Path) -> set[str]:
    return {p.name.removesuffix(".page") for p in l3.glob("*/*/*.page")}


@pytest.mark.parametrize("namespace", [{}, {"extra_key": "tenant-a", "cache_salt": "salt-1"}],
                         ids=["plain", "extra_key+cache_salt"])  # fmt: skip
def test_a_pin_hashes_the_keys_sglangs_controller_writes_and_leases_them(tree, namespace):
    from hicache_sglang import retention

    case, cache, alloc, rtp, l3 = tree
    tokens = list(range(10, 10 + 6 * PAGE + 3))  # six whole pages and a partial one SGLang does not store
    before = _files(l3)
    written = _written(case, cache, alloc, rtp, tokens, **namespace)
    assert len(written) == 6 and _files(l3) - before == set(written)  # the store's own files: SGLang's keys
    ours = retention.page_hashes(tokens, PAGE, **namespace)
    assert ours == written
    if namespace:  # the namespace is in the chain's seed, as SGLang's storage keys have it
        assert ours != retention.page_hashes(tokens, PAGE)

    storage = cache.cache_controller.storage_backend
    pin = retention.parse("pin", {"token_ids": tokens, "ttl_seconds": 300, "session": "agent-7", **namespace})
    (record,) = retention.run(pin, [storage], page_size=PAGE)
    assert record == {"store": storage.store.url.redacted, "tp_rank": 0, "dp_rank": 0, "pages": 6, "leased": 6,
                      "protected": 6, "capped": 0, "eviction": "ordered", "lease_id": record["lease_id"]}  # fmt: skip
    book = storage.store.leases
    assert all(book.leased(k) for k in storage.store.namespace.keys(written))
    stats = book.stats()
    assert (stats["leases"], stats["pages_protected"]) == (1, 6)

    prefetch = retention.parse("prefetch", {"token_ids": tokens, **namespace})
    (record,) = retention.run(prefetch, [storage], page_size=PAGE)
    assert record["pages"] == 6 and isinstance(record["prefetching"], int) and "error" not in record

    unpin = retention.parse("unpin", {"token_ids": tokens, **namespace})
    assert retention.run(unpin, [storage], page_size=PAGE)[0]["released"] == 1
    assert book.stats()["leases"] == 0
    assert retention.run(unpin, [storage], page_size=PAGE)[0]["released"] == 0  # nothing left to end

    retention.run(pin, [storage], page_size=PAGE)
    other = retention.parse("pin", {"token_ids": tokens[: 2 * PAGE], "ttl_seconds": 60, "session": "agent-7",
                                    "supersede": True, **namespace})  # fmt: skip
    assert retention.run(other, [storage], page_size=PAGE)[0]["leased"] == 2
    assert book.stats()["pages_superseded"] == 4  # the session's earlier state goes first, bar the new pin's pages
    by_session = retention.parse("unpin", {"session": "agent-7"})
    assert retention.run(by_session, [storage], page_size=PAGE)[0]["released"] == 2
    assert book.stats()["leases"] == 0


def test_what_a_scheduler_cannot_serve_is_refused_before_any_store_is_touched(tree):
    from hicache_sglang import retention

    case, cache, alloc, rtp, l3 = tree
    storage = cache.cache_controller.storage_backend
    short = retention.parse("pin", {"token_ids": [5, 6, 7], "ttl_seconds": 30})
    with pytest.raises(retention.Refused, match=r"token_ids hold 3 tokens: no whole page of 4"):
        retention.run(short, [storage], page_size=PAGE)
    pin = retention.parse("pin", {"token_ids": list(range(8)), "ttl_seconds": 30})
    with pytest.raises(retention.Refused, match="no hicache storage bound: start it with --hicache-storage-backend"):
        retention.run(pin, [], page_size=PAGE)
    assert storage.store.leases.stats()["granted"] == 0


BAD = [
    ("pin", [1, 2], "/hicache/pin_prefix takes a JSON object, got list"),
    ("pin", {"token_ids": [1], "ttl_seconds": 5, "pin": True},
     "/hicache/pin_prefix does not take 'pin'; it takes token_ids, ttl_seconds, cache_control, priority"),
    ("pin", {"ttl_seconds": 5}, '/hicache/pin_prefix needs "token_ids"'),
    ("pin", {"token_ids": [], "ttl_seconds": 5}, "token_ids is a non-empty list of token ids, got list"),
    ("pin", {"token_ids": "1 2 3", "ttl_seconds": 5}, "token_ids is a non-empty list of token ids, got str"),
    ("pin", {"token_ids": [1, -2], "ttl_seconds": 5}, "token_ids[1] is -2, not a token id (an integer >= 0)"),
    ("pin", {"token_ids": [1, True], "ttl_seconds": 5}, "token_ids[1] is True, not a token id"),
    ("pin", {"token_ids": [1]}, '/hicache/pin_prefix needs "ttl_seconds" (seconds the pin lives after its last hit)'),
    ("pin", {"token_ids": [1], "ttl_seconds": "5m"}, "ttl_seconds is a number of seconds, got '5m'"),
    ("pin", {"token_ids": [1], "ttl_seconds": -1}, "a time to live must be a finite number of seconds > 0, got -1"),
    ("pin", {"token_ids": [1], "ttl_seconds": 10**9}, "over the longest allowed, 86400 s (HICACHE_LEASE_MAX_TTL_S)"),
    ("pin", {"token_ids": [1], "ttl_seconds": 5, "priority": 101}, "a lease's priority is 0..100, got 101"),
    ("pin", {"token_ids": [1], "ttl_seconds": 5, "priority": "high"}, "priority is an integer 0..100, got 'high'"),
    ("pin", {"token_ids": [1], "ttl_seconds": 5, "session": ""}, "session is a non-empty text of at most 256"),
    ("pin", {"token_ids": [1], "ttl_seconds": 5, "supersede": True}, "supersede needs /hicache/pin_prefix.session"),
    ("pin", {"token_ids": [1], "ttl_seconds": 5, "supersede": "yes"}, "supersede is true or false, got 'yes'"),
    ("pin", {"token_ids": [1], "ttl_seconds": 5, "cache_control": {"type": "ephemeral"}},
     '"ttl_seconds" (seconds the pin lives after its last hit) or Anthropic\'s "cache_control"'),
    ("pin", {"token_ids": [1], "cache_control": {"type": "persistent"}},
     "cache_control: cache_control type 'persistent' is not supported (only 'ephemeral')"),
    ("pin", {"token_ids": [1], "cache_control": {"type": "ephemeral"}, "priority": 90},
     'takes "priority" with "ttl_seconds"; a "cache_control" pin has priority 50'),
    ("pin", {"token_ids": [1], "ttl_seconds": 5, "extra_key": 7}, "extra_key is a text, as in SGLang's /generate"),
    ("unpin", {}, '/hicache/unpin_prefix takes "session" (every pin of a session) or "token_ids"'),
    ("unpin", {"session": "a", "token_ids": [1]}, 'or "token_ids" (the pins of a prefix), one of them'),
    ("unpin", {"session": "a", "extra_key": "k"}, '/hicache/unpin_prefix with "session" takes no other field'),
    ("unpin", {"token_ids": [1], "ttl_seconds": 5}, "/hicache/unpin_prefix does not take 'ttl_seconds'"),
    ("prefetch", {"token_ids": [1], "session": "a"}, "/hicache/prefetch does not take 'session'"),
]  # fmt: skip


@pytest.mark.parametrize("action, body, message", BAD, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(BAD)])
def test_a_malformed_body_is_refused_with_what_is_wrong(action, body, message):
    from hicache_sglang import retention

    with pytest.raises(retention.Refused) as err:
        retention.parse(action, body)
    assert message in str(err.value)


def test_a_pin_reads_dynamos_shape_and_anthropics_cache_control():
    from hicache_sglang import retention

    dynamo = retention.parse("pin", {"token_ids": [1, 2], "ttl_seconds": 300})  # what Dynamo's worker endpoint sends
    assert (dynamo.priority, dynamo.ttl_seconds, dynamo.session, dynamo.supersede) == (50, 300.0, None, False)
    anthropic = retention.parse("pin", {"token_ids": [1, 2], "cache_control": {"type": "ephemeral", "ttl": "1h"},
                                        "session": "s"})  # fmt: skip
    assert (anthropic.priority, anthropic.ttl_seconds, anthropic.session) == (50, 3600.0, "s")
    full = retention.parse("pin", {"token_ids": [1], "ttl_seconds": 2.5, "priority": 90, "session": "s",
                                   "supersede": True, "extra_key": "", "cache_salt": "c"})  # fmt: skip
    assert (full.priority, full.ttl_seconds, full.supersede) == (90, 2.5, True)
    assert (full.extra_key, full.cache_salt) == (None, "c")  # "" is none, as in SGLang's requests


def test_a_lora_adapters_id_joins_the_extra_key_as_sglangs_request_has_it():
    from hicache_sglang import retention
    from sglang.srt.lora.lora_registry import LoRARef, LoRARegistry

    ref = LoRARef(lora_name="sql", lora_path="/adapters/sql")
    registry = LoRARegistry([ref])
    req = retention.parse("pin", {"token_ids": [1], "ttl_seconds": 5, "extra_key": "tenant"})
    retention.resolve_lora(req, "sql", registry)
    assert req.extra_key == "tenant" + ref.lora_id  # Req.__init__: (extra_key or "") + lora_id
    with pytest.raises(retention.Refused, match=r"lora_path 'nope' is not a loaded LoRA adapter \(loaded: \['sql'\]\)"):
        retention.resolve_lora(req, "nope", registry)
    with pytest.raises(retention.Refused, match="loaded: none"):
        retention.resolve_lora(req, "sql", None)


def test_the_requests_travel_sglangs_ipc_and_the_answers_are_summed():
    from hicache_sglang import retention
    from sglang.srt.managers import tokenizer_control_mixin
    from sglang.srt.managers.io_struct import msgpack_decode, msgpack_encode
    from sglang.srt.managers.scheduler import Scheduler

    req = retention.parse("pin", {"token_ids": [1, 2, 3], "ttl_seconds": 9, "session": "s", "cache_salt": "c"})
    back = msgpack_decode(msgpack_encode(req))  # SGLang's own codec, as on its zmq sockets
    assert type(back) is retention.HicacheRetentionReqInput and back == req
    out = retention.HicacheRetentionReqOutput(stores=[{"store": "file:///x", "leased": 3, "eviction": "ordered"}])
    assert msgpack_decode(msgpack_encode(out)) == out
    # the adapter's parts of SGLang: a communicator the tokenizer manager builds, a scheduler handler
    assert (retention.COMMUNICATOR, retention.HicacheRetentionReqOutput) in tokenizer_control_mixin._COMMUNICATOR_SPECS
    assert Scheduler.handle_hicache_retention is retention.handle
    assert Scheduler.init_request_dispatcher.__wrapped__ is not None

    def store(n: int, **kw: Any) -> dict:
        return {"store": f"file:///s{n}", "tp_rank": n, "dp_rank": 0, "pages": 4, "leased": 4, "protected": 3,
                "capped": 1, "eviction": "ordered", **kw}  # fmt: skip

    status, body = retention.answer("pin", [retention.HicacheRetentionReqOutput(stores=[store(0), store(1)])])
    assert status == 200 and body["success"] is True
    assert (body["pages"], body["leased"], body["protected"], body["capped"]) == (4, 8, 6, 2)
    assert body["eviction"] == ["ordered"]
    assert body["message"] == "6 of 8 leased pages protected in 2 store(s); 2 over the retention cap"
    status, body = retention.answer("pin", [retention.HicacheRetentionReqOutput(refused="token_ids hold 3 tokens")])
    assert (status, body) == (400, {"success": False, "message": "token_ids hold 3 tokens"})
    failing = retention.HicacheRetentionReqOutput(failed="StorageError: disk gone", stores=[store(0)])
    status, body = retention.answer("pin", [failing])
    assert status == 500 and body["success"] is False and body["message"].endswith("failed: StorageError: disk gone")
