"""A load that checks what it moves, in Triton (imports triton: only :mod:`hicache_core.gpu.checked_load` imports it,
lazily, for a verifying pool whose load implementation takes the check into its copy).

One launch copies one host layer's pages to the device and, in the same pass over the bytes, takes
each page's checksum (:mod:`hicache_core.verification.page_checksum`) and compares it with the checksum table: no
second kernel, no second read of the rows. Work is cut into units of one entry and ``TILE_T`` items of
one page of the call (or, where a page is one item, ``TILE_T`` pages side by side, a checksum word each)
and walked by a persistent grid (its size is the implementation's SM budget). An
entry is one (host layer, component): where its layer starts on each side, the host layout's strides
and the checksum's seed and table column. A tile reads its items' host rows in steps of ``BLOCK_W``
32-bit words of the device row (word ``c`` of a row lives in head ``c // head_words`` on the host),
stores them to the device rows and adds them to the two running sums of the checksum kernel
(:mod:`hicache_core.gpu.page_checksum_kernel`), then compares each group of ``GROUP`` items with the
table. A mismatch stores the call's number in the failure word and in the page's failure slot; a table
word that holds no checksum takes the loaded one.

What keeps the link busy is the host reads in flight: a unit's steps are software-pipelined over
``STAGES`` stages, and where a unit is a single step (``ONE_STEP``: its rows fit the tile) the units
themselves are, as the plain copy kernel pipelines its tiles. Without either, every step waited out a
round trip over PCIe, and a 4096-token MHA load took twice its plain copy's time on an H100
(benchmarks/results/verify-cost-in-copy-unpipelined-h100.json).

Out-of-range indices are skipped and reported through the drop word, as every hicache copy kernel
does (:mod:`hicache_core.pool.drops`). Every address is a count of 32-bit words from one anchor tensor, so
the host pool (through UVA), the device rows, the pinned table and the words are addressed alike.

(No ``from __future__ import annotations`` here: Triton reads annotations.)
"""

import triton
import triton.language as tl

from ..verification.page_checksum import CHECKED_LOAD_FIELDS, M2
from .triton_lang import settle

_M2 = tl.constexpr(M2)
_COLS = tl.constexpr(len(CHECKED_LOAD_FIELDS))

#: Runtime arguments: never specialised on, typed, so one compiled kernel serves every call (direct C launches).
RUNTIME = ("entries", "hidx", "didx", "h_stride", "d_stride", "pages", "seq", "num_entries", "table", "fail_word",
           "fail_pages", "drop", "host_pages", "table_columns")  # fmt: skip


@triton.jit
def _move_and_sum(anchor, host_row, dev_row, ok_t, t, col, words, head_words, head_stride, sum_w, sum_jw,
                  ALIGN: tl.constexpr, ROW_SUMS: tl.constexpr):  # fmt: skip
    """Copy one tile (rows ``t``, words ``col`` of the device row) host -> device, and add it to the sums (per
    word of the tile, or with ``ROW_SUMS`` per row: fewer registers, a reduction a step)."""
    mask = ok_t[:, None] & (col < words)[None, :]
    head = col // head_words
    src = host_row[:, None] + (head * head_stride + (col - head * head_words))[None, :]
    dst = dev_row[:, None] + col[None, :]
    if ALIGN > 1:  # every head and row starts on ALIGN words on both sides: vector accesses
        src = tl.max_contiguous(tl.multiple_of(src, [1, ALIGN]), [1, ALIGN])
        dst = tl.max_contiguous(tl.multiple_of(dst, [1, ALIGN]), [1, ALIGN])
    vals = tl.load(anchor + src, mask=mask, other=0)
    tl.store(anchor + dst, vals, mask=mask)
    wide = vals.to(tl.uint32, bitcast=True).to(tl.uint64)
    j = (t[:, None] * words + col[None, :]).to(tl.uint64)  # >= 0 and < 2**31 in a page
    if ROW_SUMS:
        sum_w, sum_jw = sum_w + tl.sum(wide, axis=1), sum_jw + tl.sum(wide * j, axis=1)
    else:
        sum_w, sum_jw = sum_w + wide, sum_jw + wide * j  # a 32 x 32 -> 64-bit product: it cannot wrap
    return sum_w, sum_jw


