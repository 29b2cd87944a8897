"""hicache's L3 KV events, as SGLang's own code and a router speaking SGLang's protocol see them.

The adapter (``hicache_sglang.storage.publish_events``) attaches every store SGLang's ``dynamic`` backend
makes to the process's publisher (``HICACHE_KV_EVENTS``). Here a real ZMQ SUB socket follows that
publisher, a DEALER asks its replay socket as SGLang's subscribers do, and every frame is decoded with
SGLang's own ``msgspec.msgpack.Decoder(sglang.srt.disaggregation.kv_events.KVEventBatch)``. The pages
come from SGLang's own radix tree and cache controller (the kit's ``build_fixture`` with SGLang's event
recorder on), so the L3 hashes are compared with the GPU- and host-tier hashes SGLang itself publishes;
or from the adapter's calls under page hashes made with SGLang's ``get_hash_str`` chain.

The publisher is one per process (as SGLang's is one per scheduler), so the module shares it; each test
reads the stream from where the one before it stopped.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang_setup import publish_settings

PAGE = 4
#: How long a test waits for a frame it expects: a bound on a hang, never a measurement.
PATIENCE_MS = 60_000


class Stream:
    """The router's side: a SUB socket on hicache's publisher and a DEALER on its replay socket.

    Every frame is decoded with SGLang's decoder; the sequence numbers must follow each other.
    """

    def __init__(self, sub: Any, dealer: Any) -> None:
        import msgspec
        from sglang.srt.disaggregation.kv_events import KVEventBatch

        self.sub = sub
        self.dealer = dealer
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)  # SGLang's own, unchanged
        self.frames: list[tuple[bytes, int, bytes]] = []  # (topic, seq, payload) as received live
        self.batches: list[Any] = []  # the same, decoded by SGLang

    def receive(self) -> Any:
        """The next batch, decoded; a skipped sequence number fails the test."""
        assert self.sub.poll(PATIENCE_MS), "hicache's publisher sent nothing"
        topic, seq_bytes, payload = self.sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        assert len(seq_bytes) == 8
        if self.frames:
            assert seq == self.frames[-1][1] + 1, f"sequence {self.frames[-1][1]} then {seq}"
        batch = self.decoder.decode(payload)
        self.frames.append((topic, seq, payload))
        self.batches.append(batch)
        return batch

    def until(self, done: Callable[[list[Any]], bool]) -> list[Any]:
        """Events received from now on, until ``done(events)`` holds."""
        events: list[Any] = []
        while not done(events):
            events += self.receive().events
        return events

    def replay(self, start: int) -> list[list[bytes]]:
        """SGLang's replay request: an 8-byte big-endian start sequence; the answer frames, END marker included."""
        self.dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert self.dealer.poll(PATIENCE_MS), "no replay answer"
            frames = self.dealer.recv_multipart()
            out.append(frames)
            if frames[2] == (-1).to_bytes(8, "big", signed=True):
                return out


@pytest.fixture(scope="module")
def stream() -> Iterator[Stream]:
    """hicache's configured publisher, connecting to a SUB socket bound here (SGLang's connect-style endpoint).

    Binding the subscriber on a port the OS picks needs no guessed free port; the replay socket binds
    ``tcp://127.0.0.1:*`` likewise. The audit runs only when a test asks (``feed.audit()``).
    """
    import zmq

    from hicache_core.events import configured

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HICACHE_KV_EVENTS", f"tcp://127.0.0.1:{port}")
        mp.setenv("HICACHE_KV_EVENTS_REPLAY", "tcp://127.0.0.1:*")
        mp.setenv("HICACHE_KV_EVENTS_AUDIT_S", "3600")
        mp.setattr(configured, "_publisher", None)  # this module's publisher, not one an earlier module made
        publisher = configured.configured_publisher("sglang")
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(publisher.replay_endpoint)
        s = Stream(sub, dealer)
        # A connecting PUB drops what it sends before the subscription reached it: the first frame that
        # arrives (the heartbeat, an empty batch after a second of silence) says the stream is joined.
        s.receive()
        yield s
        publisher.close()
        dealer.close(linger=0)
        sub.close(linger=0)


