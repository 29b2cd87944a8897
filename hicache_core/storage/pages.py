"""Where each page of a host pool lives in memory, as contiguous runs (the unit of zero-copy storage I/O)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..pool.page_access import contiguous_runs
from ..verification.page_checksum import checksum_rows


@dataclass(frozen=True)
class Span:
    """One contiguous run of bytes: its address, its length, and a memoryview of it."""

    ptr: int
    nbytes: int
    view: memoryview


class PageMap:
    """The runs of every page of one host pool, in the pool's flat page order.

    The payload of a stored page is these runs concatenated: host buffer by host buffer,
    each page view in index order, exactly what ``get_data_page(i, flat=True)`` returns.
    """

    def __init__(self, host_pool: Any) -> None:
        self.host_pool = host_pool
        self.page_size = host_pool.page_size
        self.num_pages = host_pool.page_num
        views0 = host_pool.get_data_page(0, flat=False)
        views0 = views0 if isinstance(views0, tuple) else (views0,)
        if self.num_pages > 1:
            views1 = host_pool.get_data_page(self.page_size, flat=False)
            views1 = views1 if isinstance(views1, tuple) else (views1,)
            strides = [b.data_ptr() - a.data_ptr() for a, b in zip(views0, views1)]
        else:
            strides = [0] * len(views0)
        # (buffer base address, byte offset of page 0's run from the base, nbytes) per run
        self._runs: list[tuple[int, int, int]] = []
        self._bases: list[tuple[int, int]] = []  # (base address, page stride) per buffer
        self._buffers: list[torch.Tensor] = []
        for view, stride in zip(views0, strides):
            base = view.data_ptr()
            for ptr, nbytes, _ in contiguous_runs(view):
                offset = ptr - view.data_ptr()
                self._runs.append((len(self._bases), offset, nbytes))
            self._bases.append((base, stride))
        self.page_bytes = sum(n for _, _, n in self._runs)
        for tensor in host_pool.plan.host_buffers.values():
            self._buffers.append(tensor)
        #: The pool's verification (:mod:`hicache_core.verification.observer`): its table and quarantine, asked of the
        #: pool.
        self.verification = getattr(host_pool, "verification", None)
        #: The pool's checksum table (host-tier verification), stored after each page's payload; else ``None``.
        self.table = self.verification.table if self.verification is not None else None
        self.trailer_bytes = 0
        if self.table is not None:
            self.trailer_bytes = self.table[0].numel() * 8
            self._buffers.append(self.table)
        self._memory = [_byte_view(t) for t in self._buffers]

    @property
    def runs_per_page(self) -> int:
        return len(self._runs)

    def page_runs(self, page: int) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of each run of page ``page``."""
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} is outside the host pool ({self.num_pages} pages)")
        return [(self._bases[b][0] + page * self._bases[b][1] + off, n) for b, off, n in self._runs]

    def page_spans(self, page: int) -> list[Span]:
        """The runs of page ``page`` as :class:`Span` objects (with writable memoryviews into the pool)."""
        spans = []
        for ptr, n in self.page_runs(page):
            spans.append(Span(ptr, n, self._view_at(ptr, n)))
        return spans

    @property
    def verify_words(self) -> int:
        """Checksum words stored after each page's payload (0 when the pool does not verify)."""
        return self.trailer_bytes // 8

    def trailer_span(self, page: int) -> Span:
        """The page's row of the checksum table (verifying pools only), written and read beside the payload."""
        row = self.table[page]
        return Span(row.data_ptr(), self.trailer_bytes, self._view_at(row.data_ptr(), self.trailer_bytes))

    def object_spans(self, page: int) -> list[Span]:
        """What a stored page holds after its header: the payload's runs, then the checksum row if the pool verifies."""
        spans = self.page_spans(page)
        if self.table is not None:
            spans.append(self.trailer_span(page))
        return spans

    def _view_at(self, ptr: int, nbytes: int) -> memoryview:
        for tensor, view in zip(self._buffers, self._memory):
            start = tensor.data_ptr()
            if start <= ptr and ptr + nbytes <= start + len(view):
                return view[ptr - start : ptr - start + nbytes]
        raise IndexError(f"run at {ptr:#x} (+{nbytes}) is outside every host buffer")

    def checksum_row_of(self, payload: torch.Tensor) -> torch.Tensor:
        """The checksum row ``(layers, components, groups)`` of a page held in ``payload`` (its runs concatenated,
        as stored), taken from the device rows its bytes hold, as a verifying pool's backup takes it.

        What a load to the device would check, computed on the host: a tool (``check_page``, ``explain-miss``)
        tells a page whose payload does not match its stored row before any load does. Verifying pools only.
        """
        plan = self.host_pool.plan
        runs = self.page_runs(0)
        starts, at = [], 0
        for _, n in runs:
            starts.append(at)
            at += n
        flat = payload.reshape(-1).view(torch.uint8)
        if flat.numel() < at:
            raise ValueError(f"a page here is {at} bytes of payload, got {flat.numel()}")
        row = torch.empty_like(self.table[0])
        by_comp: dict[int, list] = {}
        for part in plan.parts:
            by_comp.setdefault(part.spec.component, []).append(part)
        for layer in range(plan.num_layers):
            for comp, parts in sorted(by_comp.items()):
                views = [_view_in(flat, runs, starts, p, layer) for p in sorted(parts, key=lambda p: p.spec.dim_start)]
                joined = views[0] if len(views) == 1 else torch.cat(views, dim=-1)
                row[layer, comp] = checksum_rows(joined.reshape(joined.shape[0], -1), layer, comp,
                                                 plan.tokens_per_page)[0]  # fmt: skip
        return row

    def buffer_spans(self) -> list[Span]:
        """Every host buffer whole, and the checksum table (what a zero-copy backend registers once)."""
        return [Span(t.data_ptr(), len(v), v) for t, v in zip(self._buffers, self._memory)]


def _view_in(flat: torch.Tensor, runs: list[tuple[int, int]], starts: list[int], part: Any,
             layer: int) -> torch.Tensor:  # fmt: skip
    """Page 0's ``(tokens, heads, piece_bytes)`` view of one part in one host layer, taken from ``flat`` (page 0's
    runs concatenated) instead of the pool: the run that holds the view's first byte holds all of it."""
    address = part.host.data_ptr() + part.host_offset + layer * part.layer_stride
    extent = ((part.tokens_per_page - 1) * part.token_stride + (part.heads - 1) * part.head_stride
              + part.piece_bytes)  # fmt: skip
    for (run, nbytes), start in zip(runs, starts):
        if run <= address < run + nbytes:
            if address - run + extent > nbytes:
                break
            return flat.as_strided((part.tokens_per_page, part.heads, part.piece_bytes),
                                   (part.token_stride, part.head_stride, 1),
                                   flat.storage_offset() + start + address - run)  # fmt: skip
    raise ValueError(f"host layer {layer} of part {part.spec.name!r} is not inside one run of its page")


def _byte_view(tensor: torch.Tensor) -> memoryview:
    flat = tensor.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    if flat.numel() == 0:
        return memoryview(bytearray())
    return memoryview(flat.numpy()).cast("B")
