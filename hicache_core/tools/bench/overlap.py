"""``hicache bench --overlap``: loading a cached prefix layer by layer while the model computes.

What a server sees in prefill with a cache hit: per layer, the layer's GEMMs run on a
compute stream, the next layers' KV loads run on a transfer stream, and compute waits
on a per-layer event (SGLang's layer-done counter). Reported per implementation:

* compute alone, transfer alone, and the two overlapped (wall time between events);
* the GEMMs' own slowdown: their summed busy time (from the end of each layer's wait
  to the end of its GEMMs) overlapped, against alone;
* efficiency ``max(compute alone, bytes / ceiling) / overlapped``;
* whether the host held compute back: when the first GEMM started, against one
  layer's transfer time, and the host's submission time against the overlapped time.

Per-layer compute is the layer's dense GEMM work, ``2 * N * params_per_layer`` FLOPs for
``N`` new tokens, run as bf16 GEMMs of ``[N, hidden] @ [hidden, 8192]``; attention over
the ``M`` cached tokens runs in attention kernels, not GEMMs, and is left out, so the
regimes are: llama-8b with 2048 new tokens is compute-bound at 8192 cached
tokens and transfer-bound at 32768. DeepSeek-V3's layer is ~3x llama's and its MLA rows
are small, so its transfer-bound case has few new tokens (128).

Also: backing up all layers of 4096 tokens while decode-like steps run (per layer,
``[64, hidden] @ [hidden, 8192]`` GEMMs over as much weight as the layer has).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...loads.layer_loads import layer_loader
from ...plugins.implementation import BACKUP_ALL, LOAD, Implementation

GEMM_WIDTH = 8192


@dataclass(frozen=True)
class ComputeModel:
    """A model's per-layer dense compute, and the hicache shape of its KV cache."""

    name: str
    shape: str
    hidden: int
    params_per_layer: float

    def launches(self, new_tokens: int) -> int:
        """GEMM launches of ``[N, hidden] @ [hidden, GEMM_WIDTH]`` per layer that do the layer's FLOPs."""
        flops = 2 * new_tokens * self.params_per_layer
        return max(1, round(flops / (2 * new_tokens * self.hidden * GEMM_WIDTH)))


MODELS: dict[str, ComputeModel] = {
    # llama-3-8b: attention 4096x(4096+1024+1024+4096) + MLP 3x4096x14336 = 218 M weights per layer.
    "llama-8b": ComputeModel("llama-8b", "llama-8b", 4096, 218.1e6),
    # DeepSeek-V3: MLA projections (~187 M) + 8 routed and 1 shared expert of 3x7168x2048 (~396 M) active.
    "deepseek-v3": ComputeModel("deepseek-v3", "deepseek-mla", 7168, 583e6),
}

#: (model, new tokens N, cached tokens M, regime) of the benchmark.
CASES: tuple[tuple[str, int, int, str], ...] = (
    ("llama-8b", 2048, 8192, "compute-bound"),
    ("llama-8b", 2048, 32768, "transfer-bound"),
    ("deepseek-v3", 2048, 8192, "compute-bound"),
    ("deepseek-v3", 128, 32768, "transfer-bound"),
)


