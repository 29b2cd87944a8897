"""``LeaseKeeper``: protected pages kept ahead of a store's own LRU or LFU by touching them.

For a ``"touched"`` store (Redis: ``maxmemory-policy allkeys-lru`` or ``allkeys-lfu``), which evicts by its
own measure of use and cannot be told of leases. Every ``HICACHE_LEASE_TOUCH_S`` a thread touches the book's
protected pages, so they stay recently and frequently used; one it finds gone was evicted by the store under
its lease and is counted so (:meth:`LeaseBook.left_tier`). Only protected pages are touched: leases over the
cap, superseded or ended are left to the store's policy like any other page.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from .book import LeaseBook

__all__ = ["LeaseKeeper"]

_log = logging.getLogger("hicache_core.retention")
#: Keys one touch call carries (a Redis pipeline of TOUCH commands).
TOUCH_BATCH = 512


class LeaseKeeper:
    """A daemon thread touching ``book``'s protected pages in ``backend`` every ``interval`` seconds."""

    def __init__(self, book: LeaseBook, backend: Any, interval: float | None = None) -> None:
        from ..settings.variables import LEASE_TOUCH_S

        self.book = book
        self.backend = backend
        self.interval = LEASE_TOUCH_S.read() if interval is None else float(interval)
        self.rounds = 0
        self.touched = 0
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hicache-lease-keeper", daemon=True)
        self._thread.start()

    def touch_now(self) -> int:
        """Touch the protected pages once; returns how many were found gone (counted dropped under a lease)."""
        _, protected = self.book.rank()
        keys = list(protected)
        gone: list[str] = []
        for start in range(0, len(keys), TOUCH_BATCH):
            batch = keys[start : start + TOUCH_BATCH]
            found = self.backend.touch_objects(batch)
            gone += [k for k, f in zip(batch, found) if not f]
        self.rounds += 1
        self.touched += len(keys) - len(gone)
        if gone:
            self.book.left_tier(gone, "evicted by the store's own policy")
        return len(gone)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            if not len(self.book):
                continue
            try:
                self.touch_now()
            except Exception as exc:  # noqa: BLE001 - an unreachable store: the audit and reads report it
                self.failed += 1
                if self.failed == 1:
                    _log.warning("lease keeper: touching protected pages failed (%s: %s); retrying every %g s",
                                 type(exc).__name__, self.backend.redact(str(exc)), self.interval)  # fmt: skip

    def close(self) -> None:
        """Stop the thread (the page store's ``close``)."""
        self._stop.set()
        self._thread.join(timeout=5)