def _stored(medium: str) -> Callable[[Any], bool]:
    from sglang.srt.disaggregation.kv_events import BlockStored

    return lambda e: isinstance(e, BlockStored) and e.medium == medium


def _removed(medium: str) -> Callable[[Any], bool]:
    from sglang.srt.disaggregation.kv_events import BlockRemoved

    return lambda e: isinstance(e, BlockRemoved) and e.medium == medium


def _hashes(events: list[Any], which: Callable[[Any], bool]) -> list[int]:
    return [h for e in events if which(e) for h in e.block_hashes]


def _sglang_hashes(tokens: list[int]) -> list[str]:
    """SGLang's page hashes of ``tokens`` from the start: its ``get_hash_str`` chain."""
    from sglang.srt.mem_cache.utils import get_hash_str

    return get_hash_str(tokens, None, page_size=PAGE)


def _event_hash(page_hash: str) -> int:
    from sglang.srt.mem_cache.utils import hash_str_to_int64

    return hash_str_to_int64(page_hash)


# ---- SGLang's radix tree and cache controller, writing to hicache's file:// store ---------------------


def _passing_prefix_keys(config: str) -> str:
    """SGLang's ``hicache_storage_pass_prefix_keys``: its controller then names the hashes before each batch."""
    import json

    return json.dumps({**json.loads(config), "hicache_storage_pass_prefix_keys": True})


@pytest.fixture
def tree(stream: Stream, tmp_path: Path) -> Iterator[Any]:
    """SGLang's radix cache with its KV-event recorder, its HiCache and hicache's file:// L3 (``dynamic``)."""
    from hicache_sglang.storage import extra_config
    from radix_kit import kit_pointed_at, make_case
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from sglang.test.kits.unified_radix_cache.fixtures import build_fixture

    case = make_case(PAGE)
    try:
        # One rank, as the kit's own file-backend setup states it (no distributed state in a unit test).
        with kit_pointed_at("mha", "page_first", "kernel", 0), \
                get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1):  # fmt: skip
            cache, alloc, rtp = build_fixture(case.cfg, enable_kv_cache_events=True)
            args = ServerArgs(model_path="dummy", served_model_name="kv-events", page_size=PAGE,
                              hicache_io_backend="kernel", hicache_mem_layout="page_first",
                              hicache_write_policy="write_through", hicache_storage_backend="dynamic",
                              hicache_storage_backend_extra_config=_passing_prefix_keys(
                                  extra_config(f"file://{tmp_path / 'l3'}")),
                              hicache_storage_prefetch_policy="wait_complete")  # fmt: skip
            set_global_server_args_for_scheduler(args)
            cache.init_hicache(args, cache.cache_init_params)
            case.addCleanup(cache.cache_controller.storage_backend.close)  # detaches its feed from the publisher
            case.addCleanup(cache.release_host_resources)
            case.addCleanup(cache.cache_controller._stop_storage_threads)
            yield case, cache, alloc, rtp
    finally:
        case.doCleanups()


