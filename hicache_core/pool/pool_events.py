"""What a host pool tells those who watch it: :class:`PoolObserver`, and the pool's callers of each event.

The pool announces; observers act (pluggy's hook callers and fsspec's callbacks are the shape).
Host-tier verification (:mod:`hicache_core.verification.observer`), the transfer metrics
(:mod:`hicache_core.metrics`), free listeners (:mod:`hicache_core.pool.slot_events`) and a storage
backend that serves the pool's pages to others (``peer://``) are observers of one pool; none of
them keeps state outside the pool it watches.

An observer overrides the events it needs. The pool keeps, per event, a tuple of the overriding
observers' bound methods (:class:`PoolEvents`), so an event nobody overrides costs the pool one
attribute read, and a pool with no observer pays nothing else on its hot path.

Every event runs on the thread of the call that caused it (a layer-wise load's per-layer events
on the layer loader's thread), so an observer must be quick and must not block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class LoadWatch(Protocol):
    """What :meth:`PoolObserver.load_started` returns: told of each layer of one layer-wise load, then of its end."""

    def add(self, host_indices: torch.Tensor, device_indices: torch.Tensor, layer: int, seq: int) -> None: ...

    def flush(self, wait_host: bool = False) -> None: ...


class PoolObserver:
    """Hears one host pool's events (attach it with ``HostPool.observe``); every event does nothing here.

    Indices given to an event are those the implementation got (``h``, ``d``); ``layer`` is the
    host layer (``None``: every host layer); ``seq`` the call's number (:mod:`hicache_core.pool.drops`).
    """

    def before_call(self) -> None:
        """A transfer call is about to move bytes (its arguments are checked): raise to refuse it."""

    def before_backup(self) -> None:
        """A backup's copies are about to be enqueued on the current stream."""

    def after_backup(self, h: torch.Tensor, d: torch.Tensor, layer: int | None, seq: int) -> None:
        """A backup's copies were enqueued on the current stream."""

    def after_load(self, h: torch.Tensor, d: torch.Tensor, layer: int, seq: int) -> None:
        """A per-layer load's copies were enqueued on the current stream (not one of a layer-wise load's layers)."""

    def load_started(self, layers: int, engine: str) -> LoadWatch | None:
        """A layer-wise load of ``layers`` layers, copied by ``engine``, was submitted: return what hears its
        layers (``add``, on the loader's thread) and its end (``flush``, after its last layer; ``wait_host``: the
        load failed, and its consumers may reuse the rows once this returns), or ``None``."""
        return None

    def transferred(self, op: str, impl: str, pages: int, nbytes: int, seconds: float) -> None:
        """A transfer call moved ``pages`` pages (``nbytes``) and took ``seconds`` of host time to submit."""

    def call_failed(self) -> None:
        """A per-layer transfer call raised; its caller may reuse the rows it named as soon as this returns."""

    def slots_freed(self, slots: torch.Tensor | None) -> None:
        """Slots are about to go back to the free list (``None``: all of them, ``clear``): nobody has them yet."""

    def handed_out(self, pages: list[int] | None, why: str) -> None:
        """Bytes of ``pages`` may now change where the pool cannot see (raw pointers handed out); ``None``: of any
        page, for good (the whole memory handed out, or a call moved part of a page)."""

    def page_written(self, page: int) -> None:
        """Host page ``page`` was written from host bytes (a flat page set by a server), not by a backup."""


#: The events, in the order the interface lists them.
EVENTS = ("before_call", "before_backup", "after_backup", "after_load", "load_started", "transferred",
          "call_failed", "slots_freed", "handed_out", "page_written")  # fmt: skip


class PoolEvents:
    """One pool's observers, and per event the tuple of bound methods of those that override it."""

    __slots__ = ("observers", *EVENTS)

    def __init__(self) -> None:
        self.observers: tuple[PoolObserver, ...] = ()
        self._index()

    def add(self, observer: PoolObserver) -> None:
        """Attach ``observer`` (after those already attached; each event calls observers in that order)."""
        if not isinstance(observer, PoolObserver):
            raise TypeError(f"a pool observer subclasses hicache_core.PoolObserver, got {type(observer).__name__}")
        if observer in self.observers:
            raise ValueError(f"{observer!r} already observes this pool")
        self.observers = (*self.observers, observer)
        self._index()

    def remove(self, observer: PoolObserver) -> None:
        """Detach ``observer``; one that is not attached raises ``ValueError``."""
        if observer not in self.observers:
            raise ValueError(f"{observer!r} does not observe this pool")
        self.observers = tuple(o for o in self.observers if o is not observer)
        self._index()

    def _index(self) -> None:
        # Each tuple is replaced whole: a call on another thread reads the old tuple or the new one.
        for name in EVENTS:
            base = getattr(PoolObserver, name)
            callers: tuple[Callable[..., Any], ...] = tuple(
                getattr(o, name) for o in self.observers if getattr(type(o), name) is not base
            )
            setattr(self, name, callers)

    def __repr__(self) -> str:
        return f"PoolEvents({', '.join(type(o).__name__ for o in self.observers) or 'no observer'})"


__all__ = ["EVENTS", "LoadWatch", "PoolEvents", "PoolObserver"]
