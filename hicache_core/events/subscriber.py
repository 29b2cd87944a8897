"""The router's side: :class:`EventSubscriber` follows a publisher, :class:`EventIndex` holds what it said.

This is what a router built on hicache's events does, written once: subscribe, ask the replay socket for
a snapshot, apply every batch numbered after it, ask for a replay when a number is skipped. The churn
test and the routing benchmark route by it; Dynamo and llm-d do the same with their own code and the
servers' decoders (``docs/kv-events.md``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .formats import EventFormat, format_named
from .publisher import END_SEQ, SNAPSHOT_REQUEST, TIERS_REQUEST

__all__ = ["EventIndex", "EventSubscriber"]


class EventIndex:
    """Which pages each tier holds, from events only: ``(medium, store) -> {block hash}``.

    A ``BlockRemoved`` removes the hashes from the tier it names; ``AllBlocksCleared`` empties every
    tier this index holds (one index per publisher).
    """

    def __init__(self) -> None:
        self.tiers: dict[tuple[str, str | None], set[Any]] = {}

    @staticmethod
    def _store(event: Any) -> str | None:
        return getattr(event, "ownership", None) or getattr(event, "store", None)

    def apply(self, event: Any) -> None:
        """Apply one decoded event (either format)."""
        config = getattr(type(event), "__struct_config__", None)  # the msgpack tag, whoever's struct it is
        kind = getattr(config, "tag", None) or type(event).__name__
        if kind == "BlockStored":
            self.tiers.setdefault((event.medium, self._store(event)), set()).update(event.block_hashes)
        elif kind == "BlockRemoved":
            self.tiers.get((event.medium, self._store(event)), set()).difference_update(event.block_hashes)
        elif kind == "AllBlocksCleared":
            self.tiers.clear()
        else:
            raise ValueError(f"not a KV event: {kind}")

    def holds(self, medium: str, store: str | None, block_hash: Any) -> bool:
        """Whether the events say this tier holds the block."""
        return block_hash in self.tiers.get((medium, store), ())

    def pages(self, medium: str, store: str | None) -> set[Any]:
        """The blocks the events say this tier holds."""
        return set(self.tiers.get((medium, store), ()))


class EventSubscriber:
    """Follows one publisher: a SUB socket for the stream, a DEALER for snapshot, replay and statistics.

    :param endpoint: the publisher's PUB address (``tcp://127.0.0.1:5560``).
    :param replay_endpoint: its ROUTER address, or ``None`` (no snapshot, no replay: a late joiner misses
        what was said before it).
    :param format: the publisher's format.
    :param topic: the topic to subscribe to.
    :param on_batch: called with ``(seq, batch, received_at)`` for every batch applied.
    """

    def __init__(self, endpoint: str, *, format: str | EventFormat, replay_endpoint: str | None = None,
                 topic: str = "", on_batch: Callable[[int, Any, float], None] | None = None) -> None:  # fmt: skip
        import zmq

        self._zmq = zmq
        self.format = format_named(format) if isinstance(format, str) else format
        self.index = EventIndex()
        self.topic = topic
        self.on_batch = on_batch
        ctx = zmq.Context.instance()
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._sub.connect(endpoint)
        self._dealer = None
        if replay_endpoint is not None:
            self._dealer = ctx.socket(zmq.DEALER)
            self._dealer.connect(replay_endpoint)
        self.last_seq = -1
        self.synced = False
        self.replays = 0
        self.gaps = 0
        #: ``time.monotonic()`` of the last frame (the publisher sends an empty batch every heartbeat).
        self.last_heard = time.monotonic()

    def silent_for(self) -> float:
        """Seconds since the publisher was last heard: past a few heartbeats, its host and peer tiers are gone."""
        return time.monotonic() - self.last_heard

    def _request(self, body: bytes, timeout: float) -> list[tuple[bytes, int, bytes]]:
        if self._dealer is None:
            raise RuntimeError("this subscriber has no replay endpoint")
        self._dealer.send_multipart((b"", body))
        out = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._dealer.poll(int(left * 1000)):
                raise TimeoutError(f"the publisher did not answer a {body[:8]!r} request in {timeout} s")
            _, topic, seq, payload = self._dealer.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((topic, int.from_bytes(seq, "big", signed=True), payload))

    def sync(self, timeout: float = 10.0) -> int:
        """Take the publisher's snapshot: the index is what it holds; returns the snapshot's sequence."""
        frames = self._request(SNAPSHOT_REQUEST, timeout)
        self.index = EventIndex()
        for _, _, payload in frames:
            for event in self.format.decode(payload).events:
                self.index.apply(event)
        seq = frames[-1][1] if frames else -1
        self.last_seq = seq
        self.synced = True
        return seq

    def tier_stats(self, timeout: float = 10.0) -> dict[str, Any]:
        """The publisher's tier statistics, asked for on the replay socket."""
        import msgspec

        ((_, _, payload),) = self._request(TIERS_REQUEST, timeout)
        return msgspec.msgpack.decode(payload)

    def poll(self, timeout: float = 0.1) -> int:
        """Apply every batch that arrives in the next ``timeout`` seconds; returns how many.

        A bound on the whole call, not on the gap between two batches: heartbeats never let a stream go quiet.
        """
        applied = 0
        end = time.monotonic() + timeout
        while self._sub.poll(max(0, int((end - time.monotonic()) * 1000))):
            topic, seq_bytes, payload = self._sub.recv_multipart()
            received = time.time()
            self.last_heard = time.monotonic()
            if topic != self.topic.encode():
                continue  # another topic of the same socket (the tier statistics)
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq <= self.last_seq:
                continue  # said in the snapshot, or replayed
            if seq > self.last_seq + 1 and self._dealer is not None and (self.synced or self.last_seq >= 0):
                self.gaps += 1
                self.replays += 1
                for _, rseq, rpayload in self._request((self.last_seq + 1).to_bytes(8, "big"), 10.0):
                    if self.last_seq < rseq < seq:
                        self._apply(rseq, rpayload, time.time())
            self._apply(seq, payload, received)
            applied += 1
        return applied

    def _apply(self, seq: int, payload: bytes, received: float) -> None:
        batch = self.format.decode(payload)
        for event in batch.events:
            self.index.apply(event)
        self.last_seq = seq
        if self.on_batch is not None:
            self.on_batch(seq, batch, received)

    def close(self) -> None:
        """Close the sockets."""
        self._sub.close(linger=0)
        if self._dealer is not None:
            self._dealer.close(linger=0)
