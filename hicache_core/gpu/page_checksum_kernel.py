"""The page checksum on the device, in Triton (imports triton: only :mod:`hicache_core.verification.verify` imports
it, lazily, for a verifying pool on CUDA).

One program per (``PAGES`` pages of the call, entry): an entry is one (host layer, component) with its device
layer's address, row stride, row words, seed and column in the checksum table. A program reads its
page's rows in tiles of ``TILE_T`` rows by ``BLOCK_W`` words (coalesced along the row), sums each
row, then each group of ``GROUP`` rows: one pass over the page bytes, and the page's checksum words
read or written as one run of the table row. ``CHECK=False`` stores the sums in the checksum table
(backup); ``CHECK=True`` compares them with it (after a load) and, for a mismatch, stores the call's
number in the failure word and in the page's failure slot (masked stores: a clean check writes
nothing); a table word that holds no checksum (:data:`~hicache_core.verification.page_checksum.NO_CHECKSUM`)
takes the loaded bytes' instead. One launch may cover many layers (a whole load's): with ``SEQ_STEP
> 0`` the call number written for entry ``e`` is ``seq - e // SEQ_STEP`` (one number per layer of
the launch, which the verifier maps back to the layer's call). Where a page is one item (page kinds' rows),
a program takes ``PAGES`` pages side by side, ``BLOCK_W`` words of each a step
(:func:`~hicache_core.verification.page_checksum.pages_per_program`).

The definition's sum ``sum(w_j * (s + j * M2))`` is taken as ``s * sum(w_j) + M2 * sum(j * w_j)``
(equal mod 2**64): per word one 32 x 32 -> 64-bit multiply and two adds instead of two 64-bit
multiplies. A check issues its table load (host memory, a round trip over the link) before it
reads the rows, so the two overlap.

Every address is a byte offset from one anchor tensor, as in hicache's transfer kernels, so the
device rows, the pinned table and the failure words (reached through UVA) are addressed alike.
Out-of-range indices are skipped (the transfer that received them reports them).

(No ``from __future__ import annotations`` here: Triton reads annotations.)
"""

import triton
import triton.language as tl

from ..verification.page_checksum import ENTRY_COLUMNS, M2
from .device import cuda_current_functions
from .triton_base import compiled_launch, hooks_idle, load_triton_runtime
from .triton_lang import settle

load_triton_runtime()  # for hooks_idle: a profiler hook sees every launch

_M2 = tl.constexpr(M2)
_COLS = tl.constexpr(ENTRY_COLUMNS)


