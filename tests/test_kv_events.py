"""KV events from hicache's tiers (hicache_core.events): the wire, the protocol, and when a page is announced.

The servers' own decoders read these events in their suites (integrations/*/tests/test_kv_events.py); here
the oracle is what those servers declare, written down from their ``kv_events`` modules: which fields each
event must carry, the batch as ``[ts, events, rank]``, the replay protocol (an 8-byte start sequence on the
ROUTER socket, answered by ``topic, seq, payload`` frames and an end marker of sequence -1).
"""

from __future__ import annotations

import hashlib
import time

import pytest
import torch

pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")
import zmq  # noqa: E402

from hicache_core.events import (  # noqa: E402
    SGLANG,
    VLLM,
    EventSubscriber,
    KVEventPublisher,
    Tier,
    format_named,
    sglang_block_hash,
    vllm_block_hash,
)
from hicache_core.storage import make_storage  # noqa: E402
from hicache_core.storage.page_auth import ClusterKey  # noqa: E402
from hicache_core.storage.page_format import HEADER_SIZE, address_of  # noqa: E402
from hicache_core.storage.pages import Span  # noqa: E402
from hicache_core.testing import explain_kit as kit  # noqa: E402

# What each server requires of an event (fields without a default in its struct), from vLLM 0.32's
# vllm/distributed/kv_events.py and SGLang 0.5.23's sglang/srt/disaggregation/kv_events.py.
REQUIRED = {
    "vllm": {
        "BlockStored": {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                        "lora_name"},  # fmt: skip
        "BlockRemoved": {"block_hashes", "medium"},
    },
    "sglang": {
        "BlockStored": {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"},
        "BlockRemoved": {"block_hashes"},
    },
}
MEDIA = {"vllm": {"disk": "STORAGE", "shared": "STORAGE", "peer": "STORAGE"},
         "sglang": {"disk": "DISK", "shared": "EXTERNAL", "peer": "EXTERNAL"}}  # fmt: skip
KEY = b"planted-cluster-key-events-0123456789ab"


def _hashes(n: int, salt: str = "") -> list[str]:
    out, prior = [], b""
    for i in range(n):  # a chain, as SGLang's page hashes are
        prior = hashlib.sha256(prior + f"{salt}{i}".encode()).digest()
        out.append(prior.hex())
    return out


def _slots(pages: list[int]) -> torch.Tensor:
    return (torch.tensor(pages)[:, None] * kit.PAGE + torch.arange(kit.PAGE)).reshape(-1)


@pytest.fixture
def publisher():
    pubs = []

    def make(fmt: str = "sglang", **kw) -> KVEventPublisher:
        pub = KVEventPublisher("tcp://*:0", replay_endpoint="tcp://127.0.0.1:0", format=fmt, **kw)
        pubs.append(pub)
        return pub

    yield make
    for p in pubs:
        p.close(timeout=1)


def _subscribe(pub: KVEventPublisher, **kw) -> EventSubscriber:
    sub = EventSubscriber(pub.endpoint.replace("0.0.0.0", "127.0.0.1"), replay_endpoint=pub.replay_endpoint,
                          format=pub.format, **kw)  # fmt: skip
    time.sleep(0.2)  # a SUB socket hears only what is sent after it joined (ZMQ's slow joiner)
    return sub


def _raw_batches(sock, timeout: float = 1.0) -> list[tuple[bytes, int, list]]:
    """Frames until ``timeout`` seconds pass without one, or 3 s in all (heartbeats never stop)."""
    out, end = [], time.monotonic() + 3.0
    while time.monotonic() < end and sock.poll(int(timeout * 1000)):
        topic, seq, payload = sock.recv_multipart()
        out.append((topic, int.from_bytes(seq, "big", signed=True), msgspec.msgpack.decode(payload)))
        timeout = 0.3
    return out


# ---- the wire ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_every_event_carries_what_its_server_requires(name):
    fmt = format_named(name)
    tier = Tier("shared", "redis://10.0.0.5:6379/0", "REMOTE")
    batch = fmt.batch(12.5, [fmt.stored(tier, [1, 2], 64), fmt.removed(tier, [2]), fmt.cleared()], 3)
    raw = msgspec.msgpack.decode(fmt.encode(batch))
    assert isinstance(raw, list) and raw[0] == 12.5 and raw[2] == 3  # [ts, events, rank], an array
    stored, removed, cleared = raw[1]
    assert stored["type"] == "BlockStored" and removed["type"] == "BlockRemoved"
    assert cleared == {"type": "AllBlocksCleared"}
    assert REQUIRED[name]["BlockStored"] <= set(stored)
    assert REQUIRED[name]["BlockRemoved"] <= set(removed)
    assert stored["block_hashes"] == [1, 2] and removed["block_hashes"] == [2]
    assert stored["medium"] == removed["medium"] == MEDIA[name]["shared"]
    assert stored["token_ids"] == [] and stored["block_size"] == 64 and stored["parent_block_hash"] is None
    # which store holds the page: vLLM's ``ownership`` (and ``locality``); SGLang's decoder ignores ``store``
    where = "ownership" if name == "vllm" else "store"
    assert stored[where] == removed[where] == "redis://10.0.0.5:6379/0"
    if name == "vllm":
        assert stored["locality"] == "REMOTE" and stored["lora_name"] is None


def test_media_per_tier_kind():
    for name, fmt in (("vllm", VLLM), ("sglang", SGLANG)):
        for kind, medium in MEDIA[name].items():
            assert fmt.medium(Tier(kind, "x", "LOCAL")) == medium


def test_block_hashes_are_the_servers():
    # SGLang: the page hash's first 64 bits as a signed integer (its hash_str_to_int64)
    assert sglang_block_hash("0" * 15 + "1" + "ab" * 24) == 1
    assert sglang_block_hash("f" * 64) == -1
    assert sglang_block_hash("8" + "0" * 63) == -(1 << 63)
    # vLLM: an OffloadKey is the block hash then 4 bytes of group; events carry the block hash's low 64 bits
    block = bytes(range(32))
    key = (block + (0).to_bytes(4, "big")).hex()
    assert vllm_block_hash(key) == int.from_bytes(block[-8:], "big")
    assert vllm_block_hash(key, as_int=False) == block
    with pytest.raises(ValueError, match="not a vLLM offload key"):
        vllm_block_hash("abcd")


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="format of sglang or vllm, not 'trtllm'"):
        format_named("trtllm")
    with pytest.raises(ValueError, match="a tier's kind is one of"):
        Tier("gpu", "x", "LOCAL")
    with pytest.raises(ValueError, match="LOCAL or REMOTE"):
        Tier("disk", "x", "NEAR")