def test_sglangs_own_backups_are_announced_under_the_hashes_sglang_publishes_for_its_gpu_tier(stream, tree):
    from sglang.srt.disaggregation.kv_events import StorageMedium
    from sglang.test.kits.unified_radix_cache.fixtures import match_prefix

    from hicache_core.events import StoreFeed

    case, cache, alloc, rtp = tree
    storage = cache.cache_controller.storage_backend
    assert isinstance(storage.events, StoreFeed)  # the adapter attached its store: rank 0 publishes
    # Two radix nodes: a 6-page prompt, then the same prompt with 3 more pages (a child node).
    first = list(range(1, 1 + 6 * PAGE))
    longer = first + list(range(500, 500 + 3 * PAGE))
    case._insert(cache, alloc, rtp, first)
    case._insert(cache, alloc, rtp, longer)
    leaf = match_prefix(cache, longer).last_device_node
    case._backup_node(cache, leaf)
    case._write_path_to_l3(cache, leaf)
    case._flush_l3_backups(cache)

    pages = case._all_page_hashes(cache, leaf)  # the keys SGLang's controller gave the store
    assert pages == _sglang_hashes(longer)  # SGLang's get_hash_str chain, computed apart from the tree
    chain = [_event_hash(h) for h in pages]
    sglang_events = cache.take_events()  # what SGLang's scheduler would publish on --kv-events-config
    gpu = _hashes(sglang_events, _stored(StorageMedium.GPU.value))
    host = _hashes(sglang_events, _stored(StorageMedium.CPU.value))
    assert gpu == chain and sorted(host) == sorted(chain)

    disk = StorageMedium.DISK.value
    events = stream.until(lambda ev: set(_hashes(ev, _stored(disk))) >= set(chain))
    l3 = [e for e in events if _stored(disk)(e)]
    assert set(_hashes(l3, _stored(disk))) == set(chain)  # the servers' own hashes: a router's GPU index matches
    for e in l3:
        # chained: each event is a run of the chain in SGLang's order (one node's pages, or a batch of them)
        at = chain.index(e.block_hashes[0])
        assert e.block_hashes == chain[at : at + len(e.block_hashes)]
        assert e.block_size == PAGE
    # each node's backup is one write, announced whole: its pages in chain order
    runs = [e.block_hashes for e in l3]
    assert chain[:6] in runs and chain[6:] in runs
    # with SGLang's prefix keys, each run names its parent as SGLang's own GPU events do: the child node's
    # first page links to the parent node's last; the first node starts at the root
    parents = {tuple(e.block_hashes): e.parent_block_hash for e in l3}
    assert parents[tuple(chain[6:])] == chain[5] and parents[tuple(chain[:6])] is None
    gpu_parents = {}  # SGLang's recorder merges a chain's events: a page's parent is the page before it
    for e in filter(_stored(StorageMedium.GPU.value), sglang_events):
        gpu_parents.update(zip(e.block_hashes, [e.parent_block_hash, *e.block_hashes[:-1]]))
    assert gpu_parents[chain[6]] == chain[5] and gpu_parents[chain[0]] is None


def test_pages_the_store_lost_or_the_weights_left_are_removed(stream, tree):
    from sglang.srt.disaggregation.kv_events import StorageMedium
    from sglang.test.kits.unified_radix_cache.fixtures import match_prefix

    case, cache, alloc, rtp = tree
    disk = StorageMedium.DISK.value
    tokens = list(range(7, 7 + 4 * PAGE))
    chain = [_event_hash(h) for h in _sglang_hashes(tokens)]
    case._insert(cache, alloc, rtp, tokens)
    leaf = match_prefix(cache, tokens).last_device_node
    case._backup_node(cache, leaf)
    case._write_path_to_l3(cache, leaf)
    case._flush_l3_backups(cache)
    stream.until(lambda ev: set(_hashes(ev, _stored(disk))) >= set(chain))

    storage = cache.cache_controller.storage_backend
    store, feed = storage.store, storage.events
    pages = _sglang_hashes(tokens)
    # Deleted behind the store's back (an operator, another instance's eviction): the audit finds it.
    store.backend.remove_objects(store.namespace.keys(pages[2:]))
    assert feed.audit()["removed"] == 2
    gone = stream.until(lambda ev: _hashes(ev, _removed(disk)) != [])
    assert _hashes(gone, _removed(disk)) == chain[2:]
    # New weights: no page of the old ones is read again, so every announced page is removed.
    assert storage.set_weight_version("step-2", reason="a test's update") is True
    gone = stream.until(lambda ev: set(chain[:2]) <= set(_hashes(ev, _removed(disk))))
    assert set(_hashes(gone, _removed(disk))) >= set(chain[:2])
    assert not feed.held()


