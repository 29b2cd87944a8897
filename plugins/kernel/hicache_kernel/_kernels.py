"""The Triton kernel family (imported on first use only: importing triton costs time).

One kernel moves up to two parts of a plan (K and V, the MLA latent and rope halves)
for a range of host layers, in either direction. Every address is an ``int64`` element
offset from the ``anchor`` pointer (see :mod:`hicache_core.gpu.uva`): the host side from
the layer table plus page/token/head strides, the device side from the table plus
row/head strides. Work is cut into tiles of ``BLOCK`` words of one (layer, part); a
persistent grid walks the tiles with a stride of the grid size, so the CTA count is a
free budget, not a function of the transfer size.

With ``STAGES >= 2`` the tiles of each part are walked by a ``tl.range`` loop that
Triton software-pipelines: the loads of the next ``STAGES - 1`` tiles are issued as
asynchronous copies into shared memory before this tile's stores, so each CTA keeps
several tiles of host reads in flight without holding them in registers.

Indices outside the pool are masked (no memory outside the pools is touched) and
reported through the drop word (:mod:`hicache_core.pool.drops`).

(No ``from __future__ import annotations`` here: Triton reads the ``tl.int64`` annotations.)
"""

import triton
import triton.language as tl

from hicache_core.gpu import uva
from hicache_core.gpu.triton_base import INDEX_PARAMS, VARYING_PARAMS
from hicache_core.gpu.triton_lang import report_dropped, table_row

# Triton kernels may read module globals only when they are constexpr.
_COLUMNS = tl.constexpr(uva.TABLE_COLUMNS)
_HOST = tl.constexpr(uva.TABLE_HOST)
_DEVICE = tl.constexpr(uva.TABLE_DEVICE)
_DEVICE_ROWS = tl.constexpr(uva.TABLE_DEVICE_ROWS)
_HOST_ITEMS = tl.constexpr(uva.TABLE_HOST_ITEMS)

# Per-call arguments and addresses must not enter the specialisation key, so one compiled kernel
# serves every call of a pool and the launch path can reuse it without Triton re-binding the arguments.
PER_CALL = VARYING_PARAMS + ("table", "layer0", "num_layers")


