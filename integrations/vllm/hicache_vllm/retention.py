"""Retention on vLLM's host tier: a request's hints, and an LRU cache policy that honours leases.

**Hints** come in what vLLM's offloading manager receives for a request (``ReqContext``):

* ``kv_transfer_params`` (the OpenAI server's request field; ``SamplingParams.extra_args["kv_transfer_params"]``
  offline): ``"hicache": {"priority": 90, "ttl": "10m", "session": "s1", "supersede": false}`` and/or Dynamo's
  ``"cache_control": {"type": "ephemeral", "ttl": "5m"}``;
* ``kv_hints`` (``KvHintsEnvelope``): one action of ``action_type`` ``"hicache.retain"``, ``action_version``
  ``"1"``, whose payload has the fields of ``"hicache"``.

They are read once per request (:func:`request_hints`, from the manager's ``on_new_request``) by
:func:`hicache_core.retention.hints.hints_from_mapping`: strict, a malformed hint is refused naming the field.
vLLM 0.32 has no per-request error path from an offloading manager (the scheduler calls it while adding the
request, and an exception there ends the EngineCore and every request it serves), so a refused hint does not
fail its request: the request is served without a lease, and the refusal is an error in the engine's log
("hicache-vllm: request <id>: retention hint refused: ...") and a count (``vllm:hicache_host_hints_refused``).
One client's bad hint never stops the server; it is never taken in part or silently ignored. A front end
that wants to answer the client with the refusal checks the hint first with :func:`parse_request_hints`.

**The policy** (:class:`HicacheCachePolicy`, ``eviction_policy: "lru"``, the default) is vLLM's LRU policy
until leases exist; then it evicts in the order of a :class:`~hicache_core.retention.LeaseBook` over the host
chunks: pages whose leases were all superseded first, then ordinary pages (unleased, or leased over the
cap) least recently used first, then protected pages lightest first. Pages vLLM protects (``protected``, a
store's own keys) and pages in use are never evicted; an eviction that cannot free ``n`` chunks changes
nothing (``None``). A lease is granted when its request finishes, on the request's pages in prefix order;
a new request of the session keeps the session's leases alive; a hit on a lease's last page refreshes it.
A leased page the host tier evicts counts as demoted where L3 holds it, dropped otherwise.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata, OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus, order_request_keys
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

from hicache_core.retention import Grant, LeaseBook
from hicache_core.retention.hints import HINT_FIELDS, RetentionHints, hints_from_mapping

logger = init_logger(__name__)

#: The ``kv_hints`` action hicache reads, and the version of its payload.
ACTION_TYPE = "hicache.retain"
ACTION_VERSION = "1"
#: The key of hicache's hints in ``kv_transfer_params`` (Dynamo's ``cache_control`` sits beside it).
PARAMS_KEY = "hicache"
#: The name :class:`HicacheCachePolicy` is registered under in vLLM's ``CachePolicyFactory``.
POLICY_NAME = "hicache_lru"
HOST_TIER = "vLLM host tier"

_NO_HINTS = RetentionHints()


def parse_request_hints(kv_transfer_params: Mapping[str, Any] | None, kv_hints: Any = None) -> RetentionHints:
    """A request's hints from its ``kv_transfer_params`` and ``kv_hints``; ``ValueError`` naming what is wrong."""
    from_params = None
    if kv_transfer_params is not None:
        if not isinstance(kv_transfer_params, Mapping):
            raise ValueError(f"kv_transfer_params is an object, got {type(kv_transfer_params).__name__}")
        hicache, cache_control = kv_transfer_params.get(PARAMS_KEY), kv_transfer_params.get("cache_control")
        if hicache is not None or cache_control is not None:
            from_params = hints_from_mapping(hicache, cache_control=cache_control,
                                             where=f"kv_transfer_params['{PARAMS_KEY}']")  # fmt: skip
    from_action = None
    actions = [a for a in getattr(kv_hints, "actions", None) or () if a.action_type == ACTION_TYPE]
    if len(actions) > 1:
        raise ValueError(f"kv_hints has {len(actions)} {ACTION_TYPE!r} actions "
                         f"({', '.join(repr(a.action_id) for a in actions)}); a request takes one")  # fmt: skip
    if actions:
        action = actions[0]
        where = f"kv_hints action {action.action_id!r} ({ACTION_TYPE})"
        if action.action_version != ACTION_VERSION:
            raise ValueError(f"{where}: action_version {action.action_version!r} is not served (hicache reads "
                             f"version {ACTION_VERSION!r}: fields {', '.join(HINT_FIELDS)})")  # fmt: skip
        from_action = hints_from_mapping(action.payload, where=f"{where} payload")
    if from_params and from_action:
        raise ValueError(f"retention hints came in both kv_transfer_params and kv_hints ({ACTION_TYPE}); "
                         "send them in one")  # fmt: skip
    return from_params or from_action or _NO_HINTS


