"""hicache-direct's environment variables: its copy engine's knobs, a retired switch, and a bench switch."""

from __future__ import annotations

from hicache_core.settings import Setting, flag, knob

_KNOB = "the direct copier's knob, read when a CUDA copier is made: "


def _retired(text: str) -> str:
    if text != "0":
        raise ValueError(text)
    return text


#: Retired in hicache-direct 0.3.0 with the worker it switched on (a side stream gated by stream memory
#: operations, which could deadlock); a set value is refused rather than ignored.
RETIRED_THREAD = Setting(
    "HICACHE_DIRECT_THREAD", _retired,
    "0 or unset: the direct plugin's worker thread was retired in hicache-direct 0.3.0 (its stream memory "
    "operations could deadlock); layer-wise loads go off the caller's thread through HostPool.submit_load "
    "(hicache_core.loads.layer_loads), which SGLang's adapter uses by default; unset the variable",
    None, "retired in hicache-direct 0.3.0: any value but 0 is refused",
)  # fmt: skip
#: scripts/gpu/direct-check.sh turns it on once its byte-exact check of the 3-D batch path passed.
BENCH_BATCH_2D = flag(
    "HICACHE_BENCH_BATCH_2D",
    doc="1 adds the batch_2d variant (one cudaMemcpy3DBatchAsync) to the direct copier's bench sweep",
)

SETTINGS: list[Setting] = [
    knob("HICACHE_DIRECT_BATCH", takes="1 or 0",
         doc=_KNOB + "use cudaMemcpyBatchAsync where the runtime has it (default 1)"),
    knob("HICACHE_DIRECT_MAX_BATCH", takes="an integer >= 0 (0: no limit)",
         doc=_KNOB + "at most this many copies per batch call (default 32)"),
    knob("HICACHE_DIRECT_FIRST_BATCH", takes="an integer >= 0 (0: as max_batch)",
         doc=_KNOB + "the size of an operation's first batch call (default 0)"),
    knob("HICACHE_DIRECT_STREAMS", takes="an integer >= 1",
         doc=_KNOB + "streams one operation's copies spread over (default 1)"),
    knob("HICACHE_DIRECT_PREFER_OVERLAP", takes="1 or 0",
         doc=_KNOB + "ask the driver to keep the copies on the copy engine, beside compute (default 1)"),
    knob("HICACHE_DIRECT_BATCH_2D", takes="1 or 0",
         doc=_KNOB + "2-D copies as one cudaMemcpy3DBatchAsync (default 0, off until measured on a GPU)"),
    RETIRED_THREAD,
    BENCH_BATCH_2D,
]  # fmt: skip
