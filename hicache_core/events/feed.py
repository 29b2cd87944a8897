"""``StoreFeed``: what one page store holds, told to a :class:`~hicache_core.events.KVEventPublisher`.

The feed keeps the pages it announced (page hash -> event hash, and the cluster key they were written
under), and is told by its :class:`~hicache_core.storage.PageStore`:

* a page is there: written and acknowledged by the store (``stored``), or read back whole, authenticated
  and checksummed (``seen``). Nothing else makes a ``BlockStored``, so no event names a page a reader
  would refuse;
* a page is gone: the store dropped it and said so (``StorageBackend.report_removed``), a read found it
  missing or refused it, an exists query found it missing, the weights changed (every key moved), the
  cluster key changed (pages under the old key no longer authenticate), the store was cleared;
* what the store does unseen (Redis' or Mooncake's own eviction, a server restarted empty, a file deleted)
  is found by the audit: every ``audit_interval`` seconds a thread asks the store which announced pages
  it still holds, and whether it answers at all. An unreachable store's pages are all removed, kept
  aside, and announced again when it answers with them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from itertools import count
from typing import Any

from .tiers import Tier

__all__ = ["StoreFeed"]

log = logging.getLogger(__name__)

#: Keys per exists query of the audit (the page store's batch).
_AUDIT_BATCH = 128


class StoreFeed:
    """The KV events of one page store's tier.

    :param store: the :class:`~hicache_core.storage.PageStore`.
    :param publisher: the process's :class:`~hicache_core.events.KVEventPublisher`.
    :param tier: which tier the store is (:func:`~hicache_core.events.tiers.tier_of`).
    :param block_hash: the server's event hash of a page hash (the publisher's format's, unless given).
    :param block_size: tokens per page.
    :param audit_interval: seconds between two audits of the store; ``None``: no audit thread
        (:meth:`audit` runs one on request).
    :param chained: the server gives each write's pages in chain order (SGLang), so each page's parent
        is the one before it in the batch.
    """

    def __init__(self, store: Any, publisher: Any, *, tier: Tier, block_size: int,
                 block_hash: Callable[[str], Any] | None = None, audit_interval: float | None = 2.0,
                 chained: bool = False) -> None:  # fmt: skip
        if audit_interval is not None and audit_interval <= 0:
            raise ValueError(f"audit_interval must be > 0 seconds or None, got {audit_interval}")
        self.store = store
        self.publisher = publisher
        self.tier = tier
        self.block_size = int(block_size)
        self.block_hash = block_hash or publisher.format.block_hash
        # The format's KV-cache group of a page hash (vLLM's group_idx), where the hashes are the format's own.
        self.group_of = publisher.format.group_of if block_hash is None else None
        self.chained = chained
        self._lock = threading.RLock()
        # page hash -> (event hash, key id, stamp); the stamp changes with every announcement, so an audit
        # removes only what it found missing, never a page written again since it asked.
        self._held: dict[str, tuple[Any, bytes | None, int]] = {}
        self._aside: dict[str, tuple[Any, bytes | None, int]] = {}  # announced, removed while unreachable
        self._stamps = count()
        # Writes in flight, and when the store reported each page removed meanwhile (see put_started).
        self._puts = 0
        self._ticks = count()
        self._removed_at: dict[str, int] = {}
        self.reachable = True
        self.counts: dict[str, int] = {}
        self._stats: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = None
        publisher.attach(self)
        if audit_interval is not None:
            self._thread = threading.Thread(target=self._audit_loop, args=(float(audit_interval),),
                                            name="hicache-kv-events-audit", daemon=True)  # fmt: skip
            self._thread.start()

    # ---- what the page store says -----------------------------------------------------------------

    def _key_id(self) -> bytes | None:
        key = self.store.cluster_key
        return key.key_id if key is not None else None

    def put_started(self) -> int:
        """A write begins: removals the store reports from now until :meth:`stored` are held against it."""
        with self._lock:
            self._puts += 1
            return next(self._ticks)

    def stored(self, hashes: Sequence[str], parents: Sequence[str | None] | None = None, since: int | None = None
               ) -> None:  # fmt: skip
        """These pages were written and acknowledged, in the current namespace and under the current key.

        ``parents``: each page's parent in its chain (``None``: unknown). ``since``: what :meth:`put_started`
        returned; a page the store reported removed after it (evicted by a later page of the same batch) is
        not there any more, and is not announced.
        """
        with self._lock:
            if since is not None:
                self._puts -= 1
                dropped = {h for h in hashes if self._removed_at.get(h, -1) >= since}
                if dropped:
                    keep = [i for i, h in enumerate(hashes) if h not in dropped]
                    hashes = [hashes[i] for i in keep]
                    parents = [parents[i] for i in keep] if parents is not None else None
                    self._count("not_announced_evicted_in_batch", len(dropped))
                if self._puts == 0:
                    self._removed_at.clear()
            self._announce(hashes, "stored", parents)

    def seen(self, hashes: Sequence[str]) -> None:
        """These pages were read whole and passed every check: announced if not yet."""
        with self._lock:
            new = [h for h in hashes if h not in self._held]
        if new:
            self._announce(new, "seen")

    def _announce(self, hashes: Sequence[str], why: str, parents: Sequence[str | None] | None = None) -> None:
        if not hashes:
            return
        key_id = self._key_id()
        events = [self.block_hash(h) for h in hashes]
        with self._lock:  # the state and the queue in one order, so a snapshot never misses an event
            for h, e in zip(hashes, events):
                self._held[h] = (e, key_id, next(self._stamps))
                self._aside.pop(h, None)
            group = self.group_of
            sessions = self._sessions(hashes)
            if self.chained and parents is not None:
                # One BlockStored per unbroken run of the chain (and of one lease's session), naming the parent
                # of its first page.
                start = 0
                for i in range(1, len(hashes) + 1):
                    if i == len(hashes) or parents[i] != hashes[i - 1] or sessions[i] != sessions[i - 1]:
                        first = parents[start]
                        self.publisher.stored(self.tier, events[start:i], self.block_size,
                                              self.block_hash(first) if first is not None else None,
                                              group(hashes[start]) if group else None, sessions[start])  # fmt: skip
                        start = i
            else:
                for h, e, sid in zip(hashes, events, sessions):
                    self.publisher.stored(self.tier, [e], self.block_size, None, group(h) if group else None, sid)
            self._count(why, len(hashes))

    def _sessions(self, hashes: Sequence[str]) -> list[str | None]:
        """The session of each page's lease in the store, where one holds it (the events' ``session_id``)."""
        book = getattr(self.store, "_leases", None)
        if book is None or not len(book):
            return [None] * len(hashes)
        return [book.session_of(k) for k in self.store.namespace.keys(list(hashes))]

    def gone(self, hashes: Sequence[str], reason: str) -> None:
        """These pages are not in the store, or not readable there: removed if they were announced."""
        if not hashes:
            return
        with self._lock:
            if self._puts:
                tick = next(self._ticks)
                for h in hashes:
                    self._removed_at[h] = tick
            by_group: dict[int | None, list[Any]] = {}
            for h in hashes:
                self._aside.pop(h, None)
                if h in self._held:
                    by_group.setdefault(self.group_of(h) if self.group_of else None, []).append(self._held.pop(h)[0])
            for group, events in by_group.items():
                self.publisher.removed(self.tier, events, group)
                self._count(f"removed_{reason}", len(events))

    def removed_keys(self, full_keys: Sequence[str], reason: str) -> None:
        """The backend's listener (``StorageBackend.report_removed``): full keys it dropped on its own."""
        ns = self.store.namespace
        if ns is None:
            return
        prefix = ns.prefix + "/"
        self.gone([k[len(prefix):] for k in full_keys if k.startswith(prefix)], reason)

    def everything_gone(self, reason: str) -> None:
        """No announced page can be read any more (the weights changed, the store was cleared or closed)."""
        with self._lock:
            self._aside.clear()
            self.gone(list(self._held), reason)

    def key_changed(self) -> None:
        """The store's cluster key changed: pages written under another key no longer authenticate."""
        now = self._key_id()
        with self._lock:
            self._aside = {h: v for h, v in self._aside.items() if v[1] == now}
            self.gone([h for h, v in self._held.items() if v[1] != now], "key_rotated")

    # ---- the audit ----------------------------------------------------------------------------------

    def audit(self) -> dict[str, int]:
        """Ask the store what it still holds of the announced pages; remove what it lost. Returns counts."""
        out = {"checked": 0, "removed": 0, "restored": 0}
        try:
            self.store.ping()
        except Exception as exc:
            if self.reachable:
                log.warning("KV events: %s is unreachable (%s): its pages are announced removed",
                            self.tier.store, type(exc).__name__)  # fmt: skip
            with self._lock:
                self.reachable = False
                held = dict(self._held)
                self.gone(list(held), "unreachable")
                self._aside.update(held)
                out["removed"] = len(held)
            return out
        with self._lock:
            self.reachable = True
            aside = list(self._aside)
        if aside:
            present = self._exists(aside)
            back = [h for h, p in zip(aside, present) if p]
            with self._lock:
                back = [h for h in back if h in self._aside]
                for h in aside:
                    self._aside.pop(h, None)
            self._announce(back, "back")
            out["restored"] = len(back)
        if not type(self.store.backend).capabilities.reads_own_writes:
            return out  # peer://: exists answers for every owner; the owner's own evictions are reported instead
        with self._lock:
            held = [(h, v[2]) for h, v in self._held.items()]
        present = self._exists([h for h, _ in held])
        with self._lock:  # only pages not announced again since the store was asked
            lost = [h for (h, stamp), p in zip(held, present)
                    if not p and h in self._held and self._held[h][2] == stamp]  # fmt: skip
            self.gone(lost, "missing")
        out["checked"] = len(held)
        out["removed"] += len(lost)
        return out

    def _exists(self, hashes: list[str]) -> list[bool]:
        ns = self.store.namespace
        found: list[bool] = []
        for at in range(0, len(hashes), _AUDIT_BATCH):
            found += self.store.backend.exists_objects(ns.keys(hashes[at : at + _AUDIT_BATCH]))
        return found

    def _audit_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.audit()
                self._stats = self._measure()
            except Exception:  # the audit must outlive a store's bad moment
                log.exception("KV events: the audit of %s failed", self.tier.store)

    # ---- what a router reads --------------------------------------------------------------------------

    def snapshot(self) -> tuple[Tier, int, list[Any]]:
        """The tier, its page size in tokens, and the event hashes of every page it holds now."""
        with self._lock:
            return self.tier, self.block_size, [v[0] for v in self._held.values()]

    def held(self) -> set[str]:
        """The page hashes announced and not removed."""
        with self._lock:
            return set(self._held)

    def _measure(self) -> dict[str, Any]:
        figures = self.store.backend.backend_stats()
        return {
            "capacity_bytes": _first(figures, "capacity_bytes", "maxmemory", "segment_bytes"),
            "used_bytes": _first(figures, "used_bytes", "used_memory"),
        }

    def stats(self) -> dict[str, Any]:
        """This tier's figures for the publisher's statistics."""
        s = self.store.get_stats()
        with self._lock:
            pages = len(self._held)
        return {
            "kind": self.tier.kind, "medium": self.publisher.format.medium(self.tier), "store": self.tier.store,
            "locality": self.tier.locality, "reachable": self.reachable, "pages": pages,
            "page_bytes": self.store.page_bytes, "block_size": self.block_size,
            "load_us_per_page": s.read_seconds / s.pages_read * 1e6 if s.pages_read else None,
            "store_us_per_page": s.write_seconds / s.pages_written * 1e6 if s.pages_written else None,
            "leases": self._lease_stats(),
            **{k: v for k, v in self._stats.items()},
        }  # fmt: skip

    def _lease_stats(self) -> dict[str, Any] | None:
        """The tier's leases (live, pages protected, the cap), where any was ever asked for; ``None`` otherwise."""
        book = getattr(self.store, "_leases", None)
        if book is None:
            return None
        s = book.stats()
        return {"eviction": self.store.eviction, **{k: s[k] for k in ("leases", "pages_leased", "pages_protected",
                "cap_units", "dropped_under_lease", "demoted")}}  # fmt: skip

    def _count(self, name: str, n: int) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def close(self, reason: str = "closed") -> None:
        """Stop the audit; a tier whose pages leave with this process (``host``, ``peer``) removes them."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.tier.kind in ("host", "peer"):
            self.everything_gone(reason)
        self.publisher.detach(self)


def _first(figures: dict[str, Any], *names: str) -> Any:
    for name in names:
        value = figures.get(name)
        if isinstance(value, int) and value > 0:
            return value
    return None

