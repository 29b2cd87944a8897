"""The one-layer Triton kernels (imported on first use only: importing triton costs time).

Every kernel moves items ``hidx[i] <-> didx[i]`` of one host layer, for up to two parts
of an item (K and V, or the MLA latent and rope halves) in the same loop iteration. Every
address is an ``int64`` element offset from the ``anchor`` pointer (see
:mod:`hicache_core.gpu.uva`). What differs from pool to pool is a ``tl.constexpr``: words per
part, the host page and token strides and the device row stride (in elements), the
elements per word, rows per tile. So each compiled kernel is specialised for one pool
shape, and its address arithmetic is multiplications by constants.

Host row of item ``h``: ``host_base + (h // TPP) * PAGE + (h % TPP) * TOKEN``. The caller
folds a uniform stride (``PAGE == TPP * TOKEN``, or one item per page) into ``TPP = 1``, so
most layouts compile to ``host_base + h * PAGE``.

* :func:`rows_kernel`: a tile is ``ROWS`` whole items. Each part is moved as a
  ``[ROWS, MAIN]`` block of words plus, if the item is not a power of two words, a
  ``[ROWS, TAILPAD]`` block for the rest (e.g. 1152 B = 64 + 8 words), so no lane is spent
  on padding beyond the tail. ``PREFETCH`` 1 loads the next tile's indices before this
  tile's host accesses (the index loads leave the critical path); 2 also issues the next
  tile's data loads before this tile's stores (two tiles in flight per CTA, in registers).
  ``STAGES >= 2`` (with ``PREFETCH == 0``) lets Triton software-pipeline the loop instead:
  the loads of the next ``STAGES - 1`` tiles are asynchronous copies into shared memory.
* :func:`flat_kernel`: a tile is ``BLOCK`` consecutive words of the ``n x TOTAL`` word
  grid (the row and word of a lane come from a division by the constant ``TOTAL``); serves
  items of any size.

``HINTS`` picks host-side cache hints (0 none, 1 ``.cg`` loads / ``.cs`` stores, 2
``evict_first``). Indices outside ``[0, host_items)`` / ``[0, dev_rows)`` are masked
in-kernel: a bad index never produces a memory access, and the call is reported through
the drop word (:mod:`hicache_core.pool.drops`).

Loops are ``while`` loops where ``STAGES == 0``: the same scf loop when compiled, and
Triton's interpreter (CPU tests) cannot turn run-time bounds into a Python range under
NumPy 2.4. The interpreter therefore always runs ``STAGES == 0``; the loop bodies are the
same helpers either way.

(No ``from __future__ import annotations`` here: Triton reads the ``tl.int64`` annotations.)
"""

import triton
import triton.language as tl

from hicache_core.gpu.triton_base import INDEX_PARAMS, VARYING_PARAMS
from hicache_core.gpu.triton_lang import report_dropped

#: Runtime arguments that change from call to call (or pool to pool): never specialised on,
#: so one compiled kernel serves every call with the same key (they are annotated as
#: ``int32``/``int64`` below, so their type never depends on a value either).
PER_CALL = VARYING_PARAMS + ("host_a", "dev_a", "host_b", "dev_b", "dev_rows", "host_items")