def request_hints(req_context: ReqContext) -> RetentionHints:
    """The request's hints, read on first use and kept in its ``ReqContext`` (vLLM's per-request state).

    A malformed hint is refused whole: logged as an error naming the request and the field, counted
    (:data:`refused_hints`), and the request gets no lease (see the module's text for why not an exception).
    """
    hints = req_context.get_state(RetentionHints)
    if hints is None:
        try:
            hints = parse_request_hints(req_context.kv_transfer_params, req_context.kv_hints)
        except ValueError as exc:
            refused_hints.append(req_context.req_id)
            logger.error("hicache-vllm: request %s: retention hint refused: %s; the request is served without a "
                         "lease", req_context.req_id, exc)  # fmt: skip
            hints = _NO_HINTS
        req_context.set_state(hints)
    return hints


class _Refused(list):
    """Request ids whose hint was refused, the newest :data:`REFUSED_KEPT` (the count goes on past them)."""

    count = 0

    def append(self, req_id: str) -> None:
        type(self).count += 1
        super().append(req_id)
        del self[:-REFUSED_KEPT]


REFUSED_KEPT = 64
#: Requests whose retention hint was refused in this process (``.count``: how many since it started).
refused_hints = _Refused()


#: The host tier's retention metrics (vLLM's offloading metrics: Prometheus, ``LLM.get_metrics()``).
METRICS: dict[str, Any] = {
    "vllm:hicache_host_leases": OffloadingGaugeMetadata(documentation="Live leases on vLLM's host tier (hicache)."),
    "vllm:hicache_host_pages_leased": OffloadingGaugeMetadata(documentation="Host chunks under a live lease."),
    "vllm:hicache_host_pages_protected": OffloadingGaugeMetadata(
        documentation="Host chunks a lease protects now (under the retention cap: evicted last)."),
    "vllm:hicache_host_leases_granted": OffloadingCounterMetadata(documentation="Leases granted on the host tier."),
    "vllm:hicache_host_pages_capped": OffloadingCounterMetadata(
        documentation="Pages granted a lease that the retention cap left unprotected."),
    "vllm:hicache_host_pages_demoted": OffloadingCounterMetadata(
        documentation="Leased host chunks evicted while L3 held their page (demoted to L3)."),
    "vllm:hicache_host_pages_dropped_under_lease": OffloadingCounterMetadata(
        documentation="Leased host chunks evicted that L3 did not hold (dropped from every tier)."),
    "vllm:hicache_host_hints_refused": OffloadingCounterMetadata(
        documentation="Requests whose retention hint was malformed and refused (served without a lease)."),
}  # fmt: skip
_GAUGES = {"vllm:hicache_host_leases": "leases", "vllm:hicache_host_pages_leased": "pages_leased",
           "vllm:hicache_host_pages_protected": "pages_protected"}  # fmt: skip
_COUNTERS = {"vllm:hicache_host_leases_granted": "granted", "vllm:hicache_host_pages_capped": "capped",
             "vllm:hicache_host_pages_demoted": "demoted",
             "vllm:hicache_host_pages_dropped_under_lease": "dropped_under_lease",
             "vllm:hicache_host_hints_refused": "hints_refused"}  # fmt: skip