@triton.jit
def _sum_words(base, ok_t, t, w, words, sum_w, sum_jw):
    """Add one tile's words (``w``: their positions in the row) to the two running sums."""
    mask = ok_t[:, None] & (w < words)[None, :]
    vals = tl.load(base[:, None] + w[None, :], mask=mask, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
    j = (t[:, None] * words + w[None, :]).to(tl.uint32, bitcast=True).to(tl.uint64)  # < 2**31 in a page
    return sum_w + vals, sum_jw + vals * j  # a 32 x 32 -> 64-bit product: it cannot wrap


@triton.jit
def _sum_rows(base, ok_t, t, lanes, words, ROWS: tl.constexpr, BLOCK_W: tl.constexpr, STAGES: tl.constexpr):
    """The two running sums of ``ROWS`` rows (``base``: where each starts), ``BLOCK_W`` words a step."""
    sum_w = tl.zeros((ROWS, BLOCK_W), dtype=tl.uint64)
    sum_jw = tl.zeros((ROWS, BLOCK_W), dtype=tl.uint64)
    if STAGES > 0:  # compiled: the next steps' loads are in flight while this one is summed
        for w0 in tl.range(0, words, BLOCK_W, num_stages=STAGES):
            sum_w, sum_jw = _sum_words(base, ok_t, t, w0 + lanes, words, sum_w, sum_jw)
    else:
        w0 = 0
        while w0 < words:
            sum_w, sum_jw = _sum_words(base, ok_t, t, w0 + lanes, words, sum_w, sum_jw)
            w0 += BLOCK_W
    return sum_w, sum_jw


#: Runtime arguments: never specialised on (value or alignment), and typed int64 whatever their value, so one
#: compiled kernel serves every call and its C launcher can be called directly (:class:`ChecksumLaunch`).
_RUNTIME = ("entries", "hidx", "didx", "table", "fail_word", "fail_pages", "seq", "host_pages", "table_columns",
            "pages")  # fmt: skip


@triton.jit(do_not_specialize=_RUNTIME)
def page_checksums(
    anchor,
    entries: tl.int64,
    hidx: tl.int64,
    didx: tl.int64,
    table: tl.int64,
    fail_word: tl.int64,
    fail_pages: tl.int64,
    seq: tl.int64,
    host_pages: tl.int64,
    table_columns: tl.int64,
    pages: tl.int64,
    TOKENS: tl.constexpr,
    GROUPS: tl.constexpr,
    TILE_T: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_W: tl.constexpr,
    CHECK: tl.constexpr,
    SEQ_STEP: tl.constexpr,
    ALIGN: tl.constexpr,
    STAGES: tl.constexpr,
    PAGES: tl.constexpr,
):
    e = tl.program_id(1)
    entry = (anchor + entries).to(tl.pointer_type(tl.int64)) + e * _COLS
    layer_off = tl.load(entry)
    row_stride = tl.load(entry + 1)
    words = tl.load(entry + 2).to(tl.int32)
    if ALIGN > 1:
        words = tl.multiple_of(words, ALIGN)  # so the row-end mask is constant over each vector
    s = tl.load(entry + 3).to(tl.uint64, bitcast=True)
    column = tl.load(entry + 4)
    rows = tl.load(entry + 5)
    if SEQ_STEP > 0:
        fail_seq = seq - e // SEQ_STEP
    else:
        fail_seq = seq
    if PAGES > 1:  # pages of one item, PAGES of them side by side
        _check_pages(anchor, hidx, didx, table, fail_word, fail_pages, host_pages, table_columns, pages, layer_off,
                     row_stride, words, s, column, rows, fail_seq, BLOCK_W, CHECK, ALIGN, STAGES, PAGES)  # fmt: skip
        return
    page = tl.program_id(0).to(tl.int64)
    hp = tl.load((anchor + hidx).to(tl.pointer_type(tl.int64)) + page * TOKENS) // TOKENS
    live = (hp >= 0) & (hp < host_pages)
    slots = (anchor + table).to(tl.pointer_type(tl.int64)) + hp * table_columns + column
    lanes = tl.arange(0, BLOCK_W)
    t0 = 0
    while t0 < TOKENS:  # while loops: the interpreter runs them too
        g = t0 // GROUP + tl.arange(0, TILE_T // GROUP)  # this tile's groups
        live_g = live & (g < GROUPS)
        if CHECK:
            expected = tl.load(slots + g, mask=live_g, other=0)
        t = t0 + tl.arange(0, TILE_T)  # the items (tokens) of this tile, within the page
        live_t = t < TOKENS
        r = tl.load((anchor + didx).to(tl.pointer_type(tl.int64)) + page * TOKENS + t, mask=live_t, other=-1)
        ok_t = live_t & (r >= 0) & (r < rows)
        row_off = layer_off + r * row_stride
        if ALIGN > 1:  # every row starts on ALIGN words: vector loads
            row_off = tl.multiple_of(row_off, ALIGN * 4)
        base = (anchor + row_off).to(tl.pointer_type(tl.int32))
        sum_w, sum_jw = _sum_rows(base, ok_t, t, lanes, words, TILE_T, BLOCK_W, STAGES)
        group_w = tl.sum(tl.reshape(tl.sum(sum_w, axis=1), (TILE_T // GROUP, GROUP)), axis=1)
        group_jw = tl.sum(tl.reshape(tl.sum(sum_jw, axis=1), (TILE_T // GROUP, GROUP)), axis=1)
        total = (group_w * s + group_jw * _M2).to(tl.int64, bitcast=True)
        if CHECK:
            settle(anchor, fail_word, fail_pages, slots + g, hp, expected, total, live_g, fail_seq)
        else:
            tl.store(slots + g, total, mask=live_g)
        t0 += TILE_T


@triton.jit
def _check_pages(anchor, hidx, didx, table, fail_word, fail_pages, host_pages, table_columns, pages, layer_off,
                 row_stride, words, s, column, rows, fail_seq, BLOCK_W: tl.constexpr, CHECK: tl.constexpr,
                 ALIGN: tl.constexpr, STAGES: tl.constexpr, PAGES: tl.constexpr):  # fmt: skip
    """One program's ``PAGES`` pages of one item each: the tile's rows are pages, its checksum one word a page."""
    pg = tl.program_id(0).to(tl.int64) * PAGES + tl.arange(0, PAGES)
    live_p = pg < pages
    hp = tl.load((anchor + hidx).to(tl.pointer_type(tl.int64)) + pg, mask=live_p, other=-1)
    live = live_p & (hp >= 0) & (hp < host_pages)
    slots = (anchor + table).to(tl.pointer_type(tl.int64)) + hp * table_columns + column
    if CHECK:
        expected = tl.load(slots, mask=live, other=0)
    r = tl.load((anchor + didx).to(tl.pointer_type(tl.int64)) + pg, mask=live_p, other=-1)
    ok = live_p & (r >= 0) & (r < rows)
    row_off = layer_off + r * row_stride
    if ALIGN > 1:
        row_off = tl.multiple_of(row_off, ALIGN * 4)
    base = (anchor + row_off).to(tl.pointer_type(tl.int32))
    first = tl.zeros((PAGES,), dtype=tl.int32)  # every page's one item is its first: word j is word j of the row
    lanes = tl.arange(0, BLOCK_W)
    sum_w, sum_jw = _sum_rows(base, ok, first, lanes, words, PAGES, BLOCK_W, STAGES)
    total = (tl.sum(sum_w, axis=1) * s + tl.sum(sum_jw, axis=1) * _M2).to(tl.int64, bitcast=True)
    if CHECK:
        settle(anchor, fail_word, fail_pages, slots, hp, expected, total, live, fail_seq)
    else:
        tl.store(slots, total, mask=live)


class ChecksumLaunch:
    """Launches :func:`page_checksums` for one verifier, whose anchor and tiling are fixed.

    Triton's ``kernel[grid](...)`` binds and specialises every argument on each call, host time a
    load's last call pays before its check is queued; after the first launch of each variant (``check``,
    ``seq_step``), the compiled kernel's C launcher is called directly, as hicache's copy kernels are
    (:mod:`hicache_core.gpu.triton_base`), unless a profiler hook watches launches. Under the
    interpreter every launch goes through Triton.

    ``tile``: :func:`hicache_core.verification.page_checksum.tile_shape`, its ``BLOCK_W`` a page's share where a
    program takes several (``pages_per_program``, :func:`~hicache_core.verification.page_checksum.pages_per_program`);
    ``align``: words every device row starts on, 1, 2 or 4; ``stages``: 0 under the interpreter.
    """

    def __init__(self, anchor, tokens: int, groups: int, tile: tuple[int, int, int], align: int, stages: int,
                 device_index: int, pages_per_program: int = 1) -> None:  # fmt: skip
        self._anchor = anchor
        self._anchor_ptr = anchor.data_ptr()
        self._shape = (groups, tokens, tile)
        self._per_program = pages_per_program
        self._align, self._stages = align, stages
        self._cuda = anchor.is_cuda
        self._device_index = device_index
        self._fast: dict[tuple[bool, int], tuple] = {}
        if self._cuda:
            self._get_stream = cuda_current_functions()[1]

    def __call__(self, grid: tuple[int, int], args: tuple[int, ...], check: bool, seq_step: int) -> None:
        """Launch over ``grid`` (pages, entries) on the current stream. ``args``: the runtime arguments after the
        anchor, in :data:`_RUNTIME`'s order up to ``table_columns`` (six byte offsets from the anchor, ``seq``,
        ``host_pages``, ``table_columns``; the pages are the grid's)."""
        fast = self._fast.get((check, seq_step))
        if fast is not None and hooks_idle():
            call, head, constexprs = fast
            per = self._per_program
            call(-(-grid[0] // per), grid[1], 1, self._get_stream(self._device_index), *head, self._anchor_ptr, *args,
                 grid[0], *constexprs)  # fmt: skip
            return
        groups, tokens, tile = self._shape
        compiled = launch(self._anchor, *args, *grid, groups, tokens, tile, check, seq_step, self._align,
                          self._stages, pages_per_program=self._per_program)  # fmt: skip
        if self._cuda and fast is None:
            direct = compiled_launch(compiled)
            if direct is not None:  # the constexprs' values follow the runtime arguments, in the kernel's order
                self._fast[(check, seq_step)] = (*direct, (tokens, groups, *tile, check, seq_step, self._align,
                                                           self._stages, self._per_program))  # fmt: skip


def launch(anchor, entries_off, hidx_off, didx_off, table_off, fail_word_off, fail_pages_off, seq, host_pages,
           table_columns, pages, num_entries, groups, tokens, tile, check, seq_step, align,
           stages, num_warps=None, pages_per_program=1):  # fmt: skip
    """Launch :func:`page_checksums` over ``pages`` (``pages_per_program`` a program) x ``num_entries`` programs through
    Triton (returns what Triton does: the compiled kernel, on CUDA).

    ``tile``: :func:`hicache_core.verification.page_checksum.tile_shape`; ``align``: words every device row starts on,
    1, 2 or 4; ``stages``: 0 under the interpreter; ``num_warps``: default by the tile's size."""
    tile_t, group, block_w = tile
    per = pages_per_program
    return page_checksums[(-(-pages // per), num_entries)](
        anchor, entries_off, hidx_off, didx_off, table_off, fail_word_off, fail_pages_off, seq, host_pages,
        table_columns, pages, TOKENS=tokens, GROUPS=groups, TILE_T=tile_t, GROUP=group, BLOCK_W=block_w, CHECK=check,
        SEQ_STEP=seq_step, ALIGN=align, STAGES=stages, PAGES=per,
        num_warps=num_warps or (8 if tile_t * per * block_w >= 4096 else 4),
    )  # fmt: skip