@triton.jit
def _move_tile(
    anchor,
    table,
    hidx,
    didx,
    h_stride,
    d_stride,
    n,
    seq,
    drop,
    layer,
    tile,
    page_stride,
    token_stride,
    head_stride,
    row_stride,
    dev_head_stride,
    SLOT: tl.constexpr,
    SLOTS: tl.constexpr,
    TO_DEVICE: tl.constexpr,
    TOKENS_PER_PAGE: tl.constexpr,
    HEADS: tl.constexpr,
    WORDS: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Word g of this (layer, part): piece g // WORDS (item, head), word g % WORDS of it.
    g = tile * BLOCK + tl.arange(0, BLOCK)
    live = g < n * (HEADS * WORDS)
    piece = g // WORDS
    word = g - piece * WORDS
    item = piece // HEADS
    head = (piece - item * HEADS).to(tl.int64)
    h = tl.load(hidx + item.to(tl.int64) * h_stride, mask=live, other=-1).to(tl.int64)
    d = tl.load(didx + item.to(tl.int64) * d_stride, mask=live, other=-1).to(tl.int64)

    entry = table_row(anchor, table, layer * SLOTS + SLOT, _COLUMNS)
    host_base = tl.load(entry + _HOST)
    dev_base = tl.load(entry + _DEVICE)
    dev_rows = tl.load(entry + _DEVICE_ROWS)
    host_items = tl.load(entry + _HOST_ITEMS)
    # Out-of-range indices are skipped, so a bad index never reaches memory outside the pool; the
    # call is reported as having dropped items.
    ok = live & (h >= 0) & (h < host_items) & (d >= 0) & (d < dev_rows)
    report_dropped(anchor, drop, seq, live & ~ok)

    inner = word.to(tl.int64) * VEC
    host = (
        host_base
        + (h // TOKENS_PER_PAGE) * page_stride
        + (h % TOKENS_PER_PAGE) * token_stride
        + head * head_stride
        + inner
    )
    dev = dev_base + d * row_stride + head * dev_head_stride + inner
    # Every base, stride and size is a multiple of the word (the word size was chosen so), which
    # lets the compiler emit one VEC-element (up to 16-byte) access per lane.
    host = tl.multiple_of(host, VEC)
    dev = tl.multiple_of(dev, VEC)
    lane = tl.arange(0, VEC)[None, :]
    mask = tl.broadcast_to(ok[:, None], (BLOCK, VEC))
    if TO_DEVICE:
        src = host[:, None] + lane
        dst = dev[:, None] + lane
    else:
        src = dev[:, None] + lane
        dst = host[:, None] + lane
    src = tl.max_contiguous(src, [1, VEC])
    dst = tl.max_contiguous(dst, [1, VEC])
    vals = tl.load(anchor + src, mask=mask)
    tl.store(anchor + dst, vals, mask=mask)


@triton.jit
def _pipelined_part(anchor, table, hidx, didx, h_stride, d_stride, n, seq, drop, layer0, num_layers,
                    page_stride, token_stride, head_stride, row_stride, dev_head_stride,
                    SLOT: tl.constexpr, SLOTS: tl.constexpr, TO_DEVICE: tl.constexpr, TOKENS_PER_PAGE: tl.constexpr,
                    HEADS: tl.constexpr, WORDS: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr,
                    STAGES: tl.constexpr):  # fmt: skip
    """Every tile of one part over the layers, in a loop Triton software-pipelines over ``STAGES`` stages."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tiles = tl.cdiv(n * (HEADS * WORDS), BLOCK)
    for t in tl.range(pid, tiles * num_layers, nprog, num_stages=STAGES):
        rel = t // tiles
        _move_tile(
            anchor, table, hidx, didx, h_stride, d_stride, n, seq, drop, layer0 + rel, t - rel * tiles,
            page_stride, token_stride, head_stride, row_stride, dev_head_stride,
            SLOT, SLOTS, TO_DEVICE, TOKENS_PER_PAGE, HEADS, WORDS, VEC, BLOCK,
        )  # fmt: skip


@triton.jit(do_not_specialize=PER_CALL, do_not_specialize_on_alignment=INDEX_PARAMS)
def uva_copy(
    anchor,
    hidx,
    didx,
    h_stride: tl.int64,
    d_stride: tl.int64,
    n: tl.int32,
    seq: tl.int64,
    drop: tl.int64,
    table: tl.int64,
    layer0: tl.int32,
    num_layers: tl.int32,
    a_page,
    a_token,
    a_head,
    a_row,
    a_dhead,
    b_page,
    b_token,
    b_head,
    b_row,
    b_dhead,
    TO_DEVICE: tl.constexpr,
    TOKENS_PER_PAGE: tl.constexpr,
    A_HEADS: tl.constexpr,
    A_WORDS: tl.constexpr,
    B_HEADS: tl.constexpr,
    B_WORDS: tl.constexpr,
    SLOTS: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Move items ``hidx[i] <-> didx[i]`` of part A (and B if ``SLOTS == 2``) for layers ``layer0 ..+num_layers``."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tiles_a = tl.cdiv(n * (A_HEADS * A_WORDS), BLOCK)
    if STAGES == 0:
        if SLOTS == 2:
            per_layer = tiles_a + tl.cdiv(n * (B_HEADS * B_WORDS), BLOCK)
        else:
            per_layer = tiles_a
        total = per_layer * num_layers
        # A while loop rather than range(pid, total, nprog): same scf loop when compiled, and the
        # interpreter (CPU tests) cannot turn runtime bounds into Python ints under NumPy 2.4.
        t = pid
        while t < total:
            rel = t // per_layer
            r = t - rel * per_layer
            layer = layer0 + rel
            if SLOTS == 2:
                if r < tiles_a:
                    _move_tile(
                        anchor, table, hidx, didx, h_stride, d_stride, n, seq, drop, layer, r,
                        a_page, a_token, a_head, a_row, a_dhead,
                        0, SLOTS, TO_DEVICE, TOKENS_PER_PAGE, A_HEADS, A_WORDS, VEC, BLOCK,
                    )  # fmt: skip
                else:
                    _move_tile(
                        anchor, table, hidx, didx, h_stride, d_stride, n, seq, drop, layer, r - tiles_a,
                        b_page, b_token, b_head, b_row, b_dhead,
                        1, SLOTS, TO_DEVICE, TOKENS_PER_PAGE, B_HEADS, B_WORDS, VEC, BLOCK,
                    )  # fmt: skip
            else:
                _move_tile(
                    anchor, table, hidx, didx, h_stride, d_stride, n, seq, drop, layer, r,
                    a_page, a_token, a_head, a_row, a_dhead,
                    0, SLOTS, TO_DEVICE, TOKENS_PER_PAGE, A_HEADS, A_WORDS, VEC, BLOCK,
                )  # fmt: skip
            t += nprog
    else:
        # Software-pipelined: one branch-free loop per part (Triton pipelines loads only outside
        # conditionals), so the next tiles' host reads are in flight while this tile stores.
        _pipelined_part(
            anchor, table, hidx, didx, h_stride, d_stride, n, seq, drop, layer0, num_layers,
            a_page, a_token, a_head, a_row, a_dhead,
            0, SLOTS, TO_DEVICE, TOKENS_PER_PAGE, A_HEADS, A_WORDS, VEC, BLOCK, STAGES,
        )  # fmt: skip
        if SLOTS == 2:
            _pipelined_part(
                anchor, table, hidx, didx, h_stride, d_stride, n, seq, drop, layer0, num_layers,
                b_page, b_token, b_head, b_row, b_dhead,
                1, SLOTS, TO_DEVICE, TOKENS_PER_PAGE, B_HEADS, B_WORDS, VEC, BLOCK, STAGES,
            )  # fmt: skip
