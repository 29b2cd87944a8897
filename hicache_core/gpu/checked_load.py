"""Loads that check what they move: the copy and the page checksum in one launch (this module does not import triton).

A verifying pool checks every load against the checksums its backups took
(:mod:`hicache_core.verification.verify`).
Done apart, that check is a second kernel after the last layer, which reads the loaded rows again, and
host time on every call and at the end of every load: the cost of verification on small loads, which
are bound by host time. :class:`CheckedLoads` folds the check into the copy instead: a Triton
implementation that takes it (:meth:`hicache_core.gpu.triton_base.TritonImplementation.bind_load_check`)
launches :func:`~hicache_core.gpu.checked_load_kernel.checked_load` for each per-layer load, which moves
the pages and compares their checksums in the same pass, on the caller's stream, in the call itself. So a
verified load costs the host what a plain one does, the check runs before anything enqueued after the
load (it is the load), and a mismatch is reported as the separate check reports it (the failure word
names the call).

It takes plans whose every component is one part spanning the whole device row, laid out in whole
32-bit words on both sides: :func:`refusals` says why another plan is not (its loads are checked apart,
as before).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..verification.page_checksum import CHECKED_LOAD_FIELDS, seed, tile_shape
from .device import cuda_current_functions

#: Items a work unit of the kernel covers at most (a tile): a whole page of 64, so a unit's word loop is long enough
#: for its pipeline (16 steps for Llama's 512-word rows). Pages of one item take this many pages a unit instead.
TILE_ITEMS = 64
#: 32-bit words a step of a unit reads (items x words): 8 KiB, as the checksum kernel's tile.
TILE_WORDS = 2048
#: Items a step must hold for a unit to be one step (rows of at most TILE_WORDS / 16 words, 512 bytes): fewer, and
#: the word loop of several steps is the better pipeline.
ONE_STEP_ITEMS = 16
#: Stages the compiled kernel pipelines its host reads over (whatever the plain copy's own ``stages`` knob says:
#: the plain kernel keeps many small tiles in flight without them, a unit's chain of reads does not).
STAGES = 4


def refusals(plan: Any, components: int) -> list[str]:
    """Why this plan's loads cannot check in the copy (empty: they can)."""
    out = []
    by_component: dict[int, list[Any]] = {}
    for part in plan.parts:
        by_component.setdefault(part.spec.component, []).append(part)
    for comp, parts in sorted(by_component.items()):
        name = plan.geometry.components[comp].name
        if len(parts) > 1:
            out.append(f"component {name!r} is split over {len(parts)} host parts")
            continue
        part = parts[0]
        row = part.device_layers[0].shape[1]
        if part.device_offset or part.item_bytes != row or not part.device_item_contiguous:
            out.append(f"component {name!r}'s part does not span its device row")
        host_facts = [part.host.data_ptr() + part.host_offset, part.layer_stride, part.page_stride, part.token_stride,
                      part.piece_bytes, part.head_stride if not part.host_item_contiguous else 0, row]  # fmt: skip
        host_facts += [t.data_ptr() for t in part.device_layers] + [t.stride(0) for t in part.device_layers]
        if any(f % 4 for f in host_facts):
            out.append(f"component {name!r} is not laid out in whole 32-bit words on both sides")
    if len(by_component) != components:
        out.append("the plan's components differ from the verifier's")
    return out


