"""``LeaseBook``: the leases on one tier's pages, and the order they let the tier evict in.

One book per tier (a host pool's manager, an L3 store, the peer tier's publication area). The
tier keeps its own recency (:class:`~hicache_core.retention.RetentionQueue` for hicache's own
tiers); the book says which of its pages are protected, with what weight, and which go first:

1. pages whose every lease was superseded (an old state of a session) go first;
2. then unleased pages, least recently used first, and leased pages over the cap;
3. then protected pages, lowest weight first (a lease's weight is its priority, decaying after
   its time to live, :meth:`Lease.weight <hicache_core.retention.Lease.weight>`).

**The cap**: protected pages never hold more than ``cap`` of the tier's capacity
(``HICACHE_RETENTION_CAP``, default half). The heaviest leases are protected first; a lease whose
pages do not fit under the cap is held as an ordinary page, and :meth:`LeaseBook.retain` says how
many pages were capped. So leases never starve new requests: the rest of the tier is theirs.

**No lease outlives its end**: every public call first ends the leases whose end has passed, so no
page is protected past it, and what a book keeps is bounded by the live leases (a crashed or
restarted process's leases end with it; its pages in a shared store are ordinary pages again).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .lease import Lease, Retain

__all__ = ["Grant", "LeaseBook"]

#: How many recent drops under a lease a book remembers for ``explain-miss`` (a bounded memory).
RECENT_DROPS = 4096
RANK_REUSE_S = 0.05


@dataclass(frozen=True)
class Grant:
    """What :meth:`LeaseBook.retain` granted: the lease's id, its pages, how many are protected now,
    how many the cap left unprotected, when the lease ends unless refreshed (the book's clock), and how
    the tier's evictions meet it (``"ordered"``, ``"never"``, ``"own"``: see
    :meth:`StorageBackend.attach_leases <hicache_core.storage.StorageBackend.attach_leases>`)."""

    lease_id: int
    pages: int
    protected: int
    capped: int
    ends_at: float
    eviction: str = "ordered"

    def as_dict(self) -> dict[str, Any]:
        return {"lease_id": self.lease_id, "pages": self.pages, "protected": self.protected,
                "capped": self.capped, "ends_at": self.ends_at, "eviction": self.eviction}  # fmt: skip


class LeaseBook:
    """The leases on one tier's pages (see the module's text for the order they give evictions).

    :param tier: the tier's name, in messages and statistics.
    :param capacity: what the tier holds, in the units of ``size_of`` (pages by default); ``None``:
        unbounded, and the cap protects nothing beyond what fits in no capacity (every lease is held).
    :param cap: the share of ``capacity`` protected pages may hold (``HICACHE_RETENTION_CAP``).
    :param decay: a lease's priority decays over ``decay * ttl`` after its time to live (``HICACHE_LEASE_DECAY``).
    :param size_of: the size of a page, in the units of ``capacity`` (``None``: 1 per page).
    :param clock: seconds, monotonic (``time.monotonic``); a simulation passes its own.
    """

    def __init__(self, tier: str, *, capacity: int | None = None, cap: float | None = None,
                 decay: float | None = None, size_of: Callable[[Hashable], int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        from ..settings.variables import LEASE_DECAY, RETENTION_CAP

        cap = RETENTION_CAP.read() if cap is None else cap
        decay = LEASE_DECAY.read() if decay is None else decay
        if not 0.0 <= cap <= 1.0:
            raise ValueError(f"the retention cap is a share of the tier, 0 to 1; got {cap!r} (HICACHE_RETENTION_CAP)")
        if not 0.0 <= decay <= 100.0:
            raise ValueError(f"a lease's decay is a multiple of its time to live, 0 to 100; got {decay!r}")
        if capacity is not None and capacity < 0:
            raise ValueError(f"a tier's capacity is >= 0, got {capacity}")
        self.tier = tier
        self.capacity = capacity
        self.cap = cap
        self.decay = decay
        self.size_of = size_of or (lambda _key: 1)
        self.clock = clock
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._leases: dict[int, Lease] = {}
        self._next_end = float("inf")  # no lease ends before this (a lower bound: refreshes move ends later)
        self._of_key: dict[Hashable, set[int]] = {}
        self._tail: dict[int, Hashable] = {}  # a lease's deepest page: a hit on it continues the session
        self._rank: tuple[float, int, set, dict] | None = None
        self._version = 0
        self._drops: OrderedDict[Hashable, tuple] = OrderedDict()
        self.counters = {"granted": 0, "pages_granted": 0, "capped": 0, "refreshed": 0, "superseded": 0,
                         "ended": 0, "released": 0, "subsumed": 0, "demoted": 0,
                         "dropped_under_lease": 0}  # fmt: skip

    # ---- granting, refreshing, ending --------------------------------------------------------------

    def retain(self, keys: Sequence[Hashable], retain: Retain, *, supersede: bool = False) -> Grant:
        """Lease ``keys`` (a prefix's pages, in chain order) as ``retain`` asks.

        ``supersede``: the session's earlier leases are superseded first (its earlier state may go first);
        pages of this lease keep their protection. Returns the :class:`Grant`.
        """
        if not isinstance(retain, Retain):
            raise TypeError(f"retain takes a Retain, got {type(retain).__name__}")
        keys = list(dict.fromkeys(keys))
        if not keys:
            raise ValueError("a lease needs at least one page")
        with self._lock:
            now = self._tick()
            if supersede:
                if retain.session is None:
                    raise ValueError("supersede needs the session whose earlier state is superseded")
                self._supersede(retain.session, keep=())
            since = now
            if retain.session is not None:
                # The session keeps its place in line: the new lease dates from its oldest live lease.
                since = min([lease.granted_at for lease in self._leases.values() if lease.session == retain.session],
                            default=now)  # fmt: skip
                # Its new state holds its earlier leases' pages: one lease, not a pile of them.
                fresh = set(keys)
                older = [lid for lid, lease in self._leases.items() if lease.session == retain.session
                         and not lease.superseded and lease.keys.keys() <= fresh]  # fmt: skip
                for lid in older:
                    self._end(lid)
                self.counters["subsumed"] += len(older)
            lease = Lease(next(self._ids), retain.priority, retain.ttl_s, retain.ttl_s * self.decay, since, now,
                          retain.session, keys=dict.fromkeys(keys))  # fmt: skip
            self._leases[lease.id] = lease
            self._tail[lease.id] = keys[-1]
            self._next_end = min(self._next_end, lease.ends_at)
            for key in keys:
                self._of_key.setdefault(key, set()).add(lease.id)
                self._drops.pop(key, None)
            self._changed()
            _, protected = self._ranked(now)
            held = sum(1 for k in keys if k in protected)
            self.counters["granted"] += 1
            self.counters["pages_granted"] += len(keys)
            self.counters["capped"] += len(keys) - held
            return Grant(lease.id, len(keys), held, len(keys) - held, lease.ends_at)

    def refresh(self, keys: Sequence[Hashable]) -> int:
        """A hit on ``keys`` (a read, in chain order): the lease whose last page is the deepest page read lives on
        (refresh-on-hit: its session continued).

        Only the deepest page counts: a read through a shared head (a system prompt) on to its own pages
        refreshes no lease that ends in the head, and a last page several leases share refreshes none of them
        (the hit cannot say whose session continued). Those live on through their sessions' own requests
        (:meth:`retain`, :meth:`refresh_session`), or end. Returns how many leases were refreshed (0 or 1).
        """
        if not keys:
            return 0
        deepest = keys[-1]
        with self._lock:
            now = self._tick()
            ids = self._of_key.get(deepest)
            if not ids or len(ids) != 1:
                return 0
            (lid,) = ids
            lease = self._leases[lid]
            if self._tail.get(lid) != deepest or lease.superseded:
                return 0
            lease.refreshed_at = now
            self.counters["refreshed"] += 1
            self._changed()
            return 1

    def refresh_session(self, session: str) -> int:
        """``session`` is active (a new turn): every live lease of it lives on; returns how many."""
        with self._lock:
            now = self._tick()
            leases = [lease for lease in self._leases.values() if lease.session == session and not lease.superseded]
            for lease in leases:
                lease.refreshed_at = now
            if leases:
                self.counters["refreshed"] += len(leases)
                self._changed()
            return len(leases)

    def supersede(self, session: str, keep: Iterable[Hashable] = ()) -> int:
        """``session``'s leases are superseded: their pages go first (``keep``: pages that keep their lease).

        Returns how many leases were superseded.
        """
        with self._lock:
            self._tick()
            return self._supersede(session, keep=set(keep))

    def release(self, *, session: str | None = None, lease_id: int | None = None) -> int:
        """End a lease, or every lease of ``session``, now; returns how many ended."""
        if (session is None) == (lease_id is None):
            raise ValueError("release takes one of session= or lease_id=")
        with self._lock:
            self._tick()
            mine = [lid for lid, lease in self._leases.items()
                    if (lid == lease_id if lease_id is not None else lease.session == session)]  # fmt: skip
            return self._release(mine)

    def release_all(self) -> int:
        """End every lease now (the tier's pages changed meaning: a new weight version); returns how many."""
        with self._lock:
            return self._release(list(self._leases))

    def _release(self, ids: list[int]) -> int:
        for lid in ids:
            self._end(lid)
        self.counters["released"] += len(ids)
        if ids:
            self._changed()
        return len(ids)

    def expire(self) -> int:
        """End every lease whose end has passed; returns how many ended (every public call does this first)."""
        with self._lock:
            before = self.counters["ended"]
            self._tick()
            return self.counters["ended"] - before

    # ---- what the tier asks -------------------------------------------------------------------------

    def rank(self) -> tuple[set, dict]:
        """``(first, protected)``: pages that go first (superseded), and protected pages with their weight.

        A page in neither is an ordinary page (unleased, or leased over the cap).
        """
        with self._lock:
            now = self._tick()
            return self._ranked(now)

    def leased(self, key: Hashable) -> bool:
        """Whether a live lease covers ``key`` (superseded or not, protected or over the cap)."""
        with self._lock:
            self._tick()
            return key in self._of_key

    def weight_of(self, key: Hashable) -> float | None:
        """The weight of ``key``'s heaviest lease now (``None``: no lease); the KV events may carry it."""
        with self._lock:
            now = self._tick()
            ids = self._of_key.get(key)
            return max(self._leases[i].weight(now) for i in ids) if ids else None

    def session_of(self, key: Hashable) -> str | None:
        """The session of ``key``'s heaviest live lease (``None``: no lease, or one of no session)."""
        with self._lock:
            now = self._tick()
            ids = self._of_key.get(key)
            if not ids:
                return None
            return max((self._leases[i] for i in ids), key=lambda x: x.weight(now)).session

    def left_tier(self, keys: Iterable[Hashable], reason: str, *, demoted: Iterable[Hashable] = ()) -> int:
        """Pages left the tier (``reason``: ``"evicted"``, ``"removed"``...); those in ``demoted`` went to the
        next tier. A page that left under a live lease without being demoted is counted dropped, and
        :meth:`why_dropped` says why. Returns how many were dropped under a lease."""
        demoted = set(demoted)
        with self._lock:
            now = self._tick()
            keys = [k for k in keys if k in self._of_key]
            if not keys:  # the common eviction: no page of it was leased, so no ranking to make or invalidate
                return 0
            dropped = 0
            first, protected = self._ranked(now)
            for key in keys:
                ids = self._of_key.pop(key, None)
                if not ids:
                    continue
                if key in demoted:
                    self.counters["demoted"] += 1
                else:
                    dropped += 1
                    self._note_drop(key, ids, reason, now, key in protected, key in first)
                for lid in ids:
                    lease = self._leases[lid]
                    lease.keys.pop(key, None)
                    if not lease.keys:
                        self._leases.pop(lid)
                        self._tail.pop(lid, None)
                        self.counters["ended"] += 1
            self.counters["dropped_under_lease"] += dropped
            self._changed()
            return dropped

    def why_dropped(self, key: Hashable) -> str | None:
        """Why ``key`` was dropped from this tier under a lease, if it was lately (``explain-miss``)."""
        with self._lock:
            facts = self._drops.get(key)
            return None if facts is None else self._drop_text(facts)

    def stats(self) -> dict[str, Any]:
        """Live leases, pages leased and protected, the cap, and the counters."""
        with self._lock:
            now = self._tick()
            first, protected = self._ranked(now)
            past_end = sum(1 for lease in self._leases.values() if not lease.alive(now))
            return {"tier": self.tier, "leases": len(self._leases), "pages_leased": len(self._of_key),
                    "pages_protected": len(protected), "pages_superseded": len(first),
                    "protected_units": sum(self.size_of(k) for k in protected),
                    "cap_units": None if self.capacity is None else self._cap_units(),
                    "leases_past_end": past_end, **self.counters}  # fmt: skip

    def __len__(self) -> int:
        with self._lock:
            self._tick()
            return len(self._leases)

    # ---- internals ----------------------------------------------------------------------------------

    def _tick(self) -> float:
        now = self.clock()
        if now < self._next_end:  # no lease can have ended: refreshes only move ends later
            return now
        ended = [lid for lid, lease in self._leases.items() if not lease.alive(now)]
        for lid in ended:
            self._end(lid)
        if ended:
            self.counters["ended"] += len(ended)
            self._changed()
        self._next_end = min((lease.ends_at for lease in self._leases.values()), default=float("inf"))
        return now

    def _end(self, lid: int) -> None:
        lease = self._leases.pop(lid)
        self._tail.pop(lid, None)
        for key in lease.keys:
            ids = self._of_key.get(key)
            if ids is not None:
                ids.discard(lid)
                if not ids:
                    del self._of_key[key]

    def _supersede(self, session: str, keep: set) -> int:
        count = 0
        for lease in self._leases.values():
            if lease.session == session and not lease.superseded:
                lease.superseded = True
                count += 1
        if keep:  # pages the session keeps: a fresh lease of the same terms holds them
            for lease in [lease for lease in self._leases.values() if lease.session == session and lease.superseded]:
                kept = dict.fromkeys(k for k in lease.keys if k in keep)
                if kept:
                    for key in kept:
                        del lease.keys[key]
                    clone = Lease(next(self._ids), lease.priority, lease.ttl_s, lease.decay_s, lease.granted_at,
                                  lease.refreshed_at, session, keys=kept)  # fmt: skip
                    self._leases[clone.id] = clone
                    self._tail[clone.id] = next(reversed(kept))
                    for key in kept:
                        ids = self._of_key[key]
                        ids.discard(lease.id)
                        ids.add(clone.id)
        self.counters["superseded"] += count
        if count:
            self._changed()
        return count

    def _changed(self) -> None:
        self._version += 1
        self._rank = None

    def _cap_units(self) -> float:
        return float("inf") if self.capacity is None else self.cap * self.capacity

    def _ranked(self, now: float) -> tuple[set, dict]:
        cached = self._rank
        # Weights drift with time only while a lease decays: a ranking 50 ms old orders evictions as well.
        if cached is not None and 0 <= now - cached[0] < RANK_REUSE_S and cached[1] == self._version:
            return cached[2], cached[3]
        weights: dict[Hashable, float] = {}
        for key, ids in self._of_key.items():
            weights[key] = max(self._leases[i].weight(now) for i in ids)
        first = {k for k, w in weights.items() if w < 0}
        room = self._cap_units()
        protected: dict[Hashable, float] = {}
        # Heaviest leases first; among equals the session that has held one longest (a session keeps its place in
        # line from turn to turn, see retain), so what a grant said is protected stays protected while its session
        # comes back within the TTL, and a newcomer cannot push it out. An abandoned session loses its place when
        # its lease starts to decay (a lower weight), one TTL after its last turn.
        for lease in sorted(self._leases.values(), key=lambda x: (-x.weight(now), x.granted_at, x.id)):
            if lease.weight(now) < 0:
                continue
            # A prefix is worth its head: a lease that does not fit whole keeps its first pages.
            for key in lease.keys:
                if key in protected or key in first:
                    continue
                size = self.size_of(key)
                if size > room:
                    break
                room -= size
                protected[key] = weights[key]
            if room <= 0:
                break
        self._rank = (now, self._version, first, protected)
        return first, protected

    def _note_drop(self, key: Hashable, ids: set[int], reason: str, now: float, protected: bool, first: bool) -> None:
        lease = max((self._leases[i] for i in ids), key=lambda x: x.weight(now))
        # Kept as facts; the text is made only when asked (why_dropped): a tier may drop many pages at once.
        self._drops[key] = (reason, lease.id, lease.priority, lease.ttl_s, lease.weight(now), protected, first)
        self._drops.move_to_end(key)
        while len(self._drops) > RECENT_DROPS:
            self._drops.popitem(last=False)

    def _drop_text(self, facts: tuple) -> str:
        reason, lid, priority, ttl_s, weight, protected, first = facts
        if first:
            why = "its lease was superseded (the session's earlier state)"
        elif protected:
            why = "every ordinary page was gone and its lease weighed least"
        else:
            why = f"its lease was over the tier's retention cap ({self.cap:.0%} of the capacity)"
        return (
            f"{reason} from {self.tier} under lease {lid} (priority {priority}, ttl {ttl_s:g} s, weight "
            f"{weight:.1f}): {why}"
        )
