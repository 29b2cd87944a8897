"""Retention: leases that keep a session's pages in a tier, capped, decaying, and never outliving their end.

* :class:`Retain` is what a lease asks for (priority 0 to 100, time to live, session);
  :func:`parse_ttl` and :func:`retain_from_cache_control` read what servers and routers send.
* :class:`LeaseBook` holds one tier's leases and ranks its pages for eviction.
* :class:`RetentionQueue` is the eviction queue of hicache's own tiers, in that order.
* :mod:`~hicache_core.retention.hints` reads a request's hints: retain, superseded, prefetch.

``docs/retention.md`` tells the model and how each server sets leases.
"""

from .book import Grant, LeaseBook
from .lease import PRIORITY_MAX, Lease, Retain, parse_ttl, retain_from_cache_control
from .queue import RetentionQueue, eviction_walk

__all__ = [
    "PRIORITY_MAX",
    "Grant",
    "Lease",
    "LeaseBook",
    "Retain",
    "RetentionQueue",
    "parse_ttl",
    "eviction_walk",
    "retain_from_cache_control",
]
