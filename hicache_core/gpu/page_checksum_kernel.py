"""The page checksum on the device, in Triton (imports triton: only :mod:`hicache_core.verify` imports it, lazily,
for a verifying pool on CUDA).

One program per (page of the call, entry, group of :data:`~hicache_core.page_checksum.GROUP_TOKENS`
items): an entry is one (host layer, component) with its device layer's address, row stride, row
words, seed and column in the checksum table. A program reads its group's rows as 2-D tiles
(``GROUP`` rows by ``BLOCK_W`` words, coalesced along the row): one pass over the page bytes.
``CHECK=False`` stores the sums in the checksum table (backup); ``CHECK=True`` compares them with
it (after a load) and, for a mismatch, stores the call's number in the failure word and in the
page's failure slot (masked stores: a clean check writes nothing).

The definition's sum ``sum(w_j * (s + j * M2))`` is taken as ``s * sum(w_j) + M2 * sum(j * w_j)``
(equal mod 2**64): per word one 32 x 32 -> 64-bit multiply and two adds instead of two 64-bit
multiplies, so the check keeps up with HBM. A check issues its table load (host memory, a round
trip over the link) before it reads the rows, so the two overlap.

Every address is a byte offset from one anchor tensor, as in hicache's transfer kernels, so the
device rows, the pinned table and the failure words (reached through UVA) are addressed alike.
Out-of-range indices are skipped (the transfer that received them reports them).

(No ``from __future__ import annotations`` here: Triton reads annotations.)
"""

import triton
import triton.language as tl

from ..page_checksum import M2

_M2 = tl.constexpr(M2)
#: int64 columns of an entry: device layer offset, row stride (bytes), row words, seed, table column, rows.
ENTRY_COLUMNS = 6
_COLS = tl.constexpr(ENTRY_COLUMNS)


@triton.jit(do_not_specialize=("entries", "hidx", "didx", "seq"))
def page_checksums(
    anchor,
    entries,
    hidx,
    didx,
    table,
    fail_word,
    fail_pages,
    seq,
    host_pages,
    table_columns,
    TOKENS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_W: tl.constexpr,
    CHECK: tl.constexpr,
):
    page = tl.program_id(0).to(tl.int64)
    entry = (anchor + entries).to(tl.pointer_type(tl.int64)) + tl.program_id(1) * _COLS
    group = tl.program_id(2)
    layer_off = tl.load(entry)
    row_stride = tl.load(entry + 1)
    words = tl.load(entry + 2).to(tl.int32)
    s = tl.load(entry + 3)
    column = tl.load(entry + 4)
    rows = tl.load(entry + 5)

    hp = tl.load((anchor + hidx).to(tl.pointer_type(tl.int64)) + page * TOKENS) // TOKENS
    slot = (anchor + table).to(tl.pointer_type(tl.int64)) + hp * table_columns + column + group
    live = (hp >= 0) & (hp < host_pages)
    if CHECK:
        expected = tl.load(slot, mask=live, other=0)
    t = group * GROUP + tl.arange(0, GROUP)  # the items (tokens) of this group, within the page
    live_t = t < TOKENS
    r = tl.load((anchor + didx).to(tl.pointer_type(tl.int64)) + page * TOKENS + t, mask=live_t, other=-1)
    ok_t = live_t & (r >= 0) & (r < rows)
    base = (anchor + layer_off + r * row_stride).to(tl.pointer_type(tl.int32))
    lanes = tl.arange(0, BLOCK_W)
    sum_w = tl.zeros((GROUP, BLOCK_W), dtype=tl.uint64)
    sum_jw = tl.zeros((GROUP, BLOCK_W), dtype=tl.uint64)
    w0 = 0
    while w0 < words:  # a while loop: the interpreter runs it too
        w = w0 + lanes
        mask = ok_t[:, None] & (w < words)[None, :]
        vals = tl.load(base[:, None] + w[None, :], mask=mask, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
        j = (t[:, None] * words + w[None, :]).to(tl.uint32, bitcast=True).to(tl.uint64)  # < 2**31: a page's words
        sum_w += vals
        sum_jw += vals * j  # a 32 x 32 -> 64-bit product: it cannot wrap
        w0 += BLOCK_W
    total_w = tl.sum(tl.sum(sum_w, axis=1), axis=0)
    total_jw = tl.sum(tl.sum(sum_jw, axis=1), axis=0)
    total = (total_w * s.to(tl.uint64, bitcast=True) + total_jw * _M2).to(tl.int64, bitcast=True)

    if CHECK:
        bad = live & (expected != total)
        tl.store((anchor + fail_word).to(tl.pointer_type(tl.int64)), seq, mask=bad)
        tl.store((anchor + fail_pages).to(tl.pointer_type(tl.int64)) + hp, seq, mask=bad)
    else:
        tl.store(slot, total, mask=live)


def launch(anchor, entries_off, hidx_off, didx_off, table_off, fail_word_off, fail_pages_off, seq, host_pages,
           table_columns, pages, num_entries, groups, tokens, group, block_w, check) -> None:  # fmt: skip
    """Launch :func:`page_checksums` over ``pages`` x ``num_entries`` x ``groups`` programs."""
    page_checksums[(pages, num_entries, groups)](
        anchor, entries_off, hidx_off, didx_off, table_off, fail_word_off, fail_pages_off, seq, host_pages,
        table_columns, TOKENS=tokens, GROUP=group, BLOCK_W=block_w, CHECK=check, num_warps=4,
    )  # fmt: skip
