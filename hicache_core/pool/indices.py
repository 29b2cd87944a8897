"""Index checks and index residency: indices where each implementation wants them, without stalls.

Implementations declare where they want indices (``index_device``: ``"cpu"`` or
``"device"``) and in which dtypes (``index_dtypes``). Indices that already are there
are passed on as they are: no copy, no conversion. Others are converted once and the
result reused while the caller passes the same tensor object unmodified (same
identity and version counter), which is what a server does when it loads one batch
layer by layer: one conversion per batch, not one per layer.

A conversion from the GPU to the CPU must wait for whatever produces the indices on
the caller's stream. It is done on a side stream that waits only for an event
recorded on the caller's stream, into pinned memory, and the host waits for that
copy alone: the caller's stream itself is never synchronised or blocked.
"""

from __future__ import annotations

import threading

import torch

INDEX_DTYPES = (torch.int32, torch.int64)
#: Converted index tensors remembered per host pool (a load and a backup in flight, K and V sides).
CACHE_ENTRIES = 8


def _current_stream(t: torch.Tensor) -> int:
    """The raw current stream of ``t``'s CUDA device, for this thread."""
    return torch._C._cuda_getCurrentRawStream(t.get_device())


def reject_indices(host_indices, device_indices) -> None:
    """Raise the precise error for indices the hot path's combined check refused."""
    for what, idx in (("host_indices", host_indices), ("device_indices", device_indices)):
        if not isinstance(idx, torch.Tensor):
            raise TypeError(f"{what} must be a torch tensor of int32/int64 slots, got {type(idx).__name__}")
    for what, idx in (("host_indices", host_indices), ("device_indices", device_indices)):
        if idx.is_meta:
            raise ValueError(f"{what} is on the meta device, which holds no values: pass real indices")
    if host_indices.dtype not in INDEX_DTYPES or device_indices.dtype not in INDEX_DTYPES:
        raise TypeError(
            f"indices must be int32 or int64, got host {host_indices.dtype} and device {device_indices.dtype}"
        )
    raise ValueError(
        "host_indices and device_indices must be 1-D and of equal length, got "
        f"{tuple(host_indices.shape)} and {tuple(device_indices.shape)}"
    )


def check_bounds(indices: torch.Tensor, limit: int, what: str) -> None:
    """Raise unless every index lies in ``[0, limit)`` (syncs when the indices live on a GPU)."""
    if indices.numel() == 0:
        return
    lo, hi = int(indices.min()), int(indices.max())
    if lo < 0 or hi >= limit:
        raise IndexError(f"{what} out of range: min {lo}, max {hi}, valid [0, {limit})")


def whole_pages_mask(indices: torch.Tensor, page_size: int) -> torch.Tensor:
    """A 0-d bool tensor, on the indices' device: whether the slots break the whole-page structure."""
    pages = indices.reshape(-1, page_size).to(torch.int64)
    offsets = torch.arange(page_size, device=pages.device)
    return (pages[:, 0] % page_size != 0).any() | (pages != pages[:, :1] + offsets).any()


def check_whole_pages(indices: torch.Tensor, page_size: int, what: str) -> None:
    """Raise unless the slots form whole pages: runs of ``page_size`` consecutive slots from a page start."""
    if indices.numel() % page_size:
        raise ValueError(f"{what} must come in whole pages: {indices.numel()} slots with page_size {page_size}")
    if page_size > 1 and bool(whole_pages_mask(indices, page_size)):
        raise ValueError(f"{what} must come in whole pages of {page_size} consecutive slots starting at a page start")


class IndexCache:
    """Converted indices of the last few source tensors, keyed by identity, version and conversion.

    Holding the source tensor keeps its memory from being reused by another tensor while the
    entry lives, so identity plus torch's version counter (bumped by every in-place write
    through torch) is a safe key. Inference tensors (made under ``torch.inference_mode``) have no
    version counter, so an in-place write to one could not be seen: they are converted on every
    call and never cached.
    """

    def __init__(self) -> None:
        self._entries: list[tuple[torch.Tensor, int, tuple, torch.Tensor, int]] = []
        self._lock = threading.Lock()
        self._side_streams: dict[int, torch.cuda.Stream] = {}

    def lookup(self, src: torch.Tensor, key: tuple) -> torch.Tensor | None:
        if src.is_inference():
            return None
        version = src._version
        for entry in self._entries:
            if entry[0] is src and entry[1] == version and entry[2] == key:
                # A CUDA result is ordered on the stream that made it (and the allocator reuses its
                # memory in that stream's order): another stream, say the layer loader's, makes its own.
                if entry[4] and entry[4] != _current_stream(entry[3]):
                    continue
                return entry[3]
        return None

    def store(self, src: torch.Tensor, key: tuple, converted: torch.Tensor) -> torch.Tensor:
        if src.is_inference():
            return converted
        stream = _current_stream(converted) if converted.is_cuda else 0
        with self._lock:
            self._entries.insert(0, (src, src._version, key, converted, stream))
            del self._entries[CACHE_ENTRIES:]
        return converted

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def move(self, src: torch.Tensor, dtype: torch.dtype, target: torch.device) -> torch.Tensor:
        """``src`` as ``dtype`` on ``target``: cached, and never blocking the caller's stream."""
        key = ("move", dtype, target)
        hit = self.lookup(src, key)
        if hit is not None:
            return hit
        if src.is_meta:
            raise ValueError("indices on the meta device hold no values: pass real indices")
        if target.type == "cuda" or not src.is_cuda:
            # To the GPU: ordered on the caller's stream, which is where the indices are used.
            out = src.to(target, dtype, non_blocking=target.type == "cuda")
        else:
            out = self._to_host(src, dtype)
        return self.store(src, key, out)

    def _to_host(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        device = src.device
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(device))
        side = self._side_streams.get(device.index)
        if side is None:
            side = self._side_streams.setdefault(device.index, torch.cuda.Stream(device))
        out = torch.empty(src.shape, dtype=dtype, pin_memory=True)
        with torch.cuda.stream(side):
            side.wait_event(produced)
            out.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        # The source must outlive the copy on the side stream (the caller may free it right away).
        src.record_stream(side)
        done.synchronize()
        return out