def test_a_router_that_joined_late_replays_the_stream_as_sglangs_subscribers_ask(stream):
    """SGLang's replay protocol: an 8-byte start sequence to the ROUTER socket; every buffered batch from
    it as (topic, sequence, payload) after the client's envelope, the very bytes sent live, then the END
    marker (SGLang's ``ZmqEventPublisher.END_SEQ``, empty topic and payload)."""
    from sglang.srt.disaggregation.kv_events import AllBlocksCleared, ZmqEventPublisher

    assert stream.frames, "the module's stream has its first frame"
    answer = stream.replay(0)
    *batches, end = answer
    assert end == [b"", b"", ZmqEventPublisher.END_SEQ, b""]
    assert [int.from_bytes(f[2], "big") for f in batches] == list(range(len(batches)))
    # the first batch of a (re)started publisher: earlier announcements of this instance are void
    assert any(isinstance(e, AllBlocksCleared) for e in stream.decoder.decode(batches[0][3]).events)
    live = {seq: (topic, payload) for topic, seq, payload in stream.frames}
    replayed = {int.from_bytes(f[2], "big"): (f[1], f[3]) for f in batches}
    assert live.items() <= replayed.items()  # what the router missed is what was sent, byte for byte
    # from the middle: only what follows
    mid = stream.frames[-1][1]
    tail = stream.replay(mid)
    assert [int.from_bytes(f[2], "big") for f in tail[:-1]][0] == mid


def test_an_idle_publishers_heartbeat_is_an_empty_batch_sglang_decodes(stream):
    from sglang.srt.disaggregation.kv_events import KVEventBatch

    # nothing is queued now: the next frame with no event is a heartbeat
    heartbeat = stream.receive()
    while heartbeat.events:  # a late event of the test before (an audit's removal) comes first
        heartbeat = stream.receive()
    assert isinstance(heartbeat, KVEventBatch) and heartbeat.events == [] and heartbeat.attn_dp_rank == 0


# ---- the adapter's calls, under SGLang's page hashes --------------------------------------------------


def _host(verify: bool = False) -> Any:
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
    from sglang_setup import device_pool

    publish_settings(layout="page_first", io_backend="kernel", page_size=PAGE)
    dev = device_pool("mha", PAGE)
    host = hybrid_pool_assembler.build_kv_host_pool(kv_pool=dev, page_size=PAGE, use_mla=False)
    raw = host.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(3)))
    assert host.core.verify == verify  # host-tier verification as asked (HICACHE_VERIFY)
    return host


def _storage(host: Any, url: str, *, tp_rank: int = 0, tp_size: int = 1) -> Any:
    from hicache_sglang.storage import HicacheStorage
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    config = HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                  attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                                  is_page_first_layout=True, model_name="kv-events",
                                  extra_config={"url": url, "interface_v1": 1})  # fmt: skip
    storage = HicacheStorage(config)
    storage.register_mem_pool_host(host)
    return storage


def test_a_shared_redis_tier_is_external_and_names_its_store(stream, tmp_path):
    from sglang.srt.disaggregation.kv_events import StorageMedium

    from hicache_core.events import SGLANG
    from hicache_core.testing.servers import start_redis

    redis = start_redis(tmp_path)
    storage = None
    try:
        storage = _storage(_host(), f"redis://127.0.0.1:{redis.port}/0")
        external = StorageMedium.EXTERNAL.value
        pages = _sglang_hashes(list(range(900, 900 + 3 * PAGE)))
        chain = [_event_hash(h) for h in pages]
        assert storage.batch_set_v1(pages, torch.arange(1 * PAGE, 4 * PAGE)) == [True] * 3
        mark = len(stream.frames)
        (stored,) = [e for e in stream.until(lambda ev: _hashes(ev, _stored(external)) != []) if _stored(external)(e)]
        assert stored.block_hashes == chain  # one write, SGLang's chain order
        # Any instance reaching this store can load the page: hicache's ``store`` field says which (no password,
        # no query). SGLang's decoder skips the field; hicache's own reads it from the same bytes.
        assert not hasattr(stored, "store")
        ours = [e for _, _, payload in stream.frames[mark:] for e in SGLANG.decode(payload).events]
        assert {e.store for e in ours if e.medium == external} == {f"redis://127.0.0.1:{redis.port}/0"}
        store = storage.store
        store.backend.remove_objects(store.namespace.keys(pages[:1]))  # Redis' own eviction, say
        assert storage.events.audit()["removed"] == 1
        assert _hashes(stream.until(lambda ev: _hashes(ev, _removed(external)) != []), _removed(external)) == chain[:1]
    finally:
        if storage is not None:
            storage.close()
        redis.stop()


