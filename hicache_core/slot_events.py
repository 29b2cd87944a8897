"""Listeners told when host slots are about to be reused: what a tier serving a pool's pages to others needs.

A tier that lets other processes read this process's host pool (the peer tier) must know, before a
slot can be handed out again, that its bytes stop being the page it published. :meth:`HostPool.free`
and :meth:`HostPool.clear` call every listener first, on the caller's thread, so a listener must be
quick and must not block (mark, then do slow work elsewhere).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

#: ``listener(host_pool, slots)``: ``slots`` the token slots being freed, or ``None`` for all (``clear``).
FreeListener = Callable[[Any, "torch.Tensor | None"], None]

_listeners: tuple[FreeListener, ...] = ()
_lock = threading.Lock()


def add_free_listener(listener: FreeListener) -> None:
    """Call ``listener`` before any host pool's slots go back to its free list."""
    global _listeners
    with _lock:
        _listeners = (*_listeners, listener)


def remove_free_listener(listener: FreeListener) -> None:
    """Stop calling ``listener`` (one registration of it); unknown listeners are ignored."""
    global _listeners
    with _lock:
        found = list(_listeners)
        if listener in found:
            found.remove(listener)
        _listeners = tuple(found)


def notify_freed(host_pool: Any, slots: torch.Tensor | None) -> None:
    """Tell every listener (a tuple read without the lock: adding one never blocks a free)."""
    for listener in _listeners:
        listener(host_pool, slots)
