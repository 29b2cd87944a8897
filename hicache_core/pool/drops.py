"""Reporting indices a kernel masked, without a host sync on the hot path.

A kernel that runs asynchronously cannot raise: by the time it meets an
out-of-range index, the call that launched it has long returned. hicache's
kernels mask such indices (no memory outside the pools is ever touched), and
each host pool carries one :class:`DropReport`: a pinned 8-byte word the GPU can
write through UVA. The pool numbers its calls; before each call it sets
:attr:`DropReport.seq`, and an implementation that masks an index stores that
number into the word (a masked store, so nothing crosses the link when every
index is good). At the start of every later call on the pool, the pool reads the
word (a plain host load, no CUDA call) and, if it is set, raises
:class:`DroppedIndicesError` naming the earlier call, before any byte of the new
call moves.

So a dropped index is reported by the first call on the pool that starts after
the faulty transfer has run on the GPU, or at once by
:meth:`hicache_core.HostPool.check_dropped` (which synchronises). Implementations
that check bounds on the host (``direct``, the reference) raise in the call itself
and never need the word.

Calls on one pool come from more than one thread (the caller's, and the layer
loader's, :mod:`hicache_core.loads.layer_loads`), so call numbers come from one atomic
counter, and the number of the call in progress is the calling thread's own.
"""

from __future__ import annotations

import ctypes
import itertools
import threading

import torch

from ..host_memory import host_tensor
from ..metrics import record_dropped_indices

#: Calls remembered for naming the one that dropped indices (older ones are named by number only).
HISTORY = 256
HISTORY_MASK = HISTORY - 1  # a power of two, so the pool's hot path indexes with a mask


class DroppedIndicesError(IndexError):
    """An earlier transfer on this host pool was given out-of-range indices, which a kernel masked.

    No memory outside the pools was touched, but the masked items did not move: the
    destination still holds its old bytes for them. ``call`` is the number of the faulty call
    on the pool (counting from 1), ``operation`` and ``layer_id`` what it was (``None`` when
    it is older than the pool's memory of calls).
    """

    def __init__(self, message: str, call: int, operation: str | None, layer_id: int | None) -> None:
        super().__init__(message)
        self.call = call
        self.operation = operation
        self.layer_id = layer_id


class CallInProgress(threading.local):
    """The number of the call the current thread is making on a pool (0 before its first call)."""

    seq: int = 0


class DropReport:
    """One host pool's drop word: where implementations report masked indices (see the module doc).

    For implementations: before every call the pool sets :attr:`seq` to the call's number
    (always >= 1, never given to two calls). A kernel that masks an index stores ``seq`` as an
    ``int64`` at :attr:`address` (a host address, reachable from the GPU through UVA where the
    host pool is pinned, and plain process memory on the CPU). Storing from many threads is
    fine: they all store the same value. Never store anything else there.

    :attr:`seq` is per thread: calls made at once from two threads (the caller's, the layer
    loader's) each read their own number.
    """

    def __init__(self, pinned: bool, label: str = "host pool") -> None:
        # Word 0: calls whose indices a kernel masked. Word 1: calls whose page-item indices on the
        # GPU were not whole pages (the core checks those on the GPU, asynchronously, and writes here).
        self.word = host_tensor((2,), torch.int64, label=label, name="drop word", pinned=pinned)
        #: Host address of the drop word (int64).
        self.address: int = self.word.data_ptr()
        self._value = ctypes.c_int64.from_address(self.address)
        self._malformed = ctypes.c_int64.from_address(self.address + 8)
        # next() of an itertools.count is one C call, so two threads never get the same number (a
        # read-add-store on an attribute can interleave and repeat or lose one).
        self.numbers = itertools.count(1)
        #: The calling thread's call in progress; the pool's hot path reads ``current.seq`` directly.
        self.current = CallInProgress()
        # Slot seq & HISTORY_MASK: (operation, layer_id, items, seq) of the latest call with that slot.
        self._calls: list[tuple[str, int | None, int, int] | None] = [None] * HISTORY

    @property
    def seq(self) -> int:
        """Number of the call in progress on this thread (set by the pool before it calls an implementation)."""
        return self.current.seq

    def begin(self, operation: str, layer_id: int | None, items: int) -> int:
        """Number a new call (the pool calls this; implementations read :attr:`seq`)."""
        seq = self.current.seq = next(self.numbers)
        self._calls[seq & HISTORY_MASK] = (operation, layer_id, items, seq)
        return seq

    def dropped(self) -> int:
        """The number of a call whose indices a kernel masked since the last check, or 0."""
        return self._value.value

    def flagged(self) -> bool:
        """Whether anything is to be reported (two plain host loads; the pool's hot path calls this)."""
        return bool(self._value.value or self._malformed.value)

    def raise_if_dropped(self) -> None:
        """Raise :class:`DroppedIndicesError` for a flagged earlier call, and clear the word."""
        seq = self._malformed.value
        if seq:
            self._malformed.value = 0
            record_dropped_indices()
            raise DroppedIndicesError(
                f"an earlier transfer, {self._describe(seq)}, was given page-item indices on the GPU that were not "
                "whole pages (runs of page_size consecutive slots from a page start); each run moved the page of "
                "its first slot. Set HICACHE_VALIDATE=1 (or validate=True) to have the faulty call itself raise.",
                seq,
                *self._call(seq)[:2],
            )
        seq = self._value.value
        if not seq:
            return
        self._value.value = 0
        record_dropped_indices()
        operation, layer_id, _ = self._call(seq)
        raise DroppedIndicesError(
            f"an earlier transfer, {self._describe(seq)}, was given out-of-range indices: the kernel masked them, "
            "so no memory outside the pools was touched, but those items did not move and their destination holds "
            "stale bytes. Set HICACHE_VALIDATE=1 (or validate=True) to have the faulty call itself raise.",
            seq,
            operation,
            layer_id,
        )

    def _call(self, seq: int) -> tuple[str | None, int | None, int]:
        remembered = self._calls[seq & HISTORY_MASK]
        if remembered is None or remembered[3] != seq:  # never made, or a later call took its slot
            return None, None, 0
        return remembered[:3]

    def _describe(self, seq: int) -> str:
        operation, layer_id, items = self._call(seq)
        if operation is None:
            return f"call #{seq} on this host pool"
        layer = f", layer_id {layer_id}" if layer_id is not None else ""
        return f"call #{seq} on this host pool ({operation}{layer}, {items} indices)"
