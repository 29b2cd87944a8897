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
        """From a :class:`hicache_core.plan.BoundPart`."""
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
    #: Per-part offsets and sizes that do not depend on the layer (filled by the builder, once).
    prepared: tuple | None = None

    def __len__(self) -> int:
        return int(self.host.shape[0])


@dataclass
class Batch:
    """The copies of one operation.

    ``dst``/``src``/``size`` (int64 arrays, views into reused buffers, valid until the
    next build on this thread) are linear copies; ``origin[i]`` says which (layer,
    part, run) copy ``i`` is, for error messages. ``copies_2d`` are ``(dst, dpitch,
    src, spitch, width, height, origin)`` tuples, one per run of a 2-D part.
    """

    dst: np.ndarray
    src: np.ndarray
    size: np.ndarray
    count: int
    copies_2d: list[tuple[int, int, int, int, int, int, tuple[int, int, int]]]
    runs: Runs
    layers: tuple[int, ...]
    to_device: bool
    #: How many linear copies came from whole-row parts (they come first, in (layer, part, run) order).
    whole_count: int
    whole_parts: tuple[int, ...]
    #: Per linear copy past ``whole_count``: (layer position, part, run) of the one-row 2-D runs.
    extra_origin: list[tuple[int, int, int]]

    @property
    def nbytes(self) -> int:
        rows = int(sum(c[4] * c[5] for c in self.copies_2d))
        return int(self.size[: self.count].sum()) + rows

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
        self.cache: list[tuple] = []

    def ensure(self, count: int) -> None:
        if count > self.capacity:
            capacity = max(256, 1 << (count - 1).bit_length())
            self.dst = np.empty(capacity, dtype=np.int64)
            self.src = np.empty(capacity, dtype=np.int64)
            self.size = np.empty(capacity, dtype=np.int64)
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
        n = h.shape[0]
        if n > 1:
            step = h[1:] - h[:-1]
            if (step < 0).any():
                order = np.argsort(h, kind="stable")
                h, d = h[order], d[order]
                step = h[1:] - h[:-1]
            brk = step != 1
            brk |= d[1:] - d[:-1] != 1
            if not self.pages_adjacent and self.tokens_per_page > 1:
                brk |= h[1:] % self.tokens_per_page == 0
            elif not self.pages_adjacent:
                brk[:] = True
            cut = np.flatnonzero(brk)
            starts = np.empty(cut.shape[0] + 1, dtype=np.int64)
            starts[0] = 0
            np.add(cut, 1, out=starts[1:])
        else:
            starts = np.zeros(1, dtype=np.int64)
        lo_h, hi_h = int(h[0]), int(h[-1])  # sorted: the ends are the extremes
        # Negative indices become huge once read as unsigned: one comparison checks both ends.
        hi_d = int(d.view(np.uint64 if d.dtype == np.int64 else np.uint32).max())
        if lo_h < 0 or hi_h >= self.host_items or hi_d >= device_rows:
            lo_d = int(d.min())
            hi_d = int(d.max())
            raise IndexError(
                f"indices out of range: host [{int(h.min())}, {int(h.max())}] of [0, {self.host_items}), "
                f"device [{lo_d}, {hi_d}] of [0, {device_rows}); nothing was copied"
            )
        lengths = np.empty_like(starts)
        lengths[:-1] = starts[1:] - starts[:-1]
        lengths[-1] = n - starts[-1]
        return Runs(h[starts].astype(np.int64), d[starts].astype(np.int64), lengths), hi_d

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
        nl, nr = len(layers), len(runs)
        whole, sliced = self.whole, self.sliced
        prep = runs.prepared
        if prep is None:
            # What depends on the runs but not on the layer: computed once per runs (a server's
            # per-layer loads reuse it for every layer).
            page, token = np.divmod(runs.host, self.tokens_per_page)
            host_off = page[None, :] * self._page_stride[:, None] + token[None, :] * self._token_stride[:, None]
            dev_off = runs.device[None, :] * self._row[:, None]
            sizes = runs.length[None, :] * self._item[:, None]
            w = list(whole)
            prep = runs.prepared = (host_off[w], dev_off[w], sizes[w], host_off, dev_off)
        host_off_w, dev_off_w, sizes_w, host_off, dev_off = prep
        bufs = self._buffers()
        extra: list[tuple[int, int, int]] = []
        copies_2d: list = []
        if sliced:
            one_row = np.flatnonzero(runs.length == 1)
            multi = np.flatnonzero(runs.length > 1)
            extra_count = nl * len(sliced) * one_row.shape[0]
        whole_count = nl * len(whole) * nr
        count = whole_count + (extra_count if sliced else 0)
        bufs.ensure(count)
        host_buf, dev_buf = (bufs.src, bufs.dst) if to_device else (bufs.dst, bufs.src)
        if whole:
            pw = len(whole)
            if nl == 1:
                layer = layers[0]
                np.add(self._hlb_w[:, layer, None], host_off_w, out=host_buf[:whole_count].reshape(pw, nr))
                np.add(self._db_w[:, layer, None], dev_off_w, out=dev_buf[:whole_count].reshape(pw, nr))
                bufs.size[:whole_count].reshape(pw, nr)[:] = sizes_w
            else:
                shape = (nl, pw, nr)
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
        return Batch(
            dst=bufs.dst,
            src=bufs.src,
            size=bufs.size,
            count=count,
            copies_2d=copies_2d,
            runs=runs,
            layers=tuple(layers),
            to_device=to_device,
            whole_count=whole_count,
            whole_parts=whole,
            extra_origin=extra,
        )

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
