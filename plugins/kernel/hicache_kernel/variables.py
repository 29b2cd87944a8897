"""hicache-kernel's environment variables: its Triton kernels' knobs (read when an implementation is made)."""

from __future__ import annotations

from hicache_core.settings import Setting, knob

_KNOB = "kernel.triton_uva's knob, read when the implementation is made: "

SETTINGS: list[Setting] = [
    knob("HICACHE_KERNEL_MAX_CTAS", takes="an integer >= 0 (0: one CTA per tile, up to the SM count)",
         doc=_KNOB + "at most this many CTAs per launch (default 8)"),
    knob("HICACHE_KERNEL_NUM_WARPS", takes="a power of two in [1, 32]", doc=_KNOB + "warps per CTA (default 8)"),
    knob("HICACHE_KERNEL_STAGES", takes="0 or an integer in [2, 16]",
         doc=_KNOB + "0 a plain persistent loop, s >= 2 pipelines the host accesses over s stages (default 0)"),
    knob("HICACHE_KERNEL_FAST_LAUNCH", takes="0, 1 or 2",
         doc=_KNOB + "0 Triton's kernel[grid], 1 the compiled launcher, 2 its C function"),
    knob("HICACHE_KERNEL_TILE_WORDS", takes="an integer >= 1 (rounded up to a power of two)",
         doc=_KNOB + "words one CTA moves per loop iteration (default: 32 KB worth)"),
]  # fmt: skip
