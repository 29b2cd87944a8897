"""hicache's KV events of the worker's L3 store, read as a router reads vLLM's: vLLM's own decoder, a real ZMQ SUB.

The worker's block mover attaches its store to hicache's publisher (``HICACHE_KV_EVENTS``); each test here
subscribes to it with a real SUB socket and decodes every frame with ``msgspec.msgpack.Decoder(
vllm.distributed.kv_events.KVEventBatch)``, vLLM 0.32's own classes. The block hashes are those vLLM itself
publishes for the same blocks (``maybe_convert_block_hash(get_offload_block_hash(key))``), so a router's index
of vLLM's GPU tier and of hicache's L3 name a block the same way; the end-to-end check, with vLLM's own events
beside hicache's, is in test_engine.py (``test_l3_events_name_the_blocks_vllm_publishes``).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM's decoder runs in integrations/vllm/dev's environment")

import msgspec  # noqa: E402
import zmq  # noqa: E402
from conftest import AS_GPU_SERVER  # noqa: E402
from hicache_vllm.mover import BlockMover  # noqa: E402
from hicache_vllm.spec import StorageProbe, storage_key  # noqa: E402
from test_mover import BLOCK, finish, pages_of, vllm_cache  # noqa: E402
from vllm.distributed.kv_events import (  # noqa: E402
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)

from hicache_core.testing.servers import free_port  # noqa: E402

TOPIC = "kv@rank0"
#: vLLM's replay end marker (ZmqEventPublisher.END_SEQ).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: How long a test waits for a frame it is owed: a bound against a hang, never a measurement.
PATIENCE_S = 30.0


def offload_key(n: int) -> OffloadKey:
    """A real vLLM offload key: a 32-byte block hash (vLLM's sha256 hashes' size), KV-cache group 0."""
    return make_offload_key(hashlib.sha256(f"block {n}".encode()).digest(), 0)


def vllm_hash(key: OffloadKey) -> int | bytes:
    """What vLLM itself publishes for the block of ``key`` (its offloading events, its GPU tier's)."""
    return maybe_convert_block_hash(get_offload_block_hash(key))


@dataclass
class Stream:
    """A router's side of one publisher: a real SUB socket, every batch decoded with vLLM's own decoder."""

    endpoint: str
    topic: str
    frames: list[tuple[bytes, int, bytes]] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        self.sub.connect(self.endpoint)

    def until(self, done: Callable[[Stream], bool]) -> None:
        """Receive frames until ``done(self)``; fails, saying what came, if the publisher falls silent."""
        deadline = time.monotonic() + PATIENCE_S
        while not done(self):
            left = deadline - time.monotonic()
            if left <= 0 or not self.sub.poll(int(left * 1000)):
                pytest.fail(f"the publisher fell silent; events so far: {self.events}")
            topic, seq, payload = self.sub.recv_multipart()
            batch = self.decoder.decode(payload)  # vLLM's own classes: raises on anything they do not read
            assert batch.data_parallel_rank == 0
            self.frames.append((topic, int.from_bytes(seq, "big"), payload))
            self.events.extend(batch.events)

    def connected(self) -> None:
        """Wait for a first frame (the publisher's AllBlocksCleared, or a heartbeat where the SUB connected after
        it): from then on nothing is lost (PUB drops only frames sent before a subscriber connects)."""
        self.until(lambda s: bool(s.frames))

    def storage_events(self) -> list[Any]:
        return [e for e in self.events if not isinstance(e, AllBlocksCleared)]

    def close(self) -> None:
        self.sub.close(linger=0)


def replay(endpoint: str, start: int) -> list[tuple[bytes, int, bytes]]:
    """vLLM's replay protocol: an 8-byte start sequence to the ROUTER; every buffered batch from it, then the
    end marker (empty topic, sequence -1, empty payload)."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert dealer.poll(int(PATIENCE_S * 1000)), "no answer to a replay request"
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert (topic, payload) == (b"", b"")
                return out
            out.append((topic, int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)


@dataclass(frozen=True)
class Endpoints:
    pub: str  # where a subscriber connects
    replay: str


@pytest.fixture
def kv_events(monkeypatch) -> Iterator[Endpoints]:
    """HICACHE_KV_EVENTS and its replay socket on free ports, and a fresh process publisher for the test.

    ``configured_publisher`` makes one publisher per process (as a server has one per rank); each test here
    needs its own, on its own ports, so the module's publisher is reset around it. The audit runs only when a
    test asks for it (``feed.audit()``), so nothing is removed behind a test's back."""
    from hicache_core.events import configured

    pub, rep = free_port(), free_port()
    monkeypatch.setenv("HICACHE_KV_EVENTS", f"tcp://*:{pub}")
    monkeypatch.setenv("HICACHE_KV_EVENTS_REPLAY", f"tcp://*:{rep}")
    monkeypatch.setenv("HICACHE_KV_EVENTS_TOPIC", TOPIC)
    monkeypatch.setenv("HICACHE_KV_EVENTS_AUDIT_S", "3600")
    monkeypatch.setattr(configured, "_publisher", None)
    yield Endpoints(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}")
    if configured._publisher is not None:
        configured._publisher.close()


def as_gpu_server(monkeypatch, tmp_path: Path) -> None:
    """What a GPU server runs by default (conftest.AS_GPU_SERVER): host-tier verification, and pages keyed with
    the cluster key (a 0600 file of 32 random bytes, in hex as the engines' is)."""
    for name, value in AS_GPU_SERVER.items():
        monkeypatch.setenv(name, value)
    key_file = tmp_path / "cluster.key"
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    monkeypatch.setenv("HICACHE_L3_KEY_FILE", str(key_file))


def object_bytes(tmp_path: Path) -> int:
    """The bytes one page takes in a file:// store here (header, layers, checksum row where verified): measured by
    storing one, before events are on, so the capacity below holds exactly three pages."""
    cache = vllm_cache(7)
    m = BlockMover(pages_of(cache), block_size=BLOCK, num_chunks=4, storage_url=f"file://{tmp_path / 'measure'}",
                   model_id="tiny")  # fmt: skip
    m.submit_store(1, np.array([0]), np.array([0]), storage_keys=[storage_key(offload_key(-1))])
    finish(m, {1})
    m.shutdown()
    (size,) = [p.stat().st_size for p in (tmp_path / "measure").rglob("*") if p.is_file()]
    return size


@pytest.mark.parametrize(
    "server, int_hashes",
    [("cpu", True), ("gpu", True), ("cpu", False)],
    ids=["cpu-int-hashes", "as-gpu-server", "bytes-hashes"],
)
def test_l3_pages_are_announced_in_vllms_format_removed_when_gone_and_replayed(
    kv_events: Endpoints, monkeypatch, tmp_path: Path, server: str, int_hashes: bool
) -> None:
    """Pages written through to L3 under real offload keys: a ``BlockStored`` each, with vLLM's own hash of the
    block, medium STORAGE, the store named; the file store's capacity eviction and a page deleted behind the
    store's back (found by the audit) each a ``BlockRemoved``; vLLM's replay protocol answers the same bytes."""
    if server == "gpu":
        as_gpu_server(monkeypatch, tmp_path)
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1" if int_hashes else "0")
    size = object_bytes(tmp_path)
    stream = Stream(kv_events.pub, TOPIC)
    cache = vllm_cache(8)
    m = BlockMover(pages_of(cache), block_size=BLOCK, num_chunks=8, model_id="tiny",
                   storage_url=f"file://{tmp_path / 'l3'}", storage_options={"capacity": 3 * size})  # fmt: skip
    try:
        assert m.events is not None, "HICACHE_KV_EVENTS is set: the worker's store publishes"
        tier = m.events.tier
        assert (tier.kind, tier.locality) == ("disk", "LOCAL") and tier.store.startswith("file://")
        stream.connected()
        if server == "gpu":
            assert m.storage.cluster_key is not None and m.host.verify, "not run as a GPU server runs"

        keys = [offload_key(n) for n in range(4)]
        want = [vllm_hash(k) for k in keys]
        assert all(isinstance(h, int if int_hashes else bytes) for h in want)
        m.submit_store(1, np.array([3, 1, 7]), np.array([0, 1, 2]), storage_keys=[storage_key(k) for k in keys[:3]])
        finish(m, {1})
        stream.until(lambda s: len(s.storage_events()) >= 3)
        stored = stream.storage_events()
        for event, h, key in zip(stored, want[:3], keys[:3]):
            # One per key, no parent: a store job's keys need not be one prefix's chain (vLLM's own per-key events).
            assert isinstance(event, BlockStored), event
            assert (event.block_hashes, event.parent_block_hash, event.token_ids) == ([h], None, [])
            assert (event.block_size, event.lora_id, event.lora_name) == (BLOCK, None, None)
            assert (event.medium, event.locality, event.ownership) == (MEDIUM_STORAGE, "LOCAL", tier.store)
            assert event.group_idx == get_offload_group_idx(key)  # vLLM's own group_idx of the key

        # A fourth page: the store holds three, so it evicts the least recently used one and says so at once.
        m.submit_store(2, np.array([5]), np.array([3]), storage_keys=[storage_key(keys[3])])
        finish(m, {2})
        stream.until(lambda s: len(s.storage_events()) >= 5)
        removed, fourth = stream.storage_events()[3:5]
        assert isinstance(removed, BlockRemoved) and removed.block_hashes == [want[0]], removed
        assert (removed.medium, removed.locality, removed.ownership, removed.group_idx) == (
            MEDIUM_STORAGE, "LOCAL", tier.store, 0)  # fmt: skip
        assert isinstance(fourth, BlockStored) and fourth.block_hashes == [want[3]], fourth

        # A page deleted behind the worker's back (another instance, an operator): the audit finds it gone.
        ns = m.storage.namespace
        m.storage.backend.remove_objects([ns.key(storage_key(keys[1]))])
        assert m.events.audit()["removed"] == 1
        stream.until(lambda s: len(s.storage_events()) >= 6)
        gone = stream.storage_events()[5]
        assert isinstance(gone, BlockRemoved) and gone.block_hashes == [want[1]], gone

        # The router's index, from the events alone, is what the store holds.
        index: set = set()
        for event in stream.storage_events():
            if isinstance(event, BlockStored):
                index.update(event.block_hashes)
            else:
                index.difference_update(event.block_hashes)
        assert index == {want[2], want[3]}
        present = m.storage.backend.exists_objects(ns.keys([storage_key(k) for k in keys]))
        assert present == [False, False, True, True]

        # vLLM's replay: every batch from a sequence number, the same bytes the SUB socket got, then the end.
        everything = replay(kv_events.replay, 0)
        seqs = [seq for _, seq, _ in everything]
        assert seqs == list(range(len(seqs))) and all(topic == TOPIC.encode() for topic, _, _ in everything)
        by_seq = {seq: payload for _, seq, payload in everything}
        for topic, seq, payload in stream.frames:
            assert (topic, by_seq[seq]) == (TOPIC.encode(), payload)
        first = msgspec.msgpack.Decoder(KVEventBatch).decode(everything[0][2])
        assert isinstance(first.events[0], AllBlocksCleared), "a (re)started publisher first voids what it said"
        later = stream.frames[-1][1]
        assert [seq for _, seq, _ in replay(kv_events.replay, later)] == list(range(later, seqs[-1] + 1))
    finally:
        stream.close()
        m.shutdown()


def test_only_the_workers_store_publishes_not_the_schedulers_probe(kv_events: Endpoints, tmp_path: Path) -> None:
    """The scheduler's probe reaches the same store but never writes: it publishes nothing (vLLM's manager
    publishes the host tier, L3 hits promoted into it included). One tier on the publisher: the worker's."""
    from hicache_vllm.config import HicacheOptions

    from hicache_core.events import configured_publisher

    url = f"file://{tmp_path / 'l3'}"
    stream = Stream(kv_events.pub, TOPIC)
    cache = vllm_cache(9)
    m = BlockMover(pages_of(cache), block_size=BLOCK, num_chunks=4, storage_url=url, model_id="tiny")
    probe = StorageProbe(HicacheOptions(storage_url=url), num_layers=len(cache), page_bytes=pages_of(cache)[0].shape[1],
                         block_size=BLOCK, model_id="tiny")  # fmt: skip
    try:
        stream.connected()
        key = offload_key(0)
        assert not probe.exists(key)  # a miss the probe sees is no removal of anything
        m.submit_store(1, np.array([2]), np.array([0]), storage_keys=[storage_key(key)])
        finish(m, {1})
        assert probe.exists(key), "the probe looks keys up where the worker writes them"
        stream.until(lambda s: len(s.storage_events()) >= 1)
        (stored,) = stream.storage_events()
        assert isinstance(stored, BlockStored) and stored.block_hashes == [vllm_hash(key)]
        publisher = configured_publisher("vllm")
        assert publisher is not None
        assert [t["store"] for t in publisher.tier_stats()["tiers"]] == [m.events.tier.store]
    finally:
        stream.close()
        probe.close()
        m.shutdown()


def test_no_events_without_the_setting(monkeypatch, tmp_path: Path) -> None:
    """HICACHE_KV_EVENTS unset (the default): no feed, no socket."""
    monkeypatch.delenv("HICACHE_KV_EVENTS", raising=False)
    cache = vllm_cache(10)
    m = BlockMover(pages_of(cache), block_size=BLOCK, num_chunks=2, storage_url=f"file://{tmp_path}", model_id="tiny")
    try:
        assert m.events is None
    finally:
        m.shutdown()
