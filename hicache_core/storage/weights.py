"""Weight versions of a page store: which namespace its keys are in now, which it was in before.

A server that updates its weights in place calls :meth:`PageStore.set_weight_version`. From then on:

* every key is in the new version's namespace (``keys.Namespace.weight_version``), so a page of
  the old weights is another key: a read never finds it (a miss, reason ``old_weight_version``
  where it is still stored under one of the last :data:`KEEP` versions);
* while the bound host pool still holds pages it held before the change (computed with the old
  weights), the store writes nothing (each page reports ``skipped``): such a page would land under
  the new version's key. The hold ends when the host pool is cleared (``HostPool.clear``, what a
  server's cache reset calls); a pool that held no page at the change holds nothing old.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from ..pool.slot_events import FreeListener
from .keys import Namespace

#: Earlier namespaces a store remembers, to tell ``old_weight_version`` from ``not_in_store``.
KEEP = 8
OLD_WEIGHT_VERSION = "old_weight_version"


class WeightVersions:
    """A bound store's weight-version history, and the write hold while its host pool holds old pages.

    :param host_pool: the core host pool the store is bound to (its ``clear`` ends a hold).
    """

    def __init__(self, host_pool: Any) -> None:
        self._pool = host_pool
        self._lock = threading.Lock()
        self.previous: deque[Namespace] = deque(maxlen=KEEP)
        self.epoch = 0  # bumped at every change: work started under another epoch is of other weights
        self.hold = ""  # why writes are held ("" when they are not)
        self._listener: FreeListener | None = None

    def switch(self, old: Namespace, new: Namespace) -> None:
        """Remember ``old``; hold writes when the host pool holds pages now (they were computed with ``old``)."""
        with self._lock:
            self.previous = deque((ns for ns in self.previous if ns != new), maxlen=KEEP)
            self.previous.append(old)
            self.epoch += 1
            if _holds_pages(self._pool):
                self.hold = (
                    f"the host pool still holds pages of weight version {old.weight_version!r} (the weights changed "
                    f"to {new.weight_version!r}): nothing is written until it is cleared"
                )
                if self._listener is None:
                    self._listener = FreeListener(self._on_free, self._pool)
                    self._pool.observe(self._listener)

    def _on_free(self, host_pool: Any, slots: Any) -> None:
        if slots is None:  # clear(): every old page is gone
            with self._lock:
                self.hold = ""
                self._stop_listening()

    def _stop_listening(self) -> None:
        if self._listener is not None:
            if self._listener in self._pool.observers:
                self._pool.unobserve(self._listener)
            self._listener = None

    def close(self) -> None:
        with self._lock:
            self._stop_listening()


def _holds_pages(host_pool: Any) -> bool:
    """Whether any slot of ``host_pool`` is allocated (a page the server may load, or write to a store)."""
    return host_pool.available_size() < host_pool.size
