"""A plain streaming copy through UVA, the most an SM-driven copy of contiguous bytes reaches (imports triton).

Used only by ``hicache bench`` (:mod:`hicache_core.tools.bench.ceilings`) to measure the ceiling of
copies made by GPU threads rather than by the copy engine: no indices, no per-item address
arithmetic, every load independent. Offsets are in ``int64`` words from an anchor tensor, as
in hicache's kernels, so host and device buffers are reached alike.

(No ``from __future__ import annotations`` here: Triton reads annotations.)
"""

import triton
import triton.language as tl


@triton.jit
def stream_copy(anchor, src, dst, n, BLOCK: tl.constexpr):
    """Copy words ``[0, n)`` from ``anchor + src`` to ``anchor + dst`` (``n`` a multiple of ``BLOCK``)."""
    offs = tl.arange(0, BLOCK)
    start = tl.program_id(0) * BLOCK
    step = tl.num_programs(0) * BLOCK
    while start < n:  # a while loop: the interpreter runs it too (a range over program ids it cannot)
        words = tl.load(anchor + src + start + offs, cache_modifier=".cg")
        tl.store(anchor + dst + start + offs, words)
        start += step
