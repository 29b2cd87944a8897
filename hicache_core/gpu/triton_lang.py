"""Triton-language helpers shared by hicache's kernels (imports triton: import it only from kernel modules).

Nothing in ``hicache_core`` imports this module; the plugins' kernel modules do, on their
first transfer, so that ``import hicache_core`` (and registering plugins) never imports triton.

(No ``from __future__ import annotations`` here: Triton reads annotations.)
"""

import triton
import triton.language as tl


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