@pytest.fixture
def gpu_server_defaults(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """As a GPU server runs by default: host-tier verification on, the L3 pages keyed with the cluster key."""
    key_dir = tempfile.mkdtemp(prefix="hicache-kv-events-key-")
    path = os.path.join(key_dir, "cluster.key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    monkeypatch.setenv("HICACHE_VERIFY", "1")
    monkeypatch.setenv("HICACHE_L3_KEY_FILE", path)
    yield path
    shutil.rmtree(key_dir, ignore_errors=True)


def test_keyed_and_verified_pages_are_announced_once_written_and_removed_when_the_key_rotates(
    stream, gpu_server_defaults, tmp_path
):
    from sglang.srt.disaggregation.kv_events import StorageMedium

    from hicache_core.storage.page_auth import ClusterKey

    disk = StorageMedium.DISK.value
    host = _host(verify=True)
    storage = _storage(host, f"file://{tmp_path / f'keyed-{uuid.uuid4().hex[:6]}'}")
    try:
        assert storage.store.cluster_key is not None
        pages = _sglang_hashes(list(range(40, 40 + 2 * PAGE)))
        chain = [_event_hash(h) for h in pages]
        assert storage.batch_set_v1(pages, torch.arange(1 * PAGE, 3 * PAGE)) == [True, True]
        events = stream.until(lambda ev: _hashes(ev, _stored(disk)) != [])
        assert _hashes(events, _stored(disk)) == chain
        # read back, authenticated: the page was announced already, so no second BlockStored
        assert storage.batch_get_v1(pages, torch.arange(5 * PAGE, 7 * PAGE)) == [True, True]
        storage.store.rotate_cluster_key(ClusterKey(secrets.token_bytes(32), "a test's rotation"))
        events = stream.until(lambda ev: _hashes(ev, _removed(disk)) != [])
        assert _hashes(events, _stored(disk)) == []  # the read announced nothing new
        assert sorted(_hashes(events, _removed(disk))) == sorted(chain)  # unreadable under the new key
    finally:
        storage.close()


def test_only_the_rank_sglang_publishes_from_attaches_its_store(stream, tmp_path):
    """SGLang publishes from pp rank 0, attention-TP rank 0, attention-CP rank 0, under the attention-DP rank."""
    from hicache_sglang.storage import kv_event_rank
    from sglang.srt.runtime_context import get_parallel

    url = f"file://{tmp_path / 'ranks'}"
    one = dict(pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1)  # no pipeline, no context parallelism
    with get_parallel().override(tp_rank=1, tp_size=2, attn_tp_rank=1, attn_tp_size=2, attn_dp_size=1,
                                 attn_dp_rank=0, dp_rank=None, moe_tp_size=2, **one):  # fmt: skip
        storage = _storage(_host(), url, tp_rank=1, tp_size=2)
        try:
            assert storage.store is not None and storage.events is None  # writes its share, announces nothing
        finally:
            storage.close()
    with get_parallel().override(tp_rank=3, tp_size=4, attn_tp_rank=0, attn_tp_size=1, attn_dp_size=4,
                                 attn_dp_rank=3, dp_rank=0, moe_tp_size=4, **one):  # fmt: skip
        assert kv_event_rank(None) == 3  # DP attention: SGLang names the attention-DP rank
    with get_parallel().override(tp_rank=0, tp_size=1, attn_tp_rank=0, attn_tp_size=1, attn_dp_size=1,
                                 attn_dp_rank=0, dp_rank=2, **one):  # fmt: skip
        assert kv_event_rank(None) == 2  # plain data parallelism: the replica's
    with get_parallel().override(tp_rank=0, tp_size=1, attn_tp_rank=0, attn_tp_size=1, attn_dp_size=1,
                                 attn_dp_rank=0, dp_rank=None, **{**one, "pp_rank": 1, "pp_size": 2}):  # fmt: skip
        assert kv_event_rank(None) is None  # a later pipeline stage