class CheckedLoads:
    """Per-layer loads of one pool that copy and check in one launch (see the module doc).

    :param plan: the pool's transfer plan; :func:`refusals` must be empty for it.
    :param verifier: the pool's :class:`~hicache_core.verification.verify.PageVerifier` (its table, failure words,
        tiling).
    :param call_number: the calling thread's call number holder (``.seq``,
        :class:`~hicache_core.pool.drops.DropReport`).
    :param programs: the persistent grid's size (the implementation's SM budget).
    :param interpreted: the kernel runs under Triton's interpreter (no pipelining: plain loops).
    :param launching: ``(hooks_idle, compiled_launch)`` of :mod:`hicache_core.gpu.triton_base` (handed in by the
        implementation that binds this: the direct launch path is the base class's).
    """

    def __init__(self, plan: Any, verifier: Any, call_number: Any, programs: int, interpreted: bool,
                 launching: tuple[Callable[[], bool], Callable[[Any], Any]]) -> None:  # fmt: skip
        self._hooks_idle, self._compiled_launch = launching
        self.plan = plan
        self.verifier = verifier
        self._call_now = call_number
        self.programs = programs
        self._cuda = plan.device.type == "cuda"
        self._anchor = torch.zeros(8, dtype=torch.int32, device=plan.device)
        base = self._anchor_ptr = self._anchor.data_ptr()

        def words_from_anchor(address: int) -> int:
            assert (address - base) % 4 == 0, "addresses are whole 32-bit words apart (refusals)"
            return (address - base) // 4

        tokens = plan.tokens_per_page
        parts = {p.spec.component: p for p in plan.parts}
        rows_by_layer = []
        for layer in range(plan.num_layers):
            rows = []
            for comp in range(len(verifier.components)):
                part = parts[comp]
                dev = part.device_layers[layer]
                merged = part.host_item_contiguous
                rows.append([
                    words_from_anchor(dev.data_ptr()), dev.stride(0) // 4, verifier.words[comp], seed(layer, comp),
                    ((layer * len(verifier.components)) + comp) * verifier.groups, dev.shape[0],
                    words_from_anchor(part.host.data_ptr() + part.host_offset + layer * part.layer_stride),
                    part.page_stride // 4, part.token_stride // 4, 0 if merged else part.head_stride // 4,
                    verifier.words[comp] if merged else part.piece_bytes // 4, plan.num_items,
                ])  # fmt: skip
            rows_by_layer.append(rows)
        self._entries = torch.tensor(rows_by_layer, dtype=torch.int64).to(plan.device)
        assert self._entries.shape[-1] == len(CHECKED_LOAD_FIELDS)
        self._entry_words = [words_from_anchor(self._entries[layer].data_ptr()) for layer in range(plan.num_layers)]
        self._num_entries = len(verifier.components)
        fail_word = words_from_anchor(verifier.failure_words.data_ptr())
        # The kernel's arguments that are the same on every call, after the per-call ones: the failure words (the
        # pages' slots one int64 after the word), the drop word, the table's shape.
        self._fixed = (self._num_entries, words_from_anchor(verifier.table.data_ptr()), fail_word, fail_word + 2,
                       words_from_anchor(plan.drop_report.address), verifier.num_pages, verifier.columns)  # fmt: skip
        self._widest = max(verifier.words)
        facts = [e for rows in rows_by_layer for r in rows for e in (r[0], r[1], r[2], r[6], r[7], r[8], r[9], r[10])]
        self._align = next(a for a in (4, 2, 1) if all(f % a == 0 for f in facts))
        self._interpreted = interpreted
        self._fast: dict[tuple[bool, bool], tuple] = {}
        self._tokens = tokens
        self.tune()
        self._device_index = -1
        if self._cuda:
            index = plan.device.index
            self._device_index = index if index is not None else torch.cuda.current_device()
            self._get_stream = cuda_current_functions()[1]
            torch.cuda.synchronize(plan.device)  # the entry tables are on the device before the first launch

    def load(self, h: torch.Tensor, d: torch.Tensor, layer: int) -> None:
        """Copy host layer ``layer`` of the items ``h`` to device rows ``d`` and check their pages (the call's
        indices, as the implementation takes them: whole pages of items, on the pool's device)."""
        n = h.shape[0]
        if d.shape[0] != n:
            raise ValueError(f"host_indices has {n} entries but device_indices has {d.shape[0]} (length mismatch)")
        if n == 0:
            return
        pages = n // self._tokens
        work = -(-pages // self._pages_per_unit) * self._num_entries * self._tiles_per_page
        grid = work if work < self.programs else self.programs
        wide = (h.dtype == torch.int64, d.dtype == torch.int64)
        base = self._anchor_ptr
        # int32 and int64 tensors start on 4 bytes, as the anchor does: whole words from it
        args = (self._entry_words[layer], (h.data_ptr() - base) >> 2, (d.data_ptr() - base) >> 2, h.stride()[0],
                d.stride()[0], pages, self._call_now.seq, *self._fixed)  # fmt: skip
        fast = self._fast.get(wide)
        if fast is not None and self._hooks_idle():
            call, head, constexprs = fast
            call(grid, 1, 1, self._get_stream(self._device_index), *head, base, *args, *constexprs)
            return
        self._launch_slow(grid, args, wide, fast is None)

    def tune(self, tile_items: int | None = None, tile_words: int | None = None, stages: int | None = None,
             programs: int | None = None, row_sums: bool = False) -> None:
        """Set the kernel's tiling (default: :data:`TILE_ITEMS`, :data:`TILE_WORDS`), pipeline stages (compiled
        only), grid and sums (per word of a step, or ``row_sums``: per row) (benchmarks/verify_in_copy_variants.py
        compares them); the next launch builds for them."""
        self._row_sums = row_sums
        items, words = tile_items or TILE_ITEMS, tile_words or TILE_WORDS
        tokens, widest = self._tokens, self._widest
        row = 1 << max(2, (widest - 1).bit_length())  # the widest row in a power of two of words
        if tokens == 1:  # a unit is pages side by side, a row each: as many as a step of the row holds
            block_w = min(row, words)
            tile_t, group = max(1, min(items, words // block_w)), 1
        else:
            tile_t, group, _ = tile_shape(tokens, widest)
            if row * ONE_STEP_ITEMS <= words:  # narrow rows (a K-only head): a unit is the items one step holds
                tile_t = max(group, min(tile_t, items, words // row))
            else:
                tile_t = min(tile_t, max(group, items))
            block_w = min(max(4, words // tile_t), row)
        self._tile = (tile_t, group, block_w)
        self._one_step = block_w >= widest  # every unit is one step: the units are pipelined, not the steps
        self._pages_per_unit = tile_t if tokens == 1 else 1
        self._tiles_per_page = 1 if tokens == 1 else -(-tokens // tile_t)
        self._stages = 0 if self._interpreted else STAGES if stages is None else stages
        if programs is not None:
            self.programs = programs
        self._fast.clear()

    def warmup(self) -> None:
        """Build the kernel for int64 indices now (a launch that moves nothing), so a kernel that cannot be built
        is known when the pool is made, not at its first load."""
        empty = (self._anchor[:0].to(torch.int64).data_ptr() - self._anchor_ptr) >> 2
        self._launch_slow(1, (self._entry_words[0], empty, empty, 1, 1, 0, 0, *self._fixed), (True, True), True)

    def _launch_slow(self, grid: int, args: tuple, wide: tuple[bool, bool], remember: bool) -> None:
        from .checked_load_kernel import checked_load

        tile_t, group, block_w = self._tile
        constexprs = (self._tokens, self.verifier.groups, tile_t, group, block_w, self._align, self._stages, *wide,
                      self._one_step, self._row_sums)  # fmt: skip
        names = ("TOKENS", "GROUPS", "TILE_T", "GROUP", "BLOCK_W", "ALIGN", "STAGES", "H_WIDE", "D_WIDE", "ONE_STEP",
                 "ROW_SUMS")  # fmt: skip
        if self._cuda:
            with torch.cuda.device(self._device_index):
                compiled = checked_load[(grid,)](self._anchor, *args, **dict(zip(names, constexprs)), num_warps=8)
        else:
            compiled = checked_load[(grid,)](self._anchor, *args, **dict(zip(names, constexprs)), num_warps=8)
        if self._cuda and remember:
            direct = self._compiled_launch(compiled)
            if direct is not None:  # the constexprs' values follow the runtime arguments, in the kernel's order
                self._fast[wide] = (*direct, constexprs)
