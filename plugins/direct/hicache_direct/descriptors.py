"""Copy descriptors: (destination, source, bytes) for every merged run, layer and part, built with numpy.

One operation of the copy engine is a list of raw-pointer copies. This module turns
the (host item, device row) index pairs of one call into that list, with a handful
of vectorised numpy operations and no Python loop over runs, because the list is
what the driver's batched copy takes and every microsecond of host time per call is
paid layer after layer:

1. :meth:`DescriptorBuilder.runs`: sort the pairs by host item (only when they are
   not sorted already), cut where either side stops advancing by one (and at page
   boundaries where the host layout keeps pages apart), and check the bounds, all
   before any byte moves.
2. :meth:`DescriptorBuilder.build`: per (layer, part, run), the host address, the
   device address and the byte count, written into arrays that are reused from call
   to call (per thread) rather than allocated.

A part that is a whole device row is one linear copy per run. A part that is a
slice of each device row (the MLA latent or rope half, ``page_first_kv_split``) is a
2-D copy per run: ``n`` rows of ``item_bytes`` at the device row pitch. The batched
copy has no 2-D form, so runs of one row join the batch as linear copies and longer
runs are returned as 2-D copies for the caller to issue one by one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

#: Index pairs for which the run decomposition was computed last are kept (per thread) and
#: reused while the same tensors come back unmodified: a server loads the same pages layer
#: after layer, so only the first layer pays for sorting and cutting.
_CACHE_SLOTS = 2
#: Largest per-runs descriptor table (entries, all layers) kept; past it, descriptors are built per call.
_TABLE_LIMIT = 1 << 18
#: Up to this many copies, a first build is done with Python integers rather than numpy.
_SMALL = 8


@dataclass(frozen=True)
class PartAddresses:
    """One part of an item, in bytes: host strides and the device base address of every host layer."""

    name: str
    host_base: int
    page_stride: int
    token_stride: int
    layer_stride: int
    item_bytes: int
    row_bytes: int
    device_bases: tuple[int, ...]
    #: The part is a whole device row, so a run of rows is one linear copy (else a 2-D copy).
    whole_row: bool

    @classmethod
    def of(cls, part) -> PartAddresses:
        """From a :class:`hicache_core.pool.plan.BoundPart`."""
        return cls(
            name=part.spec.name,
            host_base=part.host.data_ptr() + part.host_offset,
            page_stride=part.page_stride,
            token_stride=part.token_stride,
            layer_stride=part.layer_stride,
            item_bytes=part.item_bytes,
            row_bytes=part.device_row_bytes,
            device_bases=tuple(t.data_ptr() + part.device_offset for t in part.device_layers),
            whole_row=part.device_offset == 0 and part.item_bytes == part.device_row_bytes,
        )


@dataclass
class Runs:
    """Maximal contiguous runs of one call: host item, device row and length of each (int64 arrays)."""

    host: np.ndarray
    device: np.ndarray
    length: np.ndarray
    #: Host page and token of each run start, where already known (else the builder divides).
    page: np.ndarray | None = None
    token: np.ndarray | None = None
    #: Per-part offsets and sizes that do not depend on the layer (filled by the builder, once).
    prepared: tuple | None = None
    #: Every layer's descriptors of the whole-row parts, laid out as the batch call reads them
    #: (filled by the builder on first use where small enough; ``False``: too large).
    tables: object = None
    used: bool = False

    def __len__(self) -> int:
        return int(self.host.shape[0])


class Batch:
    """The copies of one operation.

    Linear copies: ``count`` entries of the int64 arrays ``dst``/``src``/``size`` from
    element ``dst_at``/``src_at``/``size_at`` on (``*_ptr``: the address of that first
    entry, for the driver). They are views of per-runs tables or per-thread buffers,
    valid until the next build on this thread. :meth:`origin` says which (layer, part,
    run) copy ``i`` is, for error messages. ``copies_2d`` are ``(dst, dpitch, src,
    spitch, width, height, origin)`` tuples, one per run of more than one row of a
    2-D part.
    """

    __slots__ = ("dst", "src", "size", "dst_at", "src_at", "size_at", "dst_ptr", "src_ptr", "size_ptr", "count",
                 "copies_2d", "runs", "layers", "to_device", "whole_count", "whole_parts", "extra_origin")  # fmt: skip

    def __init__(self, dst, src, size, dst_at, src_at, size_at, dst_ptr, src_ptr, size_ptr, count,
                 copies_2d, runs, layers, to_device, whole_count, whole_parts, extra_origin) -> None:  # fmt: skip
        self.dst, self.src, self.size = dst, src, size
        self.dst_at, self.src_at, self.size_at = dst_at, src_at, size_at
        self.dst_ptr, self.src_ptr, self.size_ptr = dst_ptr, src_ptr, size_ptr
        self.count = count
        self.copies_2d: list[tuple[int, int, int, int, int, int, tuple[int, int, int]]] = copies_2d
        self.runs: Runs = runs
        self.layers: tuple[int, ...] = layers
        self.to_device: bool = to_device
        #: How many linear copies came from whole-row parts (they come first, in (layer, part, run) order).
        self.whole_count: int = whole_count
        self.whole_parts: tuple[int, ...] = whole_parts
        #: Per linear copy past ``whole_count``: (layer position, part, run) of the one-row 2-D runs.
        self.extra_origin: list[tuple[int, int, int]] = extra_origin

    def linear(self, lo: int = 0, hi: int | None = None) -> tuple[list[int], list[int], list[int]]:
        """Linear copies ``lo`` to ``hi`` as Python lists (dst, src, size)."""
        hi = self.count if hi is None else hi
        return (
            self.dst[self.dst_at + lo : self.dst_at + hi].tolist(),
            self.src[self.src_at + lo : self.src_at + hi].tolist(),
            self.size[self.size_at + lo : self.size_at + hi].tolist(),
        )

    @property
    def nbytes(self) -> int:
        rows = sum(c[4] * c[5] for c in self.copies_2d)
        return int(self.size[self.size_at : self.size_at + self.count].sum()) + rows

    def origin(self, i: int) -> tuple[int, int, int]:
        """(layer, part index, run index) of linear copy ``i``."""
        if i < self.whole_count:
            runs, parts = len(self.runs), len(self.whole_parts)
            layer_pos, rest = divmod(i, parts * runs)
            part_pos, run = divmod(rest, runs)
            return self.layers[layer_pos], self.whole_parts[part_pos], run
        layer_pos, part, run = self.extra_origin[i - self.whole_count]
        return self.layers[layer_pos], part, run


class _Buffers:
    """Per-thread descriptor arrays, grown geometrically and never shrunk (no allocation per call)."""

    def __init__(self) -> None:
        self.capacity = 0
        self.dst = self.src = self.size = np.empty(0, dtype=np.int64)
        self.ptrs = (0, 0, 0)
        self.cache: list[tuple] = []

    def ensure(self, count: int) -> None:
        if count > self.capacity:
            capacity = max(256, 1 << (count - 1).bit_length())
            self.dst = np.empty(capacity, dtype=np.int64)
            self.src = np.empty(capacity, dtype=np.int64)
            self.size = np.empty(capacity, dtype=np.int64)
            self.ptrs = (self.dst.ctypes.data, self.src.ctypes.data, self.size.ctypes.data)
            self.capacity = capacity


class DescriptorBuilder:
    """Builds the copy list of one operation from index pairs; one per host pool."""

    def __init__(
        self,
        parts: list[PartAddresses],
        tokens_per_page: int,
        host_items: int,
        rows_per_layer: tuple[int, ...],
    ) -> None:
        self.parts = parts
        self.tokens_per_page = tokens_per_page
        self.host_items = host_items
        self.rows_per_layer = rows_per_layer
        self.num_layers = len(rows_per_layer)
        # Runs may cross a page boundary only where every part keeps whole pages adjacent.
        self.pages_adjacent = all(p.page_stride == tokens_per_page * p.item_bytes for p in parts)
        self.whole = tuple(i for i, p in enumerate(parts) if p.whole_row)
        self.sliced = tuple(i for i, p in enumerate(parts) if not p.whole_row)
        # (parts, layers) tables, so a layer's addresses are one fancy-index away.
        self._host_layer_base = np.array(
            [[p.host_base + layer * p.layer_stride for layer in range(self.num_layers)] for p in parts], dtype=np.int64
        ).reshape(len(parts), self.num_layers)
        self._dev_base = np.array([list(p.device_bases) for p in parts], dtype=np.int64).reshape(
            len(parts), self.num_layers
        )
        self._page_stride = np.array([p.page_stride for p in parts], dtype=np.int64)
        self._token_stride = np.array([p.token_stride for p in parts], dtype=np.int64)
        self._item = np.array([p.item_bytes for p in parts], dtype=np.int64)
        self._row = np.array([p.row_bytes for p in parts], dtype=np.int64)
        self._hlb_w = self._host_layer_base[list(self.whole)]
        self._db_w = self._dev_base[list(self.whole)]
        self._ramp = np.arange(tokens_per_page, dtype=np.int64)
        self._local = threading.local()
        self._all_layers = tuple(range(self.num_layers))
        self._layer_rows = {layer: rows for layer, rows in enumerate(rows_per_layer)}
        self._min_rows = min(rows_per_layer)

    def _buffers(self) -> _Buffers:
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = _Buffers()
        return bufs

    # ---- runs ----------------------------------------------------------------------------------

    def runs(self, host: torch.Tensor, device: torch.Tensor, device_rows: int) -> Runs:
        """Runs of ``(host, device)`` item pairs (CPU int32/int64 tensors of equal length), bounds checked."""
        bufs = self._buffers()
        if host.is_inference() or device.is_inference():
            # No version counter (made under torch.inference_mode): an in-place write could not be seen.
            return self._find_runs(host.numpy(), device.numpy(), device_rows)[0]
        for entry in bufs.cache:
            # Same tensor objects (kept alive here, so their ids cannot be reused), unmodified since
            # (torch's version counter, shared by every view), checked against the same bound.
            if entry[0] is host and entry[1] is device and entry[2] == host._version and entry[3] == device._version:
                if entry[5] < device_rows:
                    return entry[4]
        runs, max_device = self._find_runs(host.numpy(), device.numpy(), device_rows)
        bufs.cache.insert(0, (host, device, host._version, device._version, runs, max_device))
        del bufs.cache[_CACHE_SLOTS:]
        return runs

    def _find_runs(self, h: np.ndarray, d: np.ndarray, device_rows: int) -> tuple[Runs, int]:
        tpp = self.tokens_per_page
        n = h.shape[0]
        if n == tpp:
            found = self._one_page(h, d, device_rows)
            if found is not None:
                return found
        elif tpp > 1 and n % tpp == 0:
            found = self._page_runs(h, d, device_rows)
            if found is not None:
                return found
        if n > 1:
            step = h[1:] - h[:-1]
            if (step < 0).any():
                order = np.argsort(h, kind="stable")
                h, d = h[order], d[order]
                step = h[1:] - h[:-1]
            brk = step != 1
            brk |= d[1:] - d[:-1] != 1
            if not self.pages_adjacent and tpp > 1:
                brk |= h[1:] % tpp == 0
            elif not self.pages_adjacent:
                brk[:] = True
            cut = np.flatnonzero(brk)
            starts = np.empty(cut.shape[0] + 1, dtype=np.int64)
            starts[0] = 0
            np.add(cut, 1, out=starts[1:])
        else:
            starts = np.zeros(1, dtype=np.int64)
        hi_d = self._check_bounds(int(h[0]), int(h[-1]), h, d, 0, device_rows)  # sorted: the ends are the extremes
        lengths = np.empty_like(starts)
        lengths[:-1] = starts[1:] - starts[:-1]
        lengths[-1] = n - starts[-1]
        return Runs(h[starts].astype(np.int64), d[starts].astype(np.int64), lengths), hi_d

    def _one_page(self, h: np.ndarray, d: np.ndarray, device_rows: int) -> tuple[Runs, int] | None:
        """One whole page (or one item, for pages of one): the small call a server makes most often."""
        tpp = self.tokens_per_page
        h0, d0 = int(h[0]), int(d[0])
        if tpp > 1:
            ramp = self._ramp
            if h0 % tpp or not ((h - h0) == ramp).all() or not ((d - d0) == ramp).all():
                return None
        if h0 < 0 or h0 + tpp > self.host_items or d0 < 0 or d0 + tpp > device_rows:
            raise IndexError(
                f"indices out of range: host [{int(h.min())}, {int(h.max())}] of [0, {self.host_items}), "
                f"device [{int(d.min())}, {int(d.max())}] of [0, {device_rows}); nothing was copied"
            )
        one = np.empty(5, dtype=np.int64)
        one[:] = (h0, d0, tpp, h0 // tpp, h0 % tpp)
        return Runs(one[0:1], one[1:2], one[2:3], page=one[3:4], token=one[4:5]), d0 + tpp - 1

    def _page_runs(self, h: np.ndarray, d: np.ndarray, device_rows: int) -> tuple[Runs, int] | None:
        """Runs of indices that come in whole host pages (what servers pass), worked out per page: a
        fraction of the work of the item-wise path. ``None`` when they do not (the caller falls back)."""
        tpp = self.tokens_per_page
        hp, dp = h.reshape(-1, tpp), d.reshape(-1, tpp)
        hs, ds = hp[:, 0], dp[:, 0]
        ramp = self._ramp
        if not (((hp - hs[:, None]) == ramp).all() and ((dp - ds[:, None]) == ramp).all()) or (hs % tpp).any():
            return None
        pages = hs.shape[0]
        if pages > 1 and (hs[1:] < hs[:-1]).any():
            order = np.argsort(hs)
            hs, ds = hs[order], ds[order]
        hi_d = self._check_bounds(int(hs[0]), int(hs[-1]) + tpp - 1, h, d, tpp - 1, device_rows)
        hs, ds = hs.astype(np.int64), ds.astype(np.int64)
        if self.pages_adjacent and pages > 1:
            brk = hs[1:] - hs[:-1] != tpp
            brk |= ds[1:] - ds[:-1] != tpp
            cut = np.flatnonzero(brk)
            if cut.shape[0] + 1 < pages:
                starts = np.empty(cut.shape[0] + 1, dtype=np.int64)
                starts[0] = 0
                np.add(cut, 1, out=starts[1:])
                lengths = np.empty_like(starts)
                lengths[:-1] = starts[1:] - starts[:-1]
                lengths[-1] = pages - starts[-1]
                hs, ds = hs[starts], ds[starts]
                return Runs(hs, ds, lengths * tpp, page=hs // tpp, token=np.zeros_like(hs)), hi_d
        return Runs(hs, ds, np.full(pages, tpp, dtype=np.int64), page=hs // tpp, token=np.zeros_like(hs)), hi_d

    def _check_bounds(self, lo_h: int, hi_h: int, h: np.ndarray, d: np.ndarray, extra: int, device_rows: int) -> int:
        """Raise unless host items lie in [lo_h, hi_h] inside the pool and device rows below ``device_rows``."""
        # Negative rows become huge once read as unsigned: one reduction checks both ends.
        hi_d = int(d.view(np.uint64 if d.dtype.itemsize == 8 else np.uint32).max()) if extra == 0 else None
        if hi_d is None:
            starts = d.reshape(-1, extra + 1)[:, 0]
            hi_d = int(starts.view(np.uint64 if d.dtype.itemsize == 8 else np.uint32).max()) + extra
        if lo_h < 0 or hi_h >= self.host_items or hi_d >= device_rows:
            raise IndexError(
                f"indices out of range: host [{int(h.min())}, {int(h.max())}] of [0, {self.host_items}), "
                f"device [{int(d.min())}, {int(d.max())}] of [0, {device_rows}); nothing was copied"
            )
        return hi_d

    def rows_for(self, layers: tuple[int, ...]) -> int:
        """Device rows every one of ``layers`` has (a draft layer may have fewer than the target's)."""
        if len(layers) == 1:
            return self._layer_rows[layers[0]]
        return self._min_rows if layers is self._all_layers else min(self._layer_rows[x] for x in layers)

    # ---- descriptors ---------------------------------------------------------------------------

    def layers_all(self) -> tuple[int, ...]:
        """Every host layer, as the tuple all-layer operations pass to :meth:`build`."""
        return self._all_layers

    def build(self, runs: Runs, layers: tuple[int, ...], to_device: bool) -> Batch:
        """Every copy of ``runs`` for ``layers``: linear copies in (layer, part, run) order, then 2-D ones."""
        if not self.sliced:
            tables = runs.tables
            if tables is None:
                if len(layers) == 1 and not runs.used and len(runs) * len(self.whole) <= _SMALL:
                    # First use of a few copies: plain integers beat numpy's per-call cost; the
                    # tables pay off from the second use (the next layer) on.
                    runs.used = True
                    return self._build_small(runs, layers, to_device)
                tables = runs.tables = self._tables(runs)
            if tables is not False:
                # The copies already sit in tables, one (parts x runs) block per layer: a batch is
                # a pointer into them, with no work per call.
                host_tab, dev_tab, sizes, host_ptr, dev_ptr, sizes_ptr, per_layer = tables
                if len(layers) == 1:
                    at = layers[0] * per_layer
                    count, size_arr, size_at, size_ptr = per_layer, sizes, 0, sizes_ptr
                elif layers is self._all_layers:
                    at, count = 0, per_layer * self.num_layers
                    size_arr, size_ptr = self._all_sizes(runs, sizes)
                    size_at = 0
                else:
                    return self._build(runs, layers, to_device)
                off = at * 8
                if to_device:
                    return Batch(dev_tab, host_tab, size_arr, at, at, size_at, dev_ptr + off, host_ptr + off, size_ptr,
                                 count, [], runs, layers, True, count, self.whole, [])  # fmt: skip
                return Batch(host_tab, dev_tab, size_arr, at, at, size_at, host_ptr + off, dev_ptr + off, size_ptr,
                             count, [], runs, layers, False, count, self.whole, [])  # fmt: skip
        return self._build(runs, layers, to_device)

    def _build_small(self, runs: Runs, layers: tuple[int, ...], to_device: bool) -> Batch:
        layer = layers[0]
        bufs = self._buffers()
        count = len(runs) * len(self.whole)
        bufs.ensure(count)
        host_buf, dev_buf = (bufs.src, bufs.dst) if to_device else (bufs.dst, bufs.src)
        page = runs.page.tolist() if runs.page is not None else (runs.host // self.tokens_per_page).tolist()
        token = runs.token.tolist() if runs.token is not None else (runs.host % self.tokens_per_page).tolist()
        rows, lengths = runs.device.tolist(), runs.length.tolist()
        i = 0
        for p in self.whole:
            part = self.parts[p]
            hb, db = part.host_base + layer * part.layer_stride, part.device_bases[layer]
            for r in range(len(rows)):
                host_buf[i] = hb + page[r] * part.page_stride + token[r] * part.token_stride
                dev_buf[i] = db + rows[r] * part.row_bytes
                bufs.size[i] = lengths[r] * part.item_bytes
                i += 1
        dst_ptr, src_ptr, size_ptr = bufs.ptrs
        return Batch(bufs.dst, bufs.src, bufs.size, 0, 0, 0, dst_ptr, src_ptr, size_ptr, count, [], runs, layers,
                     to_device, count, self.whole, [])  # fmt: skip

    def _prepare(self, runs: Runs) -> tuple:
        """What depends on the runs but not on the layer: computed once per runs (a server's per-layer
        loads reuse it for every layer)."""
        prep = runs.prepared
        if prep is None:
            if runs.page is not None:
                page, token = runs.page, runs.token
            else:
                page, token = np.divmod(runs.host, self.tokens_per_page)
            host_off = page[None, :] * self._page_stride[:, None] + token[None, :] * self._token_stride[:, None]
            dev_off = runs.device[None, :] * self._row[:, None]
            sizes = runs.length[None, :] * self._item[:, None]
            w = list(self.whole)
            prep = runs.prepared = (host_off[w], dev_off[w], np.ascontiguousarray(sizes[w]), host_off, dev_off)
        return prep

    def _tables(self, runs: Runs):
        nr, pw = len(runs), len(self.whole)
        per_layer = pw * nr
        if per_layer * self.num_layers > _TABLE_LIMIT:
            return False
        host_off_w, dev_off_w, sizes_w, _, _ = self._prepare(runs)
        host_tab = (self._hlb_w.T[:, :, None] + host_off_w[None]).reshape(-1)
        dev_tab = (self._db_w.T[:, :, None] + dev_off_w[None]).reshape(-1)
        sizes = sizes_w.reshape(-1)
        return host_tab, dev_tab, sizes, host_tab.ctypes.data, dev_tab.ctypes.data, sizes.ctypes.data, per_layer

    def _all_sizes(self, runs: Runs, sizes: np.ndarray) -> tuple[np.ndarray, int]:
        all_sizes = getattr(runs, "_all_sizes", None)
        if all_sizes is None:
            all_sizes = np.tile(sizes, self.num_layers)
            runs._all_sizes = all_sizes = (all_sizes, all_sizes.ctypes.data)
        return all_sizes

    def _build(self, runs: Runs, layers: tuple[int, ...], to_device: bool) -> Batch:
        nl, nr = len(layers), len(runs)
        whole, sliced = self.whole, self.sliced
        host_off_w, dev_off_w, sizes_w, host_off, dev_off = self._prepare(runs)
        bufs = self._buffers()
        extra: list[tuple[int, int, int]] = []
        copies_2d: list = []
        extra_count = 0
        if sliced:
            one_row = np.flatnonzero(runs.length == 1)
            multi = np.flatnonzero(runs.length > 1)
            extra_count = nl * len(sliced) * one_row.shape[0]
        whole_count = nl * len(whole) * nr
        count = whole_count + extra_count
        bufs.ensure(count)
        host_buf, dev_buf = (bufs.src, bufs.dst) if to_device else (bufs.dst, bufs.src)
        if whole:
            shape = (nl, len(whole), nr)
            idx = np.asarray(layers, dtype=np.int64)
            np.add(self._hlb_w[:, idx].T[:, :, None], host_off_w[None], out=host_buf[:whole_count].reshape(shape))
            np.add(self._db_w[:, idx].T[:, :, None], dev_off_w[None], out=dev_buf[:whole_count].reshape(shape))
            bufs.size[:whole_count].reshape(shape)[:] = sizes_w[None]
        if sliced:
            pos = whole_count
            lengths = runs.length.tolist()
            for li, layer in enumerate(layers):
                for p in sliced:
                    part = self.parts[p]
                    host_addr = host_off[p] + int(self._host_layer_base[p, layer])
                    dev_addr = dev_off[p] + int(self._dev_base[p, layer])
                    k = one_row.shape[0]
                    if k:
                        host_buf[pos : pos + k] = host_addr[one_row]
                        dev_buf[pos : pos + k] = dev_addr[one_row]
                        bufs.size[pos : pos + k] = part.item_bytes
                        extra.extend((li, p, r) for r in one_row.tolist())
                        pos += k
                    if multi.shape[0]:
                        item, row = part.item_bytes, part.row_bytes
                        for r, ha, da in zip(multi.tolist(), host_addr[multi].tolist(), dev_addr[multi].tolist()):
                            n = lengths[r]
                            if to_device:
                                copies_2d.append((da, row, ha, item, item, n, (layer, p, r)))
                            else:
                                copies_2d.append((ha, item, da, row, item, n, (layer, p, r)))
        dst_ptr, src_ptr, size_ptr = bufs.ptrs
        return Batch(bufs.dst, bufs.src, bufs.size, 0, 0, 0, dst_ptr, src_ptr, size_ptr, count, copies_2d, runs,
                     tuple(layers), to_device, whole_count, whole, extra)  # fmt: skip

    def describe(self, batch: Batch, origin: tuple[int, int, int]) -> str:
        """Words for the run behind one copy: what an error names."""
        layer, p, r = origin
        runs = batch.runs
        h0, d0, n = int(runs.host[r]), int(runs.device[r]), int(runs.length[r])
        part = self.parts[p]
        direction = "host -> device" if batch.to_device else "device -> host"
        return (
            f"run {r} of {len(runs)} (host items [{h0}, {h0 + n}), device rows [{d0}, {d0 + n}), host layer {layer}, "
            f"part {part.name!r}, {n * part.item_bytes} bytes, {direction})"
        )
