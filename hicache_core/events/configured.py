"""The process's publisher, made from the settings (``HICACHE_KV_EVENTS`` and its neighbours), once.

A server adapter calls :func:`publish_store_events` for each store it makes; every store of a process
publishes through one :class:`~hicache_core.events.KVEventPublisher` (one endpoint per process, as the
servers have one per rank). Unset ``HICACHE_KV_EVENTS``: no events, nothing opened.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any

from ..settings.variables import KV_EVENTS, KV_EVENTS_AUDIT_S, KV_EVENTS_REPLAY, KV_EVENTS_TOPIC
from .publisher import KVEventPublisher

__all__ = ["configured_publisher", "publish_store_events"]

_lock = threading.Lock()
_publisher: KVEventPublisher | None = None


def configured_publisher(format: str, rank: int = 0) -> KVEventPublisher | None:
    """The process's publisher in ``format`` (made on the first call), or ``None`` where events are off.

    A rank's endpoints are the configured ones with the port moved up by ``rank`` (the servers' rule
    for data-parallel ranks).
    """
    global _publisher
    endpoint = KV_EVENTS.read()
    if not endpoint:
        return None
    with _lock:
        if _publisher is None:
            replay = KV_EVENTS_REPLAY.read() or None
            _publisher = KVEventPublisher(_offset(endpoint, rank), format=format, rank=rank,
                                          replay_endpoint=_offset(replay, rank) if replay else None,
                                          topic=KV_EVENTS_TOPIC.read())  # fmt: skip
            atexit.register(_publisher.close)
        elif _publisher.format.name != format:
            raise ValueError(f"this process publishes KV events in {_publisher.format.name}'s format; a store "
                             f"asked for {format}'s")  # fmt: skip
        return _publisher


def publish_store_events(store: Any, format: str, *, rank: int = 0, chained: bool = False,
                         block_hash: Any = None) -> Any:  # fmt: skip
    """Attach ``store`` to the configured publisher; returns its feed, or ``None`` where events are off."""
    publisher = configured_publisher(format, rank)
    if publisher is None:
        return None
    return store.publish_events(publisher, audit_interval=KV_EVENTS_AUDIT_S.read(), chained=chained,
                                block_hash=block_hash)  # fmt: skip


def _offset(endpoint: str, rank: int) -> str:
    if rank == 0 or not endpoint.startswith("tcp://"):
        return endpoint if rank == 0 or endpoint.startswith("tcp://") else f"{endpoint}_dp{rank}"
    base, port = endpoint.rsplit(":", 1)
    return f"{base}:{int(port) + rank}"
