"""``RetentionQueue``: a tier's pages by recency, evicted in the order its leases allow.

The eviction queue of hicache's own tiers (``memory://`` and ``file://`` with a capacity, the peer
tier's publication area): least recently used first, as before, until a :class:`LeaseBook` holds
leases; then superseded pages first, ordinary pages by recency, and protected pages last, lowest
weight first. Protected pages are still evicted when nothing else is left, so a write is never
refused because of a lease.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from .book import LeaseBook

__all__ = ["RetentionQueue", "eviction_walk"]


class RetentionQueue:
    """Pages of one tier with their sizes, least recently used first, and the tier's :class:`LeaseBook`.

    :param book: the tier's leases (``None``: plain LRU; :meth:`attach` sets one later).
    :param demote: called with the victims that leave under a live lease, before they are dropped;
        returns the keys it moved to the next tier (which then count as demoted, not dropped).
    """

    def __init__(self, book: LeaseBook | None = None,
                 demote: Callable[[list[Hashable]], Iterable[Hashable]] | None = None) -> None:  # fmt: skip
        self._lock = threading.RLock()
        self._pages: OrderedDict[Hashable, int] = OrderedDict()
        self.used = 0
        self.book = book
        self.demote = demote

    def attach(self, book: LeaseBook) -> None:
        """Order evictions by ``book``'s leases from now on; its sizes are this queue's."""
        book.size_of = lambda key: self._pages.get(key, 0)
        self.book = book

    def __contains__(self, key: Hashable) -> bool:
        return key in self._pages

    def __len__(self) -> int:
        return len(self._pages)

    def keys(self) -> list[Hashable]:
        """The pages, least recently used first."""
        with self._lock:
            return list(self._pages)

    def add(self, key: Hashable, size: int) -> None:
        """``key`` was stored (or stored again): the most recently used, of ``size`` units."""
        with self._lock:
            self.used -= self._pages.pop(key, 0)
            self._pages[key] = size
            self.used += size

    def touch(self, keys: Iterable[Hashable]) -> None:
        """``keys`` were read (in chain order): the most recently used, and the lease ending at the deepest
        refreshed (:meth:`LeaseBook.refresh`)."""
        keys = list(keys)
        with self._lock:
            for key in keys:
                if key in self._pages:
                    self._pages.move_to_end(key)
        if self.book is not None and keys:
            self.book.refresh(keys)

    def remove(self, keys: Iterable[Hashable], reason: str = "removed") -> int:
        """``keys`` left the tier on purpose (deleted, cleared); returns the units freed."""
        keys = list(keys)
        freed = 0
        with self._lock:
            for key in keys:
                size = self._pages.pop(key, None)
                if size is not None:
                    self.used -= size
                    freed += size
        if self.book is not None and keys:
            self.book.left_tier(keys, reason)
        return freed

    def clear(self) -> None:
        """Every page left the tier."""
        self.remove(self.keys(), "cleared")

    def evict(self, need: int, skip: Sequence[Hashable] | frozenset = frozenset()) -> list[Hashable]:
        """Choose and remove pages worth at least ``need`` units (fewer only when nothing else is left).

        ``skip``: pages that must stay (a batch being written). Victims under a live lease are offered to
        ``demote`` first; the book counts each as demoted or dropped. Returns the victims, in eviction order.
        """
        if need <= 0:
            return []
        skip = frozenset(skip)
        with self._lock:
            victims = self._choose(need, skip)
            for key in victims:
                self.used -= self._pages.pop(key)
        if self.book is not None and victims:
            leased = [k for k in victims if self.book.leased(k)]
            moved = set(self.demote(leased)) if leased and self.demote is not None else set()
            self.book.left_tier(victims, "evicted", demoted=moved)
        return victims

    def _choose(self, need: int, skip: frozenset) -> list[Hashable]:
        chosen: list[Hashable] = []
        got = 0
        if self.book is None or not len(self.book):
            for key, size in self._pages.items():  # plain LRU
                if got >= need:
                    break
                if key not in skip:
                    chosen.append(key)
                    got += size
            return chosen
        for key in eviction_walk(self._pages, self.book):
            if got >= need:
                break
            if key not in skip:
                chosen.append(key)
                got += self._pages[key]
        return chosen


def eviction_walk(by_recency: Mapping[Hashable, Any], book: LeaseBook) -> Iterator[Hashable]:
    """A tier's pages in the order its leases let it evict them: superseded pages, then ordinary
    pages, each by recency (``by_recency``: least recently used first; a lazy walk that stops when the caller does),
    then protected pages lightest first. For a tier that keeps its own recency (the peer tier's area)."""
    first, protected = book.rank()
    if first:
        yield from (k for k in by_recency if k in first)
    yield from (k for k in by_recency if k not in first and k not in protected)
    yield from sorted((k for k in protected if k in by_recency), key=protected.__getitem__)
