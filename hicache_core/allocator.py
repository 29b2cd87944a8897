"""The host pool's slot allocator: token slots handed out and taken back in whole pages."""

from __future__ import annotations

import threading

import torch


class SlotAllocator:
    """Free list of host token slots, with double-allocation and double-free detection."""

    def __init__(self, size: int, page_size: int) -> None:
        self.size = size
        self.page_size = page_size
        self._lock = threading.RLock()
        self.clear()

    def clear(self) -> None:
        with self._lock:
            self.free_slots = torch.arange(self.size, dtype=torch.int64)
            self.slot_used = torch.zeros(self.size, dtype=torch.bool)

    def available_size(self) -> int:
        return int(self.free_slots.numel())

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """The first ``need_size`` free slots (a multiple of the page size), or ``None`` if too few are free."""
        if need_size < 0:
            raise ValueError(f"alloc() takes a size >= 0, got {need_size}")
        if need_size % self.page_size != 0:
            raise ValueError("The requested size should be a multiple of the page size.")
        with self._lock:
            if need_size > self.free_slots.numel():
                return None
            taken = self.free_slots[:need_size]
            self.free_slots = self.free_slots[need_size:]
            self.slot_used[taken] = True
            return taken

    def free(self, indices: torch.Tensor) -> int:
        """Return slots to the free list; refuses slots out of range, not allocated, or not whole pages."""
        if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"free() takes an int32/int64 tensor of slots, got {_what(indices)}")
        indices = indices.to("cpu", torch.int64).reshape(-1)
        if indices.numel() == 0:
            return 0
        if indices.numel() % self.page_size:
            raise ValueError(f"free() takes whole pages: {indices.numel()} slots with page_size {self.page_size}")
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= self.size:
            raise IndexError(f"free() got slots outside the pool [0, {self.size}): min {lo}, max {hi}")
        with self._lock:
            used = self.slot_used[indices]
            if not bool(used.all()) or torch.unique(indices).numel() != indices.numel():
                twice = indices[~used][:8].tolist() or "repeated slots"
                raise ValueError(f"double free of host slots: {twice} are not allocated")
            self.slot_used[indices] = False
            self.free_slots = torch.cat([self.free_slots, indices])
        return int(indices.numel())


def _what(value) -> str:
    return f"{type(value).__name__} of dtype {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