@triton.jit
def _unit(anchor, entries, h_ptr, d_ptr, h_stride, d_stride, pages, seq, num_entries, table, fail_word, fail_pages,
          drop, host_pages, table_columns, w, TOKENS: tl.constexpr, GROUPS: tl.constexpr, TILE_T: tl.constexpr,
          GROUP: tl.constexpr, BLOCK_W: tl.constexpr, ALIGN: tl.constexpr, STAGES: tl.constexpr,
          ONE_STEP: tl.constexpr, ROW_SUMS: tl.constexpr):  # fmt: skip
    """Copy and check work unit ``w``: one entry of TILE_T items of a page of the call, or of TILE_T one-item pages."""
    if TOKENS == 1:
        per_page = num_entries
    else:
        tiles = (TOKENS + TILE_T - 1) // TILE_T
        per_page = num_entries * tiles
    lanes = tl.arange(0, BLOCK_W)
    unit = w // per_page
    rest = w - unit * per_page
    if TOKENS == 1:
        e = rest
    else:
        e = rest // tiles
    entry = (anchor + entries).to(tl.pointer_type(tl.int64)) + e * _COLS
    dev_off = tl.load(entry)
    row_stride = tl.load(entry + 1)
    words = tl.load(entry + 2).to(tl.int32)
    s = tl.load(entry + 3).to(tl.uint64, bitcast=True)
    column = tl.load(entry + 4)
    rows = tl.load(entry + 5)
    host_off = tl.load(entry + 6)
    page_stride = tl.load(entry + 7)
    token_stride = tl.load(entry + 8)
    head_stride = tl.load(entry + 9)
    head_words = tl.load(entry + 10).to(tl.int32)
    host_items = tl.load(entry + 11)
    if ALIGN > 1:
        words = tl.multiple_of(words, ALIGN)
        head_words = tl.multiple_of(head_words, ALIGN)

    if TOKENS == 1:
        # Row k of the tile is page unit * TILE_T + k of the call, its only item; its group is its page.
        at = unit * TILE_T + tl.arange(0, TILE_T)
        live_t = at < pages
        h = tl.load(h_ptr + at * h_stride, mask=live_t, other=-1).to(tl.int64)
        live_g = live_t & (h >= 0) & (h < host_items) & (h < host_pages)
        hp = h
        slots = (anchor + table).to(tl.pointer_type(tl.int64)) + hp * table_columns + column
        t = tl.zeros((TILE_T,), dtype=tl.int64)  # the item within its page: word j of a page is word j of the row
    else:
        page = unit
        t0 = (rest - e * tiles) * TILE_T
        first = tl.load(h_ptr + (page * TOKENS) * h_stride).to(tl.int64)
        hp = first // TOKENS  # the page's row of the table: its first item's host page
        live = (first >= 0) & (first < host_items) & (hp < host_pages)
        g = t0 // GROUP + tl.arange(0, TILE_T // GROUP)  # this tile's groups
        live_g = live & (g < GROUPS)
        slots = (anchor + table).to(tl.pointer_type(tl.int64)) + hp * table_columns + column + g
        t = t0 + tl.arange(0, TILE_T)  # the items of this tile, within the page
        live_t = t < TOKENS
        at = page * TOKENS + t
        h = tl.load(h_ptr + at * h_stride, mask=live_t, other=-1).to(tl.int64)
    expected = tl.load(slots, mask=live_g, other=0)  # issued early: the round trip overlaps the copy
    d = tl.load(d_ptr + at * d_stride, mask=live_t, other=-1).to(tl.int64)
    ok_t = live_t & (h >= 0) & (h < host_items) & (d >= 0) & (d < rows)
    dropped = tl.max((live_t & ~ok_t).to(tl.int32), axis=0) > 0
    tl.store((anchor + drop).to(tl.pointer_type(tl.int64)), seq, mask=dropped)
    host_row = host_off + (h // TOKENS) * page_stride + (h % TOKENS) * token_stride
    dev_row = dev_off + d * row_stride
    if ALIGN > 1:
        host_row = tl.multiple_of(host_row, ALIGN)
        dev_row = tl.multiple_of(dev_row, ALIGN)
    if ROW_SUMS:
        sum_w = tl.zeros((TILE_T,), dtype=tl.uint64)
        sum_jw = tl.zeros((TILE_T,), dtype=tl.uint64)
    else:
        sum_w = tl.zeros((TILE_T, BLOCK_W), dtype=tl.uint64)
        sum_jw = tl.zeros((TILE_T, BLOCK_W), dtype=tl.uint64)
    if ONE_STEP:  # the rows fit one step (the units are pipelined instead)
        sum_w, sum_jw = _move_and_sum(anchor, host_row, dev_row, ok_t, t, lanes, words, head_words, head_stride,
                                      sum_w, sum_jw, ALIGN, ROW_SUMS)  # fmt: skip
    elif STAGES > 0:  # compiled: the next steps' host reads are in flight while this one is stored and summed
        for w0 in tl.range(0, words, BLOCK_W, num_stages=STAGES):
            sum_w, sum_jw = _move_and_sum(anchor, host_row, dev_row, ok_t, t, w0 + lanes, words, head_words,
                                          head_stride, sum_w, sum_jw, ALIGN, ROW_SUMS)  # fmt: skip
    else:
        w0 = 0
        while w0 < words:
            sum_w, sum_jw = _move_and_sum(anchor, host_row, dev_row, ok_t, t, w0 + lanes, words, head_words,
                                          head_stride, sum_w, sum_jw, ALIGN, ROW_SUMS)  # fmt: skip
            w0 += BLOCK_W
    if not ROW_SUMS:
        sum_w = tl.sum(sum_w, axis=1)
        sum_jw = tl.sum(sum_jw, axis=1)
    group_w = tl.sum(tl.reshape(sum_w, (TILE_T // GROUP, GROUP)), axis=1)
    group_jw = tl.sum(tl.reshape(sum_jw, (TILE_T // GROUP, GROUP)), axis=1)
    total = (group_w * s + group_jw * _M2).to(tl.int64, bitcast=True)
    settle(anchor, fail_word, fail_pages, slots, hp, expected, total, live_g, seq)


@triton.jit(do_not_specialize=RUNTIME, do_not_specialize_on_alignment=("hidx", "didx"))
def checked_load(
    anchor,
    entries: tl.int64,
    hidx: tl.int64,
    didx: tl.int64,
    h_stride: tl.int64,
    d_stride: tl.int64,
    pages: tl.int64,
    seq: tl.int64,
    num_entries: tl.int64,
    table: tl.int64,
    fail_word: tl.int64,
    fail_pages: tl.int64,
    drop: tl.int64,
    host_pages: tl.int64,
    table_columns: tl.int64,
    TOKENS: tl.constexpr,
    GROUPS: tl.constexpr,
    TILE_T: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ALIGN: tl.constexpr,
    STAGES: tl.constexpr,
    H_WIDE: tl.constexpr,
    D_WIDE: tl.constexpr,
    ONE_STEP: tl.constexpr,
    ROW_SUMS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0).to(tl.int64)
    if TOKENS == 1:  # pages of one item: a unit is TILE_T pages side by side, a row and a checksum word each
        work = ((pages + TILE_T - 1) // TILE_T) * num_entries
    else:  # a unit is TILE_T items of one page
        work = pages * num_entries * ((TOKENS + TILE_T - 1) // TILE_T)
    h_ptr = anchor + hidx  # int32 indices; int64 ones are read through an int64 pointer
    if H_WIDE:
        h_ptr = h_ptr.to(tl.pointer_type(tl.int64))
    d_ptr = anchor + didx
    if D_WIDE:
        d_ptr = d_ptr.to(tl.pointer_type(tl.int64))
    if ONE_STEP and STAGES > 0:
        # A unit is one step (its rows fit the tile): the units are what Triton pipelines, the next ones' index,
        # table and host reads in flight while this one is stored and summed, as the plain copy's tiles.
        for w in tl.range(pid, work, nprog, num_stages=STAGES):
            _unit(anchor, entries, h_ptr, d_ptr, h_stride, d_stride, pages, seq, num_entries, table, fail_word,
                  fail_pages, drop, host_pages, table_columns, w, TOKENS, GROUPS, TILE_T, GROUP, BLOCK_W, ALIGN,
                  STAGES, ONE_STEP, ROW_SUMS)  # fmt: skip
    else:
        w = pid
        while w < work:  # a persistent grid; while loops: the interpreter runs them too
            _unit(anchor, entries, h_ptr, d_ptr, h_stride, d_stride, pages, seq, num_entries, table, fail_word,
                  fail_pages, drop, host_pages, table_columns, w, TOKENS, GROUPS, TILE_T, GROUP, BLOCK_W, ALIGN,
                  STAGES, ONE_STEP, ROW_SUMS)  # fmt: skip
            w += nprog
