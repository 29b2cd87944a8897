"""Page access for L3 storage and PD transfer: pages as views, flat copies, and raw (pointer, size) runs.

SGLang's storage backends read and write host pages either as flat tensors
(``get_data_page`` / ``set_from_flat_data_page``) or zero-copy, as pointer and size
lists (``get_page_buffer_meta``, ``get_split_heads_page_buffer_meta``,
``get_contiguous_buf_infos``). Everything here is derived from the host buffers'
declared axes, so it holds for every pool kind and layout. Slots are checked (whole,
aligned pages inside the pool; integer tensors, never bool or float) before any
address is handed out.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from .indices import check_whole_pages
from .validation import strict_int

if TYPE_CHECKING:
    from .host_layout import HostBufferSpec
    from .pool_events import PoolEvents


class PageAccess:
    """Mixin of :class:`~hicache_core.pool.host_pool.HostPool`: its pages, for storage backends."""

    page_size: int
    page_num: int
    layer_num: int
    _on: PoolEvents

    # ---- checks ---------------------------------------------------------------------------------

    def _page_of(self, index: int) -> int:
        """The page that starts at slot ``index`` (a page start inside the pool)."""
        self._alive()
        if isinstance(index, torch.Tensor):
            if index.numel() != 1 or index.dtype.is_floating_point or index.dtype == torch.bool:
                raise TypeError(f"a slot index must be one integer, got a tensor {tuple(index.shape)} {index.dtype}")
            index = int(index)
        index = strict_int(index, "a slot index")
        if index % self.page_size:
            raise ValueError(f"slot {index} is not a page start (page_size {self.page_size}): pass a page's first slot")
        page = index // self.page_size
        if not 0 <= page < self.page_num:
            raise IndexError(f"slot {index} is outside the pool ({self.page_num} pages of {self.page_size})")
        return page

    def _page_starts(self, indices: torch.Tensor, what: str = "indices") -> list[int]:
        """Page numbers of slots that come in whole, aligned pages inside the pool."""
        self._alive()
        if not isinstance(indices, torch.Tensor):
            raise TypeError(f"{what} must be a tensor of int32/int64 token slots, got {type(indices).__name__}")
        if indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{what} must be int32 or int64 token slots, got {indices.dtype}")
        slots = indices.to("cpu", torch.int64).reshape(-1)
        check_whole_pages(slots, self.page_size, what)
        pages = (slots[:: self.page_size] // self.page_size).tolist()
        if pages and (min(pages) < 0 or max(pages) >= self.page_num):
            raise IndexError(f"{what}: pages {min(pages)}..{max(pages)} are outside the pool ({self.page_num} pages)")
        return pages

    # ---- pages as tensors ------------------------------------------------------------------------

    def _page_views(self, page: int) -> list[torch.Tensor]:
        views = []
        for b in self.spec.buffers:
            full = getattr(self, b.attr).view(b.full_shape)
            views.append(full.select(b.axes.index("page"), page))
        return views

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The page starting at slot ``index``: all layers and parts (``flat``: one 1-D copy; else views)."""
        views = self._page_views(self._page_of(index))
        if flat:
            return torch.cat([v.flatten() for v in views])
        return views[0] if len(views) == 1 else tuple(views)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        """A zeroed flat page, shaped like :meth:`get_data_page` returns (a receive buffer)."""
        self._alive()
        return torch.zeros(sum(v.numel() for v in self._page_views(0)), dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        """Write a flat page (as :meth:`get_data_page` returns it) into the page starting at slot ``index``."""
        page = self._page_of(index)
        views = self._page_views(page)
        total = sum(v.numel() for v in views)
        if not isinstance(data_page, torch.Tensor) or data_page.numel() != total or data_page.dtype != self.dtype:
            got = f"{data_page.numel()} of {data_page.dtype}" if isinstance(data_page, torch.Tensor) else data_page
            raise ValueError(f"a flat page here is {total} elements of {self.dtype}, got {got}")
        offset = 0
        flat = data_page.reshape(-1)
        for v in views:
            v.copy_(flat[offset : offset + v.numel()].view(v.shape))
            offset += v.numel()
        for tell in self._on.page_written:
            tell(page)

    # ---- pages as raw runs ----------------------------------------------------------------------

    def _handed_out(self, pages: list[int] | None, why: str = "their pointers were handed out") -> None:
        """Pages handed out as raw pointers may be written unseen: the observers hear of it (verification drops
        their checksums, so their next load takes one instead of failing its check)."""
        for tell in self._on.handed_out:
            tell(pages, why)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """Pointers and byte sizes of the contiguous host runs of each page (zero-copy L3 I/O).

        ``indices`` are token slots in whole, aligned pages. Per page, runs come layer by
        layer with the parts of a layer together (``layer_first`` MHA: K0 V0 K1 V1 ...;
        ``page_first``: K V), as SGLang lists them, for every pool kind and layout.
        """
        ptrs: list[int] = []
        sizes: list[int] = []
        pages = self._page_starts(indices)
        self._handed_out(pages)
        for page in pages:
            runs = []
            for b, (spec, view) in enumerate(zip(self.spec.buffers, self._page_views(page))):
                axes = [a for a in spec.axes if a != "page"]
                for ptr, nbytes, coords in contiguous_runs(view):
                    where = dict(zip(axes, coords))
                    runs.append(((where.get("layer", 0), where.get("component", 0), b), ptr, nbytes))
            for _, ptr, nbytes in sorted(runs, key=lambda r: r[0]):
                ptrs.append(ptr)
                sizes.append(nbytes)
        return ptrs, sizes

    def get_split_heads_page_buffer_meta(self, indices: torch.Tensor, split_factor: int) -> tuple[list[int], list[int]]:
        """Per page, per group of ``head_num // split_factor`` heads, the K then V run (heterogeneous TP).

        Needs a layout that keeps each page's heads outermost (``page_head``), so that a group of
        heads is one contiguous run per part; another layout is refused with the reason.
        """
        if isinstance(split_factor, bool) or not isinstance(split_factor, int) or split_factor < 1:
            raise ValueError(f"split_factor must be an int >= 1, got {split_factor!r}")
        heads = {p.heads for p in self.spec.parts}
        if self.geometry.items_are_pages or len(heads) != 1:
            raise ValueError(f"pool kind {self.geometry.kind!r} has no uniform head axis to split")
        head_num = heads.pop()
        if head_num % split_factor:
            raise ValueError(f"head_num {head_num} is not divisible by split_factor {split_factor}")
        group = head_num // split_factor
        ptrs: list[int] = []
        sizes: list[int] = []
        pages = self._page_starts(indices)
        self._handed_out(pages)
        views = {}
        for part in self.spec.parts:
            spec = self.spec.buffers[part.buffer]
            axes = [a for a in spec.axes if a != "page"]
            if part.dim != self.geometry.components[part.component].dim:
                raise ValueError(f"layout {self.layout!r} splits items, so its heads cannot be split")
            inner = axes[axes.index("head") :] if "head" in axes else []
            outer_of_head = [a for a in axes[: axes.index("head")] if a != "component"]
            if outer_of_head:
                raise ValueError(
                    f"layout {self.layout!r} keeps {', '.join(outer_of_head)} outside the head axis within a page, "
                    "so a group of heads is not one contiguous run; use layout 'page_head'"
                )
            views[part.name] = (spec, axes, inner)
        for page in pages:
            page_views = self._page_views(page)
            for g in range(split_factor):
                for part in self.spec.parts:
                    spec, axes, _ = views[part.name]
                    view = page_views[part.buffer]
                    if "component" in axes:
                        view = view.select(axes.index("component"), part.component)
                    sub = view.narrow(0, g * group, group)  # the head axis is outermost now
                    if not sub.is_contiguous():
                        raise ValueError(f"layout {self.layout!r}: a group of heads is not contiguous")
                    ptrs.append(sub.data_ptr())
                    sizes.append(sub.numel() * sub.element_size())
        return ptrs, sizes

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """``(pointers, byte lengths, item lengths)`` of the host regions made of whole pages (PD transfer).

        One region per buffer and index of the axes outside the page axis (``layer_first``: one
        per component and layer, K layers first; page-major layouts: one per buffer or component),
        each a run of ``page_num`` equal items of one page. A transfer engine may then write any page
        at any time, unseen: a pool verifying by default stops (and says so in ``verify_reason`` and
        a warning); one made with ``verify=True`` (or ``HICACHE_VERIFY=1``) refuses.
        """
        self._alive()
        self._handed_out(
            None, "get_contiguous_buf_infos handed the whole host memory out, to be written at any time unseen"
        )
        ptrs: list[int] = []
        lens: list[int] = []
        items: list[int] = []
        for spec in self.spec.buffers:
            buf = getattr(self, spec.attr).view(spec.full_shape)
            page_axis = spec.axes.index("page")
            item = buf.stride(page_axis) * buf.element_size()
            for coords in itertools.product(*[range(n) for n in spec.full_shape[:page_axis]]):
                region = buf[coords] if coords else buf
                ptrs.append(region.data_ptr())
                lens.append(self.page_num * item)
                items.append(item)
        return ptrs, lens, items

    def get_ksize_per_token(self) -> int:
        """Host bytes per token slot of the first part (K, or the MLA latent part), all host layers."""
        self._alive()
        part = self.plan.parts[0]
        per_item = part.item_bytes * self.layer_num
        return per_item // self.page_size if self.geometry.items_are_pages else per_item

    def is_stride_page_aligned(self, alignment: int = 4096) -> bool:
        """Whether every page of every host buffer starts on an ``alignment``-byte boundary (O_DIRECT I/O)."""
        self._alive()
        for buf, spec in zip(self.plan.host_buffers.values(), self.spec.buffers):
            stride = _page_stride_bytes(buf, spec)
            if buf.data_ptr() % alignment or stride % alignment:
                return False
        return True


def _page_stride_bytes(buf: torch.Tensor, spec: HostBufferSpec) -> int:
    return buf.view(spec.full_shape).stride(spec.axes.index("page")) * buf.element_size()


def contiguous_runs(view: torch.Tensor) -> list[tuple[int, int, tuple[int, ...]]]:
    """Split a strided view into maximal contiguous runs: (pointer, bytes, index of the outer axes)."""
    sizes, strides = list(view.shape), list(view.stride())
    inner, expected, cut = 1, 1, len(sizes)
    for axis in range(len(sizes) - 1, -1, -1):
        if strides[axis] != expected and sizes[axis] != 1:
            break
        expected *= sizes[axis]
        inner *= sizes[axis]
        cut = axis
    nbytes = inner * view.element_size()
    if cut == 0:
        return [(view.data_ptr(), nbytes, ())]
    runs = []
    for idx in itertools.product(*[range(s) for s in sizes[:cut]]):
        offset = sum(i * s for i, s in zip(idx, strides[:cut]))
        runs.append((view.data_ptr() + offset * view.element_size(), nbytes, tuple(idx)))
    return runs
