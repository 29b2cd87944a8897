"""The host pool's slot allocator: token slots handed out and taken back in whole pages."""

from __future__ import annotations

import threading

import torch

from .indices import INDEX_DTYPES, whole_pages_mask
from .validation import strict_int

# Slot states: never handed out since the last clear(), handed out, given back.
_NEVER, _ALLOCATED, _FREED = 0, 1, 2


class SlotAllocator:
    """Free list of host token slots, in whole pages, refusing double allocation and double free."""

    def __init__(self, size: int, page_size: int) -> None:
        self.size = size
        self.page_size = page_size
        self._lock = threading.RLock()
        self.clear()

    def clear(self) -> None:
        with self._lock:
            self.free_slots = torch.arange(self.size, dtype=torch.int64)
            self.slot_state = torch.full((self.size,), _NEVER, dtype=torch.int8)

    def available_size(self) -> int:
        return int(self.free_slots.numel())

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """The first ``need_size`` free slots (a multiple of the page size), or ``None`` if too few are free."""
        need_size = strict_int(need_size, "alloc()'s need_size (slots)")
        if need_size < 0:
            raise ValueError(f"alloc() takes a size >= 0, got {need_size}")
        if need_size % self.page_size != 0:
            raise ValueError("The requested size should be a multiple of the page size.")
        with self._lock:
            if need_size > self.free_slots.numel():
                return None
            taken = self.free_slots[:need_size]
            self.free_slots = self.free_slots[need_size:]
            self.slot_state[taken] = _ALLOCATED
            return taken

    def checked(self, indices: torch.Tensor) -> torch.Tensor:
        """``indices`` as CPU int64 slots, checked as :meth:`free` checks them before it looks at their state."""
        if not isinstance(indices, torch.Tensor) or indices.dtype not in INDEX_DTYPES:
            raise TypeError(f"free() takes an int32/int64 tensor of slots, got {_what(indices)}")
        indices = indices.to("cpu", torch.int64).reshape(-1)
        if indices.numel() == 0:
            return indices
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= self.size:
            raise IndexError(f"free() got slots outside the pool [0, {self.size}): min {lo}, max {hi}")
        if indices.numel() % self.page_size or (self.page_size > 1 and bool(whole_pages_mask(indices, self.page_size))):
            # A torn page would come back from a later alloc() as part of a "whole page".
            raise ValueError(
                f"free() takes whole pages (runs of {self.page_size} consecutive slots from a page start), "
                f"got {indices.numel()} slots starting {indices[: self.page_size].tolist()}"
            )
        return indices

    def free(self, indices: torch.Tensor) -> int:
        """Return slots to the free list; refuses slots out of range, not allocated, or not whole pages."""
        indices = self.checked(indices)
        if indices.numel() == 0:
            return 0
        with self._lock:
            state = self.slot_state[indices]
            repeated = torch.unique(indices).numel() != indices.numel()
            if repeated or not bool((state == _ALLOCATED).all()):
                never = indices[state == _NEVER][:8].tolist()
                freed = indices[state == _FREED][:8].tolist()
                problems = []
                if never:
                    problems.append(f"slots {never} were never allocated")
                if freed:
                    problems.append(f"double free: slots {freed} were already freed")
                if repeated:
                    problems.append("the same slot appears twice in one free()")
                raise ValueError("free() refused, nothing was freed: " + "; ".join(problems))
            self.slot_state[indices] = _FREED
            self.free_slots = torch.cat([self.free_slots, indices])
        return int(indices.numel())


def _what(value) -> str:
    return f"{type(value).__name__} of dtype {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
