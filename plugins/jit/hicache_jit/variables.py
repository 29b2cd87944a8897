"""hicache-jit's environment variables: its one-layer kernels' knobs (read when an implementation is made)."""

from __future__ import annotations

from hicache_core.settings import Setting, knob

_KNOB = "jit.one_layer's knob, read when the implementation is made: "

SETTINGS: list[Setting] = [
    knob("HICACHE_JIT_VARIANT", takes="a preset name of hicache_jit.one_layer.VARIANTS",
         doc=_KNOB + "the launch preset, applied before the other knobs' variables (default rows)"),
    knob("HICACHE_JIT_MAX_CTAS", takes="an integer >= 0 (0: one CTA per tile, up to the SM count)",
         doc=_KNOB + "at most this many CTAs per launch (default 8)"),
    knob("HICACHE_JIT_NUM_WARPS", takes="a power of two in [1, 32]",
         doc=_KNOB + "warps per CTA (default: the preset's)"),
    knob("HICACHE_JIT_STAGES", takes="0 or an integer in [2, 16]",
         doc=_KNOB + "0 a plain persistent loop, s >= 2 pipelines the host accesses over s stages"),
    knob("HICACHE_JIT_FAST_LAUNCH", takes="0, 1 or 2",
         doc=_KNOB + "0 Triton's kernel[grid], 1 the compiled launcher, 2 its C function"),
    knob("HICACHE_JIT_TILE_BYTES", takes="an integer >= 1", doc=_KNOB + "bytes one CTA moves per loop iteration"),
    knob("HICACHE_JIT_HINTS", takes="none, cg, evict_first (or 0, 1, 2)", doc=_KNOB + "host-side cache hints"),
    knob("HICACHE_JIT_PREFETCH", takes="none, indices, data (or 0, 1, 2)",
         doc=_KNOB + "what the row kernel fetches of the next tile ahead"),
]  # fmt: skip