# ---- the protocol --------------------------------------------------------------------------------


def test_live_stream_replay_and_late_snapshot(tmp_path, publisher):
    pub = publisher("vllm", topic="kv")
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv")
    sub.connect(pub.endpoint.replace("0.0.0.0", "127.0.0.1"))
    time.sleep(0.2)
    host = kit.host_pool(pages=8)
    store = make_storage(f"file://{tmp_path / 'l3'}", host, model_id="events", cluster_key=None)
    try:
        feed = store.publish_events(pub, audit_interval=None)
        keys = [(bytes([i]) * 32 + bytes(4)).hex() for i in range(3)]  # vLLM offload keys
        assert all(r.ok for r in store.write_pages(keys, _slots([0, 1, 2])))
        live = [b for b in _raw_batches(sub) if b[2][1]]  # leave out heartbeats (empty batches)
        stored = [e for _, _, batch in live for e in batch[1] if e["type"] == "BlockStored"]
        assert [h for e in stored for h in e["block_hashes"]] == [vllm_block_hash(k) for k in keys]
        assert {e["medium"] for e in stored} == {"STORAGE"} and {e["locality"] for e in stored} == {"LOCAL"}
        assert all(topic == b"kv" for topic, _, _ in live)

        # vLLM's and SGLang's replay: an 8-byte start sequence; the same frames again, then the end marker
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        first = live[0][1]
        dealer.send_multipart((b"", first.to_bytes(8, "big")))
        replayed = []
        while dealer.poll(2000):
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert topic == b"" and payload == b""
                break
            replayed.append((topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
        assert [r for r in replayed if r[2][1]][: len(live)] == live
        dealer.close(linger=0)

        late = _subscribe(pub, topic="kv")
        late.sync()
        assert late.index.pages("STORAGE", feed.tier.store) == {vllm_block_hash(k) for k in keys}
        late.close()
    finally:
        store.close()
        sub.close(linger=0)


def test_a_skipped_sequence_is_replayed(tmp_path, publisher):
    pub = publisher("sglang")
    host = kit.host_pool(pages=8)
    store = make_storage(f"file://{tmp_path / 'l3'}", host, model_id="events", cluster_key=None)
    try:
        feed = store.publish_events(pub, audit_interval=None, chained=True)
        sub = _subscribe(pub)
        sub.sync()
        hashes = _hashes(4)
        store.write_pages(hashes[:2], _slots([0, 1]))
        time.sleep(0.3)
        store.write_pages(hashes[2:], _slots([2, 3]))
        # This subscriber lost the first write's batch (as a slow joiner or a full queue would): it notices
        # the skipped number and asks the replay socket for it.
        sub._sub.recv_multipart()
        sub.poll(0.5)
        assert sub.gaps == 1 and sub.replays == 1
        assert sub.index.pages("DISK", feed.tier.store) == {sglang_block_hash(h) for h in hashes}
        sub.close()
    finally:
        store.close()


def test_tier_statistics_never_reach_a_subscriber_of_every_topic(tmp_path, publisher):
    quiet = publisher("sglang", stats_interval=0.05, heartbeat=0.1)  # empty topic: statistics only on request
    loud = publisher("sglang", topic="kv", stats_interval=0.05)
    host = kit.host_pool(pages=8)
    stores = [make_storage(f"file://{tmp_path / n}", host, model_id="events", cluster_key=None) for n in "ab"]
    try:
        for store, pub in zip(stores, (quiet, loud)):
            store.publish_events(pub, audit_interval=None)
            store.write_pages(_hashes(2), _slots([0, 1]))
        ctx = zmq.Context.instance()
        socks = []
        for pub in (quiet, loud):
            s = ctx.socket(zmq.SUB)
            s.setsockopt_string(zmq.SUBSCRIBE, "")
            s.connect(pub.endpoint.replace("0.0.0.0", "127.0.0.1"))
            socks.append(s)
        time.sleep(0.4)
        heard_quiet, heard_loud = _raw_batches(socks[0], 0.5), _raw_batches(socks[1], 0.5)
        assert {t for t, _, _ in heard_quiet} == {b""}  # every frame a batch the servers' decoders read
        stats = [p for t, _, p in heard_loud if t == b"hicache.tiers"]
        assert stats and stats[-1]["tiers"][0]["pages"] == 2 and stats[-1]["tiers"][0]["medium"] == "DISK"
        sub = _subscribe(quiet)
        asked = sub.tier_stats()
        (tier,) = asked["tiers"]
        assert tier["pages"] == 2 and tier["page_bytes"] == stores[0].page_bytes and tier["store_us_per_page"] > 0
        assert tier["load_us_per_page"] is None  # nothing read yet: not measured, never made up
        for s in socks:
            s.close(linger=0)
        sub.close()
    finally:
        for store in stores:
            store.close()


def test_heartbeat_and_silence(publisher):
    pub = publisher("vllm", heartbeat=0.05)
    sub = _subscribe(pub)
    sub.poll(0.3)
    assert sub.last_seq >= 1 and sub.silent_for() < 0.2  # empty batches while nothing happens
    pub.close(timeout=1)
    sub.poll(0.05)  # what was in flight at the close
    last = sub.last_seq
    sub.poll(0.3)
    # Nothing after the close: no heartbeat (poll's own clock may end a hair before 0.3 s: not the point).
    assert sub.last_seq == last and sub.silent_for() >= 0.25
    sub.close()


# ---- when a page is announced, and when it is removed -----------------------------------------------


def _stream(sub: EventSubscriber) -> list:
    events = []
    sub.on_batch = lambda seq, batch, received: events.extend(batch.events)
    return events


def test_pages_announced_only_when_readable_and_removed_when_not(tmp_path, publisher):
    pub = publisher("sglang")
    host = kit.host_pool(pages=8)
    key_a, key_b = ClusterKey(KEY, "test A"), ClusterKey(KEY[::-1], "test B")
    store = make_storage(f"file://{tmp_path / 'l3'}", host, model_id="events", cluster_key=key_a)
    other = make_storage(f"file://{tmp_path / 'l3'}", kit.host_pool(pages=8), model_id="events", cluster_key=key_a)
    try:
        feed = store.publish_events(pub, audit_interval=None)
        sub = _subscribe(pub)
        sub.sync()
        events = _stream(sub)
        h = _hashes(6)
        ev = [sglang_block_hash(x) for x in h]
        store.write_pages(h[:3], _slots([0, 1, 2]))
        sub.poll(0.3)
        assert sub.index.pages("DISK", feed.tier.store) == set(ev[:3])

        # another instance wrote h[3]; reading it back checked (MAC) announces it here too
        other.write_pages([h[3]], _slots([3]))
        assert store.read_pages([h[3]], _slots([5]))[0].ok
        # an outsider's bytes under h[4] (no MAC): refused on read, never announced
        full = store.namespace.key(h[4])
        blob = bytearray(HEADER_SIZE + store.page_bytes)
        base = address_of(blob)
        spans = [Span(base, HEADER_SIZE, memoryview(blob)[:HEADER_SIZE]),
                 Span(base + HEADER_SIZE, store.page_bytes, memoryview(blob)[HEADER_SIZE:])]  # fmt: skip
        assert store.backend.put_objects([full], [spans]) == [None]
        assert store.read_pages([h[4]], _slots([6]))[0].status.value == "corrupt"  # no header a reader takes
        # an announced page changed in the store: the read refuses it, and it is removed
        path = store.backend.path_of(store.namespace.key(h[0]))
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(raw)
        assert not store.read_pages([h[0]], _slots([7]))[0].ok
        sub.poll(0.3)
        assert sub.index.pages("DISK", feed.tier.store) == {ev[1], ev[2], ev[3]}
        assert ev[4] not in {x for e in events for x in e.block_hashes}  # never named by any event

        # a key rotation: what the old key wrote no longer authenticates
        store.rotate_cluster_key(key_b)
        store.write_pages([h[5]], _slots([4]))
        sub.poll(0.3)
        assert sub.index.pages("DISK", feed.tier.store) == {ev[5]}
        assert store.read_pages([h[1]], _slots([7]))[0].status.value == "auth_failed"

        # new weights: no key of the old ones is read again
        assert store.set_weight_version("v2")
        sub.poll(0.3)
        assert sub.index.pages("DISK", feed.tier.store) == set()
        store.write_pages(h[:2], _slots([0, 1]))
        store.clear()
        sub.poll(0.3)
        assert sub.index.pages("DISK", feed.tier.store) == set()
        assert feed.counts == {"stored": 6, "seen": 1, "removed_refused": 1, "removed_key_rotated": 3,
                               "removed_weight_version": 1, "removed_cleared": 2}  # fmt: skip
        sub.close()
    finally:
        store.close()
        other.close()


def test_a_store_that_evicts_says_so(tmp_path, publisher):
    pub = publisher("vllm")
    host = kit.host_pool(pages=8)
    probe = make_storage(f"file://{tmp_path / 'probe'}", host, model_id="events", cluster_key=None)
    object_bytes = 4096 + probe.page_bytes  # the file tier pads the header to a block
    probe.close()
    store = make_storage(f"file://{tmp_path / 'l3'}?capacity={3 * object_bytes}", host, model_id="events",
                         cluster_key=None)  # fmt: skip
    try:
        feed = store.publish_events(pub, audit_interval=None)
        sub = _subscribe(pub)
        sub.sync()
        keys = [(bytes([i + 1]) * 32 + bytes(4)).hex() for i in range(5)]
        for i, k in enumerate(keys):
            assert store.write_pages([k], _slots([i]))[0].ok
        sub.poll(0.3)
        held = [k for k in keys if store.backend.exists_objects([store.namespace.key(k)])[0]]
        assert len(held) == 3
        assert sub.index.pages("STORAGE", feed.tier.store) == {vllm_block_hash(k) for k in held}
        assert feed.counts["removed_evicted"] == 2
        # a page deleted behind the store's back is found by the audit
        store.backend.remove_objects([store.namespace.key(held[0])])
        assert feed.audit() == {"checked": 3, "removed": 1, "restored": 0}
        sub.poll(0.3)
        assert sub.index.pages("STORAGE", feed.tier.store) == {vllm_block_hash(k) for k in held[1:]}
        sub.close()
    finally:
        store.close()


def test_a_store_publishes_through_one_feed(tmp_path, publisher):
    pub = publisher("sglang")
    host = kit.host_pool(pages=8)
    store = make_storage(f"file://{tmp_path / 'l3'}", host, model_id="events", cluster_key=None)
    try:
        store.publish_events(pub, audit_interval=None)
        with pytest.raises(RuntimeError, match="already publishes KV events"):
            store.publish_events(pub)
        with pytest.raises(ValueError, match="audit_interval must be > 0"):
            make_storage(f"file://{tmp_path / 'b'}", host, model_id="e", cluster_key=None).publish_events(
                pub, audit_interval=0)
    finally:
        store.close()
    unkeyed = make_storage(f"file://{tmp_path / 'c'}", host, model_id="events", cluster_key=None)
    with pytest.raises(ValueError, match="no cluster key to rotate"):
        unkeyed.rotate_cluster_key(ClusterKey(KEY, "test"))
    unkeyed.close()


def test_a_chain_names_its_parent_and_a_batch_never_announces_what_it_evicted(tmp_path, publisher):
    pub = publisher("sglang")
    host = kit.host_pool(pages=8)
    probe = make_storage(f"file://{tmp_path / 'probe'}", host, model_id="events", cluster_key=None)
    object_bytes = 4096 + probe.page_bytes
    probe.close()
    store = make_storage(f"file://{tmp_path / 'l3'}?capacity={3 * object_bytes}", host, model_id="events",
                         cluster_key=None)  # fmt: skip
    try:
        feed = store.publish_events(pub, audit_interval=None, chained=True)
        sub = _subscribe(pub)
        sub.sync()
        events = _stream(sub)
        h = _hashes(6)
        # SGLang's contract: prefix_keys + keys is one chain, so the first page's parent is prefix_keys[-1]
        info = type("ExtraInfo", (), {"prefix_keys": h[:1]})()
        assert store.batch_set_from(h[1:3], _slots([0, 1]), info) == [True, True]
        sub.poll(0.3)
        (stored,) = [e for e in events if type(e).__struct_config__.tag == "BlockStored"]
        assert stored.block_hashes == [sglang_block_hash(x) for x in h[1:3]]
        assert stored.parent_block_hash == sglang_block_hash(h[0])
        # five pages into room for three: the batch's first pages are evicted by its last ones
        results = store.write_pages(h[1:6], _slots([0, 1, 2, 3, 4]), parent=h[0])
        assert all(r.ok for r in results)
        there = {x for x in h[1:6] if store.backend.exists_objects([store.namespace.key(x)])[0]}
        assert len(there) == 3
        sub.poll(0.3)
        assert sub.index.pages("DISK", feed.tier.store) == {sglang_block_hash(x) for x in there}
        assert feed.counts["not_announced_evicted_in_batch"] >= 1
        sub.close()
    finally:
        store.close()


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_a_page_announced_under_a_lease_names_its_session(tmp_path, publisher, fmt):
    from hicache_core.retention import Retain

    pub = publisher(fmt)
    host = kit.host_pool(pages=8)
    store = make_storage(f"file://{tmp_path / 'l3'}?capacity=10MiB", host, model_id="events", cluster_key=None)
    try:
        store.publish_events(pub, audit_interval=None)
        sub = _subscribe(pub)
        sub.sync()
        events = _stream(sub)
        h = _hashes(3)
        store.write_pages(h[:2], _slots([0, 1]))  # before any lease: no session
        store.retain(h[:2], Retain(60, "5m", "agent-7"))  # pinned after the write ...
        store.write_pages(h[:3], _slots([0, 1, 2]))  # ... and written again (the next turn's backup): named
        sub.poll(0.3)
        stored = [(x, e.session_id) for e in events if type(e).__name__.endswith("BlockStored") for x in e.block_hashes]
        block = pub.format.block_hash
        assert stored == [(block(h[0]), None), (block(h[1]), None), (block(h[0]), "agent-7"), (block(h[1]), "agent-7"),
                          (block(h[2]), None)]  # fmt: skip
    finally:
        store.close()