def fill_random_fast(tensors, seed: int = 0) -> None:
    """Random bytes drawn on the GPU and copied in 256 MiB chunks (GBs of pinned host pool in well under a second)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    chunk = 256 << 20
    for t in tensors:
        flat = t.reshape(-1).view(torch.uint8)
        for start in range(0, flat.numel(), chunk):
            part = flat[start : start + chunk]
            part.copy_(torch.randint(0, 256, part.shape, dtype=torch.uint8, device="cuda", generator=gen))


class Streams:
    """The compute and transfer streams and the GEMM operands of one model."""

    def __init__(self, model: ComputeModel, new_tokens: int) -> None:
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.x = torch.randn(new_tokens, model.hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        self.w = torch.randn(model.hidden, GEMM_WIDTH, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.01
        self.out = torch.empty(new_tokens, GEMM_WIDTH, device="cuda", dtype=torch.bfloat16)
        self.launches = model.launches(new_tokens)
        self.flops = 2 * new_tokens * model.hidden * GEMM_WIDTH * self.launches
        self.compute = torch.cuda.Stream()
        self.transfer = torch.cuda.Stream()

    def gemms(self) -> None:
        for _ in range(self.launches):
            torch.matmul(self.x, self.w, out=self.out)


#: How the benchmark issues a prefill's loads: ``sglang`` as SGLang's ``L2TransferEngine`` does
#: (every layer's load submitted on the load stream before the forward is queued, one event per
#: layer that the forward's layer waits on); ``loader``, in the same order, handed to hicache's layer
#: loader (:mod:`hicache_core.loads.layer_loads`: the call returns at once, the forward's layer waits for its
#: layer's submission, then its event), which is what SGLang's adapter does; or ``interleaved`` (each
#: layer's load, then that layer's GEMMs, as this benchmark's first version did: it hides the host's
#: submission time behind the GEMMs).
MODES = ("sglang", "loader", "interleaved")


def prefill_run(streams: Streams, layers: int, load: Callable[[int], None] | None, compute: bool,
                mode: str = "sglang") -> dict:  # fmt: skip
    """One pass over ``layers``: loads on the transfer stream, GEMMs on the compute stream, per-layer events.

    ``host_submit_s`` is the host time of the whole pass; ``load_submit_s`` that of the load calls
    alone (in ``sglang`` mode: the time before the forward's first GEMM can be queued)."""
    if mode not in MODES:
        raise ValueError(f"unknown overlap mode {mode!r}; modes: {', '.join(MODES)}")
    timing = [torch.cuda.Event(enable_timing=True) for _ in range(2 * layers + 2)]
    ready = [torch.cuda.Event() for _ in range(layers)]
    cs, ts = streams.compute, streams.transfer
    torch.cuda.synchronize()
    host0 = time.perf_counter()
    timing[0].record(cs)
    ts.wait_event(timing[0])
    load_s = 0.0

    def issue_load(layer: int) -> None:
        nonlocal load_s
        t0 = time.perf_counter()
        with torch.cuda.stream(ts):
            load(layer)
            ready[layer].record(ts)
        load_s += time.perf_counter() - t0

    submitted = None

    def forward_layer(layer: int) -> None:
        with torch.cuda.stream(cs):
            if submitted is not None:
                submitted.wait(layer, cs)
            elif load is not None:
                cs.wait_event(ready[layer])
            timing[1 + 2 * layer].record(cs)
            streams.gemms()
            timing[2 + 2 * layer].record(cs)

    if mode == "loader":
        if load is not None:
            t0 = time.perf_counter()
            submitted = layer_loader(cs.device).submit(layers, load, start_event=timing[0])
            load_s += time.perf_counter() - t0
        if compute:
            for layer in range(layers):
                forward_layer(layer)
    elif mode == "sglang":
        if load is not None:
            for layer in range(layers):
                issue_load(layer)
        if compute:
            for layer in range(layers):
                forward_layer(layer)
    else:
        for layer in range(layers):
            if load is not None:
                issue_load(layer)
            if compute:
                forward_layer(layer)
    host_submit = time.perf_counter() - host0
    if submitted is not None:
        submitted.finish_event.wait(cs)
    cs.wait_stream(ts)
    timing[-1].record(cs)
    torch.cuda.synchronize()
    total = timing[0].elapsed_time(timing[-1]) / 1e3
    out = {"seconds": total, "host_submit_s": host_submit, "load_submit_s": load_s}
    if compute:
        out["gemm_busy_s"] = sum(timing[1 + 2 * i].elapsed_time(timing[2 + 2 * i]) for i in range(layers)) / 1e3
        out["first_gemm_start_s"] = timing[0].elapsed_time(timing[1]) / 1e3
    return out


def median_run(fn: Callable[[], dict], reps: int) -> dict:
    """The run of median ``seconds`` among ``reps`` runs of ``fn``, after one warm-up."""
    fn()  # warm-up: kernels compiled, pages touched
    runs = [fn() for _ in range(reps)]
    runs.sort(key=lambda r: r["seconds"])
    return runs[len(runs) // 2]


def prefill_overlap(impl: Implementation, streams: Streams, h: torch.Tensor, d: torch.Tensor, layers: int,
                    nbytes: int, ceiling_gbps: float, reps: int = 3,
                    compute_alone: dict | None = None, mode: str = "sglang") -> dict:  # fmt: skip
    """The overlap figures of one implementation (``compute_alone`` may be passed to share it)."""

    def load(layer: int) -> None:
        impl.load_to_device_per_layer(h, d, layer)

    if compute_alone is None:
        compute_alone = median_run(lambda: prefill_run(streams, layers, None, True), reps)
    transfer = median_run(lambda: prefill_run(streams, layers, load, False, mode), reps)
    both = median_run(lambda: prefill_run(streams, layers, load, True, mode), reps)
    ideal = max(compute_alone["seconds"], nbytes / (ceiling_gbps * 1e9))
    per_layer_transfer = transfer["seconds"] / layers
    return {
        "compute_s": compute_alone["seconds"],
        "transfer_s": transfer["seconds"],
        "overlapped_s": both["seconds"],
        "ideal_s": ideal,
        "efficiency": ideal / both["seconds"],
        "gemm_slowdown": both["gemm_busy_s"] / compute_alone["gemm_busy_s"] - 1,
        "transfer_gbps_alone": nbytes / transfer["seconds"] / 1e9,
        "mode": mode,
        "host_submit_s": both["host_submit_s"],
        "load_submit_s": both["load_submit_s"],
        "transfer_host_submit_s": transfer["host_submit_s"],
        "first_gemm_start_s": both["first_gemm_start_s"],
        "one_layer_transfer_s": per_layer_transfer,
        # The first GEMM waits for layer 0's load; waiting much longer means the host was still
        # submitting other layers' copies (82 ms, once, on the H200).
        "host_held_compute": both["first_gemm_start_s"] > 3 * per_layer_transfer + 1e-3,
        "bytes": nbytes,
    }


def decode_backup(impl: Implementation, model: ComputeModel, h: torch.Tensor, d: torch.Tensor, layers: int,
                  nbytes: int, ceiling_gbps: float, steps: int = 4, reps: int = 3) -> dict:  # fmt: skip
    """Back up all layers of ``h``/``d`` once while decode-like steps run beside it."""
    batch = 64
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(batch, model.hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    launches = max(1, round(model.params_per_layer / (model.hidden * GEMM_WIDTH)))
    w = [
        torch.randn(model.hidden, GEMM_WIDTH, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(min(launches, 8))
    ]  # fmt: skip  (several weights, so they are read from HBM, not L2)
    out = torch.empty(batch, GEMM_WIDTH, device="cuda", dtype=torch.bfloat16)
    cs, ts = torch.cuda.Stream(), torch.cuda.Stream()

    def decode() -> None:
        for _ in range(steps):
            for _layer in range(layers):
                for i in range(launches):
                    torch.matmul(x, w[i % len(w)], out=out)

    def run(with_decode: bool, with_backup: bool) -> dict:
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        torch.cuda.synchronize()
        if with_backup:
            with torch.cuda.stream(ts):
                ev[2].record(ts)
                impl.backup_from_device_all_layer(h, d)
                ev[3].record(ts)
        if with_decode:
            with torch.cuda.stream(cs):
                ev[0].record(cs)
                decode()
                ev[1].record(cs)
        torch.cuda.synchronize()
        res = {"seconds": 0.0}
        if with_decode:
            res["decode_s"] = res["seconds"] = ev[0].elapsed_time(ev[1]) / 1e3
        if with_backup:
            res["backup_s"] = ev[2].elapsed_time(ev[3]) / 1e3
            res["seconds"] = max(res["seconds"], res["backup_s"])
        return res

    def med(fn, key):
        fn()
        return statistics.median(fn()[key] for _ in range(reps))

    decode_alone = med(lambda: run(True, False), "decode_s")
    backup_alone = med(lambda: run(False, True), "backup_s")
    together = [run(True, True) for _ in range(reps + 1)][1:]
    decode_with = statistics.median(r["decode_s"] for r in together)
    backup_with = statistics.median(r["backup_s"] for r in together)
    return {
        "decode_alone_s": decode_alone,
        "decode_with_backup_s": decode_with,
        "decode_slowdown": decode_with / decode_alone - 1,
        "backup_alone_s": backup_alone,
        "backup_beside_decode_s": backup_with,
        "backup_fraction_alone": nbytes / backup_alone / 1e9 / ceiling_gbps,
        "backup_fraction_beside_decode": nbytes / backup_with / 1e9 / ceiling_gbps,
        "bytes": nbytes,
        "operation": BACKUP_ALL,
    }


__all__ = [
    "CASES",
    "LOAD",
    "MODELS",
    "MODES",
    "ComputeModel",
    "Streams",
    "decode_backup",
    "fill_random_fast",
    "prefill_overlap",
    "prefill_run",
]
