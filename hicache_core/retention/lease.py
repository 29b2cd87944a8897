"""What a lease asks for, and how its priority lives and ends.

A lease keeps a session's pages in a tier while the session is paused: it has a priority
(0 to 100, TensorRT-LLM's and SGLang's scale), a time to live refreshed by every hit, and an
end. Its priority holds for the time to live after the last refresh, then decays linearly to 0
over ``decay`` times the time to live, and the lease ends: a session slightly late keeps most of
its protection, and nothing is held forever (a lease that is never refreshed ends at
``ttl * (1 + decay)`` after it was granted).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PRIORITY_MAX", "Lease", "Retain", "parse_ttl", "retain_from_cache_control"]

#: The highest priority a lease may have (0 is the lowest: an ordinary page's).
PRIORITY_MAX = 100
#: The priority a ``cache_control`` TTL gets when it names none (Dynamo's pins name none).
CACHE_CONTROL_PRIORITY = 50

_TTL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_ttl(value: Any, *, max_ttl_s: float | None = None) -> float:
    """Seconds of a time to live: a number of seconds, or ``"300"``, ``"30s"``, ``"5m"``, ``"1h"``.

    Refuses (``ValueError``, naming what it got) zero, negatives, NaN, infinity, and more than
    ``max_ttl_s`` (``HICACHE_LEASE_MAX_TTL_S`` by default): every lease has an end.
    """
    if isinstance(value, bool):
        raise ValueError(f"a time to live is seconds or a text like '5m', got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        m = _TTL.match(value)
        if m is None:
            raise ValueError(f"a time to live is seconds or a text like '30s', '5m', '1h'; got {value!r}")
        seconds = float(m[1]) * _UNIT[m[2]]
    else:
        raise ValueError(f"a time to live is seconds or a text like '5m', got {type(value).__name__}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"a time to live must be a finite number of seconds > 0, got {value!r}")
    if max_ttl_s is None:
        from ..settings.variables import LEASE_MAX_TTL_S

        max_ttl_s = LEASE_MAX_TTL_S.read()
    if seconds > max_ttl_s:
        raise ValueError(f"a time to live of {seconds:g} s is over the longest allowed, {max_ttl_s:g} s "
                         "(HICACHE_LEASE_MAX_TTL_S): every lease has an end")  # fmt: skip
    return seconds


@dataclass(frozen=True)
class Retain:
    """A request for a lease: ``priority`` (0 to 100), ``ttl_s`` (seconds), the ``session`` it belongs to.

    Construction checks every field (``ValueError`` naming it), so a bad hint is refused before any
    page is touched.
    """

    priority: int
    ttl_s: float
    session: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"a lease's priority is an integer 0..{PRIORITY_MAX}, got {self.priority!r}")
        if not 0 <= self.priority <= PRIORITY_MAX:
            raise ValueError(f"a lease's priority is 0..{PRIORITY_MAX}, got {self.priority}")
        object.__setattr__(self, "ttl_s", parse_ttl(self.ttl_s))
        if self.session is not None and (not isinstance(self.session, str) or not self.session
                                         or len(self.session) > 256):  # fmt: skip
            raise ValueError(f"a session is a non-empty text of at most 256 characters, got {self.session!r}")


def retain_from_cache_control(cache_control: Any, *, session: str | None = None,
                              priority: int = CACHE_CONTROL_PRIORITY) -> Retain | None:  # fmt: skip
    """The lease an Anthropic-style ``cache_control`` asks for, as Dynamo passes it (``nvext.cache_control``).

    ``{"type": "ephemeral", "ttl": "5m"}`` is a lease of ``ttl``; ``{"type": "ephemeral"}`` without a TTL
    is Anthropic's default of 5 minutes. ``None`` gives ``None``; any other type, or a malformed TTL, is
    refused (``ValueError``), never ignored.
    """
    if cache_control is None:
        return None
    if not isinstance(cache_control, Mapping):
        raise ValueError(f"cache_control is an object like {{'type': 'ephemeral', 'ttl': '5m'}}, got {cache_control!r}")
    kind = cache_control.get("type", "ephemeral")
    if kind != "ephemeral":
        raise ValueError(f"cache_control type {kind!r} is not supported (only 'ephemeral')")
    unknown = set(cache_control) - {"type", "ttl"}
    if unknown:
        raise ValueError(f"cache_control has fields hicache does not know: {sorted(unknown)}")
    return Retain(priority=priority, ttl_s=cache_control.get("ttl", "5m"), session=session)


@dataclass(eq=False)
class Lease:
    """A granted lease on some of a tier's pages (:class:`~hicache_core.retention.LeaseBook` keeps them)."""

    id: int
    priority: int
    ttl_s: float
    decay_s: float
    granted_at: float
    refreshed_at: float
    session: str | None = None
    superseded: bool = False
    keys: dict = field(default_factory=dict)  # its pages in chain order (an ordered set)

    @property
    def ends_at(self) -> float:
        """When the lease ends unless a hit refreshes it first (clock of its book)."""
        return self.refreshed_at + self.ttl_s + self.decay_s

    def weight(self, now: float) -> float:
        """The lease's priority at ``now``: full for ``ttl_s`` after a refresh, then decaying to 0 at its end.

        A superseded lease weighs -1: its pages go before unleased ones.
        """
        if self.superseded:
            return -1.0
        idle = now - self.refreshed_at
        if idle <= self.ttl_s:
            return float(self.priority)
        if self.decay_s <= 0 or now >= self.ends_at:
            return 0.0
        return self.priority * (self.ends_at - now) / self.decay_s

    def alive(self, now: float) -> bool:
        """Whether the lease has not ended at ``now``."""
        return now < self.ends_at