class HicacheCachePolicy(LRUCachePolicy):
    """vLLM's LRU cache policy with a :class:`~hicache_core.retention.LeaseBook` over the host chunks.

    Without leases it is vLLM's LRU. With leases, :meth:`evict` takes superseded pages first, then ordinary
    pages least recently used first, then protected pages lightest first (see the module's text).

    :attr:`book` is keyed by ``OffloadKey``, its capacity the host tier's chunks. :attr:`next_tier`, when
    set (an L3 store behind the host tier), says whether L3 holds a key: a leased page evicted then is
    counted demoted, else dropped.
    """

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.book = LeaseBook(HOST_TIER, capacity=cache_capacity)
        self.next_tier: Callable[[OffloadKey], bool] | None = None
        #: Requests that asked for a lease but had no page on the host tier when they finished.
        self.leases_without_pages = 0
        self._reported = dict.fromkeys(_COUNTERS.values(), 0)
        self._probe_failed = False

    # ---- leases -------------------------------------------------------------------------------------

    def on_new_request(self, hints: RetentionHints) -> None:
        """A request arrived: a new turn of its session keeps the session's leases alive."""
        if hints.session is not None:
            self.book.refresh_session(hints.session)

    def grant(self, keys: Sequence[OffloadKey], hints: RetentionHints) -> Grant | None:
        """Lease the request's ``keys`` (prefix order) that the host tier holds, as ``hints`` ask."""
        held = [k for k in keys if k in self.chunks]
        if hints.retain is not None and held:
            return self.book.retain(held, hints.retain, supersede=hints.supersede)
        if hints.retain is not None:
            self.leases_without_pages += 1
        if hints.supersede:
            self.book.supersede(hints.session)
        return None

    def stats(self) -> dict[str, Any]:
        """The host tier's lease book (:meth:`LeaseBook.stats <hicache_core.retention.LeaseBook.stats>`), and
        how many requests asked for a lease with no page on the tier."""
        return {**self.book.stats(), "leases_without_pages": self.leases_without_pages}

    def report(self, stats: Any) -> None:
        """Put the book's figures on vLLM's ``OffloadingConnectorStats`` (gauges now, counters since last time)."""
        now = {**self.book.stats(), "hints_refused": refused_hints.count}
        for metric, field in _GAUGES.items():
            stats.set_gauge(metric, now[field])
        for metric, field in _COUNTERS.items():
            grown = now[field] - self._reported[field]
            if grown:
                stats.increase_counter(metric, grown)
            self._reported[field] = now[field]

    # ---- vLLM's CachePolicy -------------------------------------------------------------------------

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]], insertion_only_keys: set[OffloadKey],
                            reused_keys: set[OffloadKey], req_context: ReqContext) -> None:  # fmt: skip
        super().on_request_finished(key_groups, insertion_only_keys, reused_keys, req_context)
        if reused_keys:  # a hit on a lease's last page continues its session (the deepest page reused counts)
            self.book.refresh([k for k in order_request_keys(key_groups, req_context) if k in reused_keys])
        hints = request_hints(req_context)
        if hints:
            self.grant(order_request_keys(key_groups, req_context), hints)

    def remove(self, key: OffloadKey) -> None:
        super().remove(key)
        if self.book.leased(key):
            self.book.left_tier([key], "store failed")

    def clear(self) -> None:
        super().clear()
        self.book.release_all()  # vLLM's reset_cache: the pages are gone, and so are their leases

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n == 0 or not len(self.book):
            return super().evict(n, protected)
        first, held = self.book.rank()
        chosen: list[OffloadKey] = []
        taken: set[OffloadKey] = set()

        def take(keys: Iterable[OffloadKey]) -> None:
            for key in keys:
                if len(chosen) >= n:
                    return
                if key not in taken and key in self._evictable and key not in protected:
                    chosen.append(key)
                    taken.add(key)

        take(sorted((k for k in first if k in self._evictable), key=self._ranks.__getitem__))
        # Ordinary pages from vLLM's recency heap (lazily invalidated, as its own evict walks it): popped
        # entries still current go back unless their key is evicted, so a failed eviction changes nothing.
        popped: list[tuple[int, OffloadKey]] = []
        while self._heap and len(chosen) < n:
            entry = heapq.heappop(self._heap)
            if not self._is_current(entry):
                continue
            popped.append(entry)
            key = entry[1]
            if key not in first and key not in held:
                take((key,))
        if len(chosen) < n:
            take(sorted((k for k in held if k in self._evictable), key=lambda k: (held[k], self._ranks[k])))
        if len(chosen) < n:
            for entry in popped:
                heapq.heappush(self._heap, entry)
            return None
        for entry in popped:
            if entry[1] not in taken:
                heapq.heappush(self._heap, entry)
        demoted = self._in_next_tier([k for k in chosen if self.book.leased(k)])
        out = []
        for key in chosen:
            self._evictable.remove(key)
            self._ranks.pop(key)
            out.append((key, self.chunks.pop(key)))
        self._maybe_compact_heap()
        self.book.left_tier(chosen, "evicted", demoted=demoted)
        return out

    def _in_next_tier(self, leased: list[OffloadKey]) -> set[OffloadKey]:
        if not leased or self.next_tier is None:
            return set()
        try:
            return {k for k in leased if self.next_tier(k)}
        except Exception as exc:  # noqa: BLE001 - counting must not stop an eviction: counted dropped, and said
            if not self._probe_failed:
                self._probe_failed = True
                logger.warning("hicache-vllm: could not ask L3 whether %d evicted leased pages are there (%s: %s); "
                               "they are counted dropped", len(leased), type(exc).__name__, exc)  # fmt: skip
            return set()


def host_policy_name(eviction_policy: str) -> str:
    """The cache policy the host tier runs for vLLM's ``eviction_policy``: ``"lru"`` is :class:`HicacheCachePolicy`
    (registered in vLLM's ``CachePolicyFactory`` as :data:`POLICY_NAME`); any other name is vLLM's (``"arc"``)."""
    if eviction_policy != "lru":
        return eviction_policy
    try:
        CachePolicyFactory.register_cache_policy(POLICY_NAME, __name__, HicacheCachePolicy.__name__)
    except ValueError:  # registered already (another manager in this process)
        pass
    return POLICY_NAME
