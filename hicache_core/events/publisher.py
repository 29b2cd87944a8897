"""``KVEventPublisher``: one ZMQ publisher for every tier hicache owns in a process.

The transport is the servers' own: a PUB socket sends ``(topic, sequence, payload)`` frames, the
sequence an 8-byte big-endian counter from 0, the payload a msgpack ``KVEventBatch`` of the chosen
format (:mod:`hicache_core.events.formats`); a ROUTER socket serves replays: a request of an 8-byte
sequence number gets every buffered batch from it, as the same three frames after the client's
envelope, then the end marker (sequence -1, empty topic and payload). Two requests are hicache's own,
on the same ROUTER socket, so a subscriber that never sends them sees the servers' protocol unchanged:

* ``b"snapshot"``: every page each tier holds now, as ``BlockStored`` batches numbered with the last
  sequence sent; a router that joins late applies them, then every live batch after that number.
* ``b"tiers"``: the tier statistics (:meth:`tier_stats`), one msgpack map.

The statistics are also sent on the PUB socket under ``stats_topic`` every ``stats_interval`` seconds,
but only where ``topic`` is set and no prefix of it: a subscriber to the empty topic receives every
frame, and the servers' decoders would be handed a frame that is not a batch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

from .formats import EventFormat, format_named
from .tiers import Tier

__all__ = ["END_SEQ", "KVEventPublisher"]

log = logging.getLogger(__name__)

#: The replay's end marker (the servers' ``END_SEQ``): sequence -1 as 8 signed big-endian bytes.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
SNAPSHOT_REQUEST = b"snapshot"
TIERS_REQUEST = b"tiers"
#: Block hashes per ``BlockStored`` of a snapshot.
_SNAPSHOT_CHUNK = 512


class KVEventPublisher:
    """Publishes the KV events of the tiers attached to it, in one server's format.

    :param endpoint: the PUB socket's address: ``tcp://*:5560`` binds, ``tcp://host:5560`` connects
        (the servers' rule), ``ipc://`` and ``inproc://`` bind.
    :param format: ``"vllm"``, ``"sglang"`` or an :class:`~hicache_core.events.formats.EventFormat`.
    :param replay_endpoint: the ROUTER socket's address (always bound), or ``None``: no replay, no
        snapshot, no statistics on request.
    :param topic: the topic frame of every batch.
    :param rank: the data-parallel rank each batch names.
    :param buffer_steps: batches kept for replay.
    :param stats_topic: the topic the tier statistics are sent under (see the module's note).
    :param stats_interval: seconds between two statistics messages.
    :param heartbeat: after this many seconds without a batch, an empty one is sent: a router that hears
        nothing for several heartbeats knows this process, and the host and peer tiers in its memory, are gone.

    Attach stores with :meth:`~hicache_core.storage.PageStore.publish_events`. Thread-safe: events are
    queued by any thread and sent by the publisher's own.
    """

    def __init__(self, endpoint: str, *, format: str | EventFormat, replay_endpoint: str | None = None,
                 topic: str = "", rank: int = 0, buffer_steps: int = 10_000, hwm: int = 100_000,
                 stats_topic: str = "hicache.tiers", stats_interval: float = 5.0,
                 heartbeat: float = 1.0) -> None:  # fmt: skip
        try:
            import zmq
        except ImportError as exc:
            raise ImportError("KV events need pyzmq and msgspec: pip install 'hicache-core[events]'") from exc
        self.format = format_named(format) if isinstance(format, str) else format
        if not isinstance(topic, str) or not isinstance(stats_topic, str):
            raise TypeError("topic and stats_topic are str")
        if stats_interval <= 0 or heartbeat <= 0:
            raise ValueError(f"stats_interval and heartbeat are > 0 seconds, got {stats_interval} and {heartbeat}")
        self.heartbeat = float(heartbeat)
        self.topic = topic
        self.rank = int(rank)
        self.stats_topic = stats_topic
        self.stats_interval = float(stats_interval)
        self._send_stats = bool(topic) and not stats_topic.startswith(topic)
        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay = None
        try:
            if endpoint.startswith(("ipc://", "inproc://")) or "*" in endpoint or "0.0.0.0" in endpoint:
                self._pub.bind(endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
            self.replay_endpoint = (self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
                                    if self._replay is not None else None)  # fmt: skip
        except zmq.ZMQError as exc:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            raise OSError(f"KV events: cannot open {endpoint!r} / {replay_endpoint!r}: {exc}") from None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = -1
        self._feeds: list[Any] = []
        self._feeds_lock = threading.Lock()
        self.sent_batches = 0
        self.sent_events = 0
        self._closed = False
        self._linger = 5.0
        self._thread = threading.Thread(target=self._run, name="hicache-kv-events", daemon=True)
        # A restarted instance's earlier announcements are void: said first, before any page.
        self._queue.put((time.time(), self.format.cleared()))
        self._thread.start()

    # ---- what the feeds call ---------------------------------------------------------------------

    def attach(self, feed: Any) -> None:
        """Add a tier's feed (its snapshot and statistics are served from now on)."""
        with self._feeds_lock:
            self._feeds.append(feed)

    def detach(self, feed: Any) -> None:
        """Remove a feed (a closed store)."""
        with self._feeds_lock:
            if feed in self._feeds:
                self._feeds.remove(feed)

    def stored(self, tier: Tier, hashes: list[Any], block_size: int, parent: Any = None,
               group: int | None = None, session: str | None = None) -> None:  # fmt: skip
        """Queue a ``BlockStored``: ``tier`` holds these pages now (event hashes, chain order, one KV-cache group;
        ``session``: the session whose lease holds them)."""
        if hashes:
            self._put(self.format.stored(tier, list(hashes), block_size, parent, group, session))

    def removed(self, tier: Tier, hashes: list[Any], group: int | None = None) -> None:
        """Queue a ``BlockRemoved``: ``tier`` no longer holds these pages (of KV-cache ``group``)."""
        if hashes:
            self._put(self.format.removed(tier, list(hashes), group))

    def _put(self, event: Any) -> None:
        if self._closed:
            raise RuntimeError("this KV event publisher is closed")
        self._queue.put((time.time(), event))

    # ---- statistics --------------------------------------------------------------------------------

    def tier_stats(self) -> dict[str, Any]:
        """Each attached tier's figures: pages held, capacity and bytes used (where the store says), and
        the measured microseconds per page of a load from it and of a store to it (``None`` until measured)."""
        with self._feeds_lock:
            feeds = list(self._feeds)
        return {"ts": time.time(), "rank": self.rank, "format": self.format.name,
                "tiers": [f.stats() for f in feeds]}  # fmt: skip

    # ---- the thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        # The sockets are this thread's alone (ZMQ sockets are not thread-safe): it closes them when it ends.
        try:
            self._loop()
        finally:
            self._pub.close(linger=int(self._linger * 1000))
            if self._replay is not None:
                self._replay.close(linger=0)

    def _loop(self) -> None:
        next_stats = time.monotonic() + self.stats_interval
        self._last_send = time.monotonic()
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    try:
                        self._serve(self._replay.recv_multipart())
                    except Exception:  # a malformed request must not stop the stream
                        log.exception("KV events: a replay request failed")
            try:  # close()'s stop (None) may come first: an empty queue is told from it by the exception
                items = [self._queue.get(timeout=0.02)]
            except queue.Empty:
                items = []
            if items:
                while True:  # everything queued goes in one batch: no waiting, so no added lag
                    try:
                        items.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                stop = any(item is None for item in items)
                events = [item[1] for item in items if item is not None]
                if events:
                    self._send(items[0][0] if items[0] is not None else time.time(), events)
                if stop:
                    return
            if time.monotonic() - self._last_send >= self.heartbeat:
                self._send(time.time(), [])  # an empty batch: the servers' decoders read it; a router sees us alive
            if self._send_stats and time.monotonic() >= next_stats:
                next_stats = time.monotonic() + self.stats_interval
                try:
                    payload = self.format.encode(self.tier_stats())
                    self._pub.send_multipart((self.stats_topic.encode(), self._seq.to_bytes(8, "big", signed=True),
                                              payload))  # fmt: skip
                except Exception:
                    log.exception("KV events: tier statistics not sent")

    def _send(self, ts: float, events: list[Any]) -> None:
        payload = self.format.encode(self.format.batch(ts, events, self.rank))
        self._seq += 1
        self._last_send = time.monotonic()
        self._pub.send_multipart((self.topic.encode(), self._seq.to_bytes(8, "big"), payload))
        self._buffer.append((self._seq, payload))
        self.sent_batches += 1
        self.sent_events += len(events)

    def _serve(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            log.warning("KV events: a replay request of %d frames ignored (expected 3)", len(frames))
            return
        client, empty, request = frames
        topic = self.topic.encode()
        if request == SNAPSHOT_REQUEST:
            seq = self._seq.to_bytes(8, "big", signed=True)
            for payload in self._snapshot():
                self._replay.send_multipart((client, empty, topic, seq, payload))
        elif request == TIERS_REQUEST:
            payload = self.format.encode(self.tier_stats())
            self._replay.send_multipart((client, empty, self.stats_topic.encode(),
                                         self._seq.to_bytes(8, "big", signed=True), payload))  # fmt: skip
        elif len(request) == 8:
            start = int.from_bytes(request, "big")
            for seq, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart((client, empty, topic, seq.to_bytes(8, "big"), payload))
        else:
            log.warning("KV events: an unknown replay request of %d bytes ignored", len(request))
        self._replay.send_multipart((client, empty, b"", END_SEQ, b""))

    def _snapshot(self) -> list[bytes]:
        with self._feeds_lock:
            feeds = list(self._feeds)
        events = []
        for feed in feeds:
            tier, block_size, hashes = feed.snapshot()
            for at in range(0, len(hashes), _SNAPSHOT_CHUNK):
                events.append(self.format.stored(tier, hashes[at : at + _SNAPSHOT_CHUNK], block_size))
        now = time.time()
        return [self.format.encode(self.format.batch(now, events[at : at + 64], self.rank))
                for at in range(0, len(events), 64)] or [self.format.encode(self.format.batch(now, [], self.rank))]

    # ---- life ---------------------------------------------------------------------------------------

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._linger = timeout
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("KV events: the publisher's thread did not end within %s s; it closes its sockets when it "
                        "does", timeout)  # fmt: skip

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<KVEventPublisher {self.format.name} {self.endpoint} seq={self._seq}>"
