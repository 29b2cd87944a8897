"""Triton-language helpers shared by hicache's kernels (imports triton: import it only from kernel modules).

Only kernel modules import this module: the plugins' on their first transfer, the core's verification kernels
when a verifying pool first checks, so that ``import hicache_core`` (and registering plugins) never imports
triton.

(No ``from __future__ import annotations`` here: Triton reads annotations.)
"""

import triton
import triton.language as tl

from ..verification.page_checksum import NO_CHECKSUM

_NO_CHECKSUM = tl.constexpr(NO_CHECKSUM)


@triton.jit
def word_pointer(anchor, offset):
    """An ``int64`` pointer ``offset`` anchor elements past ``anchor`` (the drop word, a layer table)."""
    return (anchor + offset).to(tl.pointer_type(tl.int64))


@triton.jit
def report_dropped(anchor, drop, seq, bad):
    """Store ``seq`` in the drop word for each masked lane of ``bad`` (see :mod:`hicache_core.pool.drops`).

    A predicated store: where no lane is masked, nothing is written and nothing crosses the
    link. Every lane that stores writes the same value to the same word, so no ordering matters.
    ``bad`` may be a block or a scalar.
    """
    ptr = word_pointer(anchor, drop) + tl.zeros_like(bad.to(tl.int32))
    tl.store(ptr, seq + tl.zeros_like(bad.to(tl.int64)), mask=bad)


@triton.jit
def table_row(anchor, table, row, COLUMNS: tl.constexpr):
    """Pointer to row ``row`` of an ``int64`` table ``table`` anchor elements past ``anchor``."""
    return word_pointer(anchor, table) + row * COLUMNS


@triton.jit
def settle(anchor, fail_word, fail_pages, slots, hp, expected, total, live, seq):
    """Compare checksum words ``total`` with the table's (``expected``, read from ``slots``) where ``live``: a
    mismatch stores ``seq`` in the failure word and in its host page's (``hp``) failure slot; a table word that
    holds no checksum takes the loaded one. Masked stores: a clean check writes nothing but those words."""
    unset = expected == _NO_CHECKSUM
    bad = live & ~unset & (expected != total)
    tl.store((anchor + fail_word).to(tl.pointer_type(tl.int64)), seq, mask=tl.max(bad.to(tl.int32), axis=0) > 0)
    zero = tl.zeros_like(total)
    tl.store((anchor + fail_pages).to(tl.pointer_type(tl.int64)) + hp + zero, seq + zero, mask=bad)
    tl.store(slots, total, mask=live & unset)
