"""Free listeners: what a tier serving a pool's pages to others hears before freed slots can be handed out again.

A tier that lets other processes read this process's host pool (the peer tier) must know, before a
slot can be handed out again, that its bytes stop being the page it published. It observes the pool
(:class:`~hicache_core.pool.pool_events.PoolObserver`): :meth:`HostPool.free` and :meth:`HostPool.clear`
tell ``slots_freed`` first, on the caller's thread, so it must be quick and must not block (mark,
then do slow work elsewhere). :class:`FreeListener` turns a plain function into such an observer.

``add_free_listener`` / ``remove_free_listener`` (every pool of the process) are deprecated in
hicache-core 0.4.0 and go in 0.5.0: observe the pool instead (``host_pool.observe(FreeListener(fn, host_pool))``).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .pool_events import PoolObserver

#: ``listener(host_pool, slots)``: ``slots`` the token slots being freed, or ``None`` for all (``clear``).
FreeListenerFunction = Callable[[Any, "torch.Tensor | None"], None]


class FreeListener(PoolObserver):
    """Calls ``listener(host_pool, slots)`` before ``host_pool``'s slots go back to its free list."""

    def __init__(self, listener: FreeListenerFunction, host_pool: Any) -> None:
        self.listener = listener
        self.host_pool = host_pool

    def slots_freed(self, slots: torch.Tensor | None) -> None:
        self.listener(self.host_pool, slots)


# ---- deprecated: listeners of every pool of the process (go in 0.5.0) ----------------------------

_UNTIL = "hicache-core 0.5.0"
_listeners: tuple[FreeListenerFunction, ...] = ()
_lock = threading.Lock()


class _EveryListener(PoolObserver):
    """The deprecated process-wide listeners, told by each pool made while one is registered."""

    def __init__(self, host_pool: Any) -> None:
        self.host_pool = host_pool

    def slots_freed(self, slots: torch.Tensor | None) -> None:
        for listener in _listeners:
            listener(self.host_pool, slots)


def attach_deprecated(host_pool: Any) -> None:
    """Give ``host_pool`` the deprecated process-wide listeners, if any are registered (``make_host_pool``)."""
    if _listeners and not any(isinstance(o, _EveryListener) for o in host_pool.observers):
        host_pool.observe(_EveryListener(host_pool))


def add_free_listener(listener: FreeListenerFunction) -> None:
    """Deprecated: call ``listener`` before any host pool's slots go back to its free list. Observe the pool
    (``host_pool.observe(FreeListener(listener, host_pool))``) instead."""
    warnings.warn(
        f"hicache_core.pool.slot_events.add_free_listener is deprecated and goes in {_UNTIL}: observe the pool, "
        "host_pool.observe(FreeListener(listener, host_pool))",
        DeprecationWarning,
        stacklevel=2,
    )
    global _listeners
    with _lock:
        _listeners = (*_listeners, listener)
    from ..metrics import live_host_pools

    for pool in live_host_pools():
        attach_deprecated(pool)


def remove_free_listener(listener: FreeListenerFunction) -> None:
    """Deprecated: stop calling ``listener`` (one registration of it); unknown listeners are ignored."""
    global _listeners
    with _lock:
        found = list(_listeners)
        if listener in found:
            found.remove(listener)
        _listeners = tuple(found)


__all__ = ["FreeListener", "FreeListenerFunction", "add_free_listener", "remove_free_listener"]