@triton.jit
def _host_rows(h, TPP: tl.constexpr, PAGE: tl.constexpr, TOKEN: tl.constexpr):
    # Element offset of item h from item 0 of its layer (h is int64).
    if TPP == 1:
        off = h * PAGE
    else:
        off = (h // TPP) * PAGE + (h % TPP) * TOKEN
    return off


@triton.jit
def _indices(anchor, hidx, didx, h_stride, d_stride, n, seq, drop, t, dev_rows, host_items, ROWS: tl.constexpr):
    """Indices of tile ``t`` (``ROWS`` items), which of them are in range; out-of-range ones are reported."""
    r = t * ROWS + tl.arange(0, ROWS)
    live = r < n
    r64 = r.to(tl.int64)
    h = tl.load(hidx + r64 * h_stride, mask=live, other=-1).to(tl.int64)
    d = tl.load(didx + r64 * d_stride, mask=live, other=-1).to(tl.int64)
    ok = live & (h >= 0) & (h < host_items) & (d >= 0) & (d < dev_rows)
    report_dropped(anchor, drop, seq, live & ~ok)
    return h, d, ok


@triton.jit
def _load_block(anchor, rows, ok, START: tl.constexpr, WORDS: tl.constexpr, PAD: tl.constexpr,
                VEC: tl.constexpr, HOST_SIDE: tl.constexpr, HINTS: tl.constexpr):  # fmt: skip
    cols = tl.arange(0, PAD * VEC)
    ptrs = anchor + (rows[:, None] + START * VEC) + cols[None, :]
    if PAD == WORDS:
        mask = ok[:, None]
    else:
        mask = ok[:, None] & (cols < WORDS * VEC)[None, :]
    if HOST_SIDE and HINTS == 1:
        # Host rows are read once: cache them in L2 only, never in L1.
        vals = tl.load(ptrs, mask=mask, cache_modifier=".cg")
    elif HOST_SIDE and HINTS == 2:
        vals = tl.load(ptrs, mask=mask, eviction_policy="evict_first")
    else:
        vals = tl.load(ptrs, mask=mask)
    return vals


@triton.jit
def _store_block(anchor, rows, ok, vals, START: tl.constexpr, WORDS: tl.constexpr, PAD: tl.constexpr,
                 VEC: tl.constexpr, HOST_SIDE: tl.constexpr, HINTS: tl.constexpr):  # fmt: skip
    cols = tl.arange(0, PAD * VEC)
    ptrs = anchor + (rows[:, None] + START * VEC) + cols[None, :]
    if PAD == WORDS:
        mask = ok[:, None]
    else:
        mask = ok[:, None] & (cols < WORDS * VEC)[None, :]
    if HOST_SIDE and HINTS == 1:
        # Host rows are written once: streaming stores.
        tl.store(ptrs, vals, mask=mask, cache_modifier=".cs")
    elif HOST_SIDE and HINTS == 2:
        tl.store(ptrs, vals, mask=mask, eviction_policy="evict_first")
    else:
        tl.store(ptrs, vals, mask=mask)


@triton.jit
def _gather(anchor, h, d, ok, host_base, dev_base, TO_DEVICE: tl.constexpr, HINTS: tl.constexpr, VEC: tl.constexpr,
            TPP: tl.constexpr, PAGE: tl.constexpr, TOKEN: tl.constexpr, ROW: tl.constexpr, MAIN: tl.constexpr,
            TAIL: tl.constexpr, TAILPAD: tl.constexpr):  # fmt: skip
    """Load one part of a tile; returns (main block, tail block or the main again, destination rows)."""
    host = tl.multiple_of(host_base + _host_rows(h, TPP, PAGE, TOKEN), VEC)
    dev = tl.multiple_of(dev_base + d * ROW, VEC)
    if TO_DEVICE:
        src = host
        dst = dev
    else:
        src = dev
        dst = host
    main = _load_block(anchor, src, ok, 0, MAIN, MAIN, VEC, TO_DEVICE, HINTS)
    if TAIL > 0:
        tail = _load_block(anchor, src, ok, MAIN, TAIL, TAILPAD, VEC, TO_DEVICE, HINTS)
    else:
        tail = main
    return main, tail, dst


@triton.jit
def _scatter(anchor, dst, ok, main, tail, TO_DEVICE: tl.constexpr, HINTS: tl.constexpr, VEC: tl.constexpr,
             MAIN: tl.constexpr, TAIL: tl.constexpr, TAILPAD: tl.constexpr):  # fmt: skip
    _store_block(anchor, dst, ok, main, 0, MAIN, MAIN, VEC, not TO_DEVICE, HINTS)
    if TAIL > 0:
        _store_block(anchor, dst, ok, tail, MAIN, TAIL, TAILPAD, VEC, not TO_DEVICE, HINTS)


@triton.jit
def _rows_tile(anchor, h, d, ok, host_a, dev_a, host_b, dev_b, TO_DEVICE: tl.constexpr, HINTS: tl.constexpr,
               VEC: tl.constexpr, TPP: tl.constexpr, A_PAGE: tl.constexpr, A_TOKEN: tl.constexpr, A_ROW: tl.constexpr,
               A_MAIN: tl.constexpr, A_TAIL: tl.constexpr, A_TAILPAD: tl.constexpr, B_PAGE: tl.constexpr,
               B_TOKEN: tl.constexpr, B_ROW: tl.constexpr, B_MAIN: tl.constexpr, B_TAIL: tl.constexpr,
               B_TAILPAD: tl.constexpr):  # fmt: skip
    """Move both parts of one tile whose indices are loaded: every load, then every store."""
    a0, a1, adst = _gather(anchor, h, d, ok, host_a, dev_a, TO_DEVICE, HINTS, VEC, TPP,
                           A_PAGE, A_TOKEN, A_ROW, A_MAIN, A_TAIL, A_TAILPAD)  # fmt: skip
    if B_MAIN > 0:
        b0, b1, bdst = _gather(anchor, h, d, ok, host_b, dev_b, TO_DEVICE, HINTS, VEC, TPP,
                               B_PAGE, B_TOKEN, B_ROW, B_MAIN, B_TAIL, B_TAILPAD)  # fmt: skip
    _scatter(anchor, adst, ok, a0, a1, TO_DEVICE, HINTS, VEC, A_MAIN, A_TAIL, A_TAILPAD)
    if B_MAIN > 0:
        _scatter(anchor, bdst, ok, b0, b1, TO_DEVICE, HINTS, VEC, B_MAIN, B_TAIL, B_TAILPAD)


@triton.jit(do_not_specialize=PER_CALL, do_not_specialize_on_alignment=INDEX_PARAMS)
def rows_kernel(
    anchor,
    hidx,
    didx,
    h_stride: tl.int64,
    d_stride: tl.int64,
    n: tl.int32,
    seq: tl.int64,
    drop: tl.int64,
    host_a: tl.int64,
    dev_a: tl.int64,
    host_b: tl.int64,
    dev_b: tl.int64,
    dev_rows: tl.int64,
    host_items: tl.int64,
    TO_DEVICE: tl.constexpr,
    HINTS: tl.constexpr,
    VEC: tl.constexpr,
    TPP: tl.constexpr,
    A_PAGE: tl.constexpr,
    A_TOKEN: tl.constexpr,
    A_ROW: tl.constexpr,
    A_MAIN: tl.constexpr,
    A_TAIL: tl.constexpr,
    A_TAILPAD: tl.constexpr,
    B_PAGE: tl.constexpr,
    B_TOKEN: tl.constexpr,
    B_ROW: tl.constexpr,
    B_MAIN: tl.constexpr,
    B_TAIL: tl.constexpr,
    B_TAILPAD: tl.constexpr,
    ROWS: tl.constexpr,
    PREFETCH: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Tiles of ``ROWS`` whole items, both parts per iteration (``B_MAIN == 0``: one part)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tiles = tl.cdiv(n, ROWS)
    t = pid
    if PREFETCH == 2:
        h, d, ok = _indices(anchor, hidx, didx, h_stride, d_stride, n, seq, drop, t, dev_rows, host_items, ROWS)
        a0, a1, adst = _gather(anchor, h, d, ok, host_a, dev_a, TO_DEVICE, HINTS, VEC, TPP,
                               A_PAGE, A_TOKEN, A_ROW, A_MAIN, A_TAIL, A_TAILPAD)  # fmt: skip
        if B_MAIN > 0:
            b0, b1, bdst = _gather(anchor, h, d, ok, host_b, dev_b, TO_DEVICE, HINTS, VEC, TPP,
                                   B_PAGE, B_TOKEN, B_ROW, B_MAIN, B_TAIL, B_TAILPAD)  # fmt: skip
        while t < tiles:
            # Issue the next tile's loads (masked off past the end) before this tile's stores.
            tn = t + nprog
            hn, dn, okn = _indices(anchor, hidx, didx, h_stride, d_stride, n, seq, drop, tn, dev_rows, host_items,
                                   ROWS)  # fmt: skip
            na0, na1, nadst = _gather(anchor, hn, dn, okn, host_a, dev_a, TO_DEVICE, HINTS, VEC, TPP,
                                      A_PAGE, A_TOKEN, A_ROW, A_MAIN, A_TAIL, A_TAILPAD)  # fmt: skip
            if B_MAIN > 0:
                nb0, nb1, nbdst = _gather(anchor, hn, dn, okn, host_b, dev_b, TO_DEVICE, HINTS, VEC, TPP,
                                          B_PAGE, B_TOKEN, B_ROW, B_MAIN, B_TAIL, B_TAILPAD)  # fmt: skip
            _scatter(anchor, adst, ok, a0, a1, TO_DEVICE, HINTS, VEC, A_MAIN, A_TAIL, A_TAILPAD)
            if B_MAIN > 0:
                _scatter(anchor, bdst, ok, b0, b1, TO_DEVICE, HINTS, VEC, B_MAIN, B_TAIL, B_TAILPAD)
                b0 = nb0
                b1 = nb1
                bdst = nbdst
            a0 = na0
            a1 = na1
            adst = nadst
            ok = okn
            t = tn
    elif PREFETCH == 1:
        h, d, ok = _indices(anchor, hidx, didx, h_stride, d_stride, n, seq, drop, t, dev_rows, host_items, ROWS)
        while t < tiles:
            # The next tile's indices (device memory) load while this tile's host accesses are in flight.
            tn = t + nprog
            hn, dn, okn = _indices(anchor, hidx, didx, h_stride, d_stride, n, seq, drop, tn, dev_rows, host_items,
                                   ROWS)  # fmt: skip
            _rows_tile(anchor, h, d, ok, host_a, dev_a, host_b, dev_b, TO_DEVICE, HINTS, VEC, TPP, A_PAGE, A_TOKEN,
                       A_ROW, A_MAIN, A_TAIL, A_TAILPAD, B_PAGE, B_TOKEN, B_ROW, B_MAIN, B_TAIL, B_TAILPAD)  # fmt: skip
            h = hn
            d = dn
            ok = okn
            t = tn
    elif STAGES == 0:
        while t < tiles:
            h, d, ok = _indices(anchor, hidx, didx, h_stride, d_stride, n, seq, drop, t, dev_rows, host_items, ROWS)
            _rows_tile(anchor, h, d, ok, host_a, dev_a, host_b, dev_b, TO_DEVICE, HINTS, VEC, TPP, A_PAGE, A_TOKEN,
                       A_ROW, A_MAIN, A_TAIL, A_TAILPAD, B_PAGE, B_TOKEN, B_ROW, B_MAIN, B_TAIL, B_TAILPAD)  # fmt: skip
            t += nprog
    else:
        for t in tl.range(pid, tiles, nprog, num_stages=STAGES):
            h, d, ok = _indices(anchor, hidx, didx, h_stride, d_stride, n, seq, drop, t, dev_rows, host_items, ROWS)
            _rows_tile(anchor, h, d, ok, host_a, dev_a, host_b, dev_b, TO_DEVICE, HINTS, VEC, TPP, A_PAGE, A_TOKEN,
                       A_ROW, A_MAIN, A_TAIL, A_TAILPAD, B_PAGE, B_TOKEN, B_ROW, B_MAIN, B_TAIL, B_TAILPAD)  # fmt: skip


@triton.jit(do_not_specialize=PER_CALL, do_not_specialize_on_alignment=INDEX_PARAMS)
def flat_kernel(
    anchor,
    hidx,
    didx,
    h_stride: tl.int64,
    d_stride: tl.int64,
    n: tl.int32,
    seq: tl.int64,
    drop: tl.int64,
    host_a: tl.int64,
    dev_a: tl.int64,
    host_b: tl.int64,
    dev_b: tl.int64,
    dev_rows: tl.int64,
    host_items: tl.int64,
    TO_DEVICE: tl.constexpr,
    HINTS: tl.constexpr,
    VEC: tl.constexpr,
    TPP: tl.constexpr,
    A_PAGE: tl.constexpr,
    A_TOKEN: tl.constexpr,
    A_ROW: tl.constexpr,
    A_WORDS: tl.constexpr,
    B_PAGE: tl.constexpr,
    B_TOKEN: tl.constexpr,
    B_ROW: tl.constexpr,
    B_WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Tiles of ``BLOCK`` consecutive words of the ``n x (A_WORDS + B_WORDS)`` grid; any item size."""
    TOTAL: tl.constexpr = A_WORDS + B_WORDS
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tiles = tl.cdiv(n * TOTAL, BLOCK)
    lane = tl.arange(0, VEC)[None, :]
    t = pid
    while t < tiles:
        g = t * BLOCK + tl.arange(0, BLOCK)
        row = g // TOTAL
        word = g - row * TOTAL
        live = row < n
        r64 = row.to(tl.int64)
        h = tl.load(hidx + r64 * h_stride, mask=live, other=-1).to(tl.int64)
        d = tl.load(didx + r64 * d_stride, mask=live, other=-1).to(tl.int64)
        ok = live & (h >= 0) & (h < host_items) & (d >= 0) & (d < dev_rows)
        report_dropped(anchor, drop, seq, live & ~ok)
        w = word.to(tl.int64) * VEC
        if B_WORDS > 0:
            in_a = word < A_WORDS
            host = tl.where(
                in_a,
                host_a + _host_rows(h, TPP, A_PAGE, A_TOKEN) + w,
                host_b + _host_rows(h, TPP, B_PAGE, B_TOKEN) + (w - A_WORDS * VEC),
            )
            dev = tl.where(in_a, dev_a + d * A_ROW + w, dev_b + d * B_ROW + (w - A_WORDS * VEC))
        else:
            host = host_a + _host_rows(h, TPP, A_PAGE, A_TOKEN) + w
            dev = dev_a + d * A_ROW + w
        host = tl.multiple_of(host, VEC)
        dev = tl.multiple_of(dev, VEC)
        mask = tl.broadcast_to(ok[:, None], (BLOCK, VEC))
        host_ptrs = tl.max_contiguous(host[:, None] + lane, [1, VEC])
        dev_ptrs = tl.max_contiguous(dev[:, None] + lane, [1, VEC])
        if TO_DEVICE:
            if HINTS == 1:
                vals = tl.load(anchor + host_ptrs, mask=mask, cache_modifier=".cg")
            elif HINTS == 2:
                vals = tl.load(anchor + host_ptrs, mask=mask, eviction_policy="evict_first")
            else:
                vals = tl.load(anchor + host_ptrs, mask=mask)
            tl.store(anchor + dev_ptrs, vals, mask=mask)
        else:
            vals = tl.load(anchor + dev_ptrs, mask=mask)
            if HINTS == 1:
                tl.store(anchor + host_ptrs, vals, mask=mask, cache_modifier=".cs")
            elif HINTS == 2:
                tl.store(anchor + host_ptrs, vals, mask=mask, eviction_policy="evict_first")
            else:
                tl.store(anchor + host_ptrs, vals, mask=mask)
        t += nprog
