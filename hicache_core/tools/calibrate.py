"""``hicache calibrate``: measure the installed implementations on this GPU and write the profile ``auto`` reads.

For each pool shape, layout, operation and token-count bucket, every auto-selectable
implementation that claims it is measured (kernels at several SM budgets):

* **idle**: median seconds of one call;
* **under compute**: the call repeated (a per-layer operation over every layer, as a
  server loads a prefix) on a transfer stream while bf16 GEMMs sized to last as long
  as the bytes take at the ceiling run on a compute stream; the score is
  ``max(GEMMs alone, bytes / ceiling) / overlapped`` — the overlap benchmark's
  efficiency in its hardest, balanced regime, where both a slow transfer and a slowed
  GEMM cost time.

The choice per bucket is the best score under compute; within 1 % the faster idle
call wins. The profile (:class:`hicache_core.plugins.autoselect.Profile`) goes to the user's
cache directory, keyed by GPU name, driver version and host link, and holds what was
measured beside each choice.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from ..plugins import autoselect
from ..plugins.autoselect import Choice, Profile
from ..plugins.dispatch import reasons_for
from ..plugins.implementation import BACKUP_ALL, BACKUP_LAYER, LOAD, Implementation, TransferRequest
from ..plugins.registry import get_registry
from ..pool.host_pool import make_host_pool
from .bench.machine import measure_ceiling
from .bench.sweep import Timer, storable
from .demo import random_pages
from .shapes import SHAPES

OPS = (LOAD, BACKUP_ALL)
TIE = 0.01


class _Gemm:
    def __init__(self) -> None:
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.x = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
        self.w = torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16, generator=gen)
        self.out = torch.empty(2048, 8192, device="cuda", dtype=torch.bfloat16)
        self.one_s = Timer(warmup=3, min_reps=5, max_reps=10, budget_s=0.2)(self.run_one)

    def run_one(self) -> None:
        torch.matmul(self.x, self.w, out=self.out)


def _call(impl: Implementation, op: str, h, d, layer: int) -> None:
    if op == LOAD:
        impl.load_to_device_per_layer(h, d, layer)
    elif op == BACKUP_LAYER:
        impl.backup_from_device_per_layer(h, d, layer)
    else:
        impl.backup_from_device_all_layer(h, d)


def under_compute(impl: Implementation, op: str, h, d, layers: int, nbytes_one: int, ceiling_gbps: float,
                  gemm: _Gemm, reps: int) -> dict:  # fmt: skip
    """Overlapped efficiency of the operation repeated beside GEMMs as long as its bytes take at the ceiling."""
    calls = layers if op != BACKUP_ALL else 1
    nbytes = nbytes_one * calls
    launches = max(1, round(nbytes / (ceiling_gbps * 1e9) / gemm.one_s))
    cs, ts = torch.cuda.Stream(), torch.cuda.Stream()

    def run(with_copy: bool, with_gemm: bool) -> float:
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        torch.cuda.synchronize()
        ev[0].record(cs)
        ts.wait_event(ev[0])
        if with_copy:
            with torch.cuda.stream(ts):
                for layer in range(calls):
                    _call(impl, op, h, d, layer)
        if with_gemm:
            with torch.cuda.stream(cs):
                for _ in range(launches):
                    gemm.run_one()
        cs.wait_stream(ts)
        ev[1].record(cs)
        torch.cuda.synchronize()
        return ev[0].elapsed_time(ev[1]) / 1e3

    run(True, True)
    gemm_alone = statistics.median(run(False, True) for _ in range(reps))
    both = statistics.median(run(True, True) for _ in range(reps))
    ideal = max(gemm_alone, nbytes / (ceiling_gbps * 1e9))
    return {"overlapped_s": both, "gemm_alone_s": gemm_alone, "ideal_s": ideal, "score": ideal / both}


def run_calibrate(shapes=("llama-8b", "deepseek-mla"), tokens=(64, 512, 4096, 32768), layouts=None,
                  page_size: int = 64, quick: bool = False, out: str | None = None) -> int:  # fmt: skip
    if not torch.cuda.is_available():
        print("hicache calibrate: needs a GPU: it measures this device", file=sys.stderr)
        return 1
    registry = get_registry()
    identity = autoselect.device_identity()
    path = autoselect.profile_path(identity) if out is None else out
    try:
        profile = Profile.load(path)
    except (OSError, ValueError, KeyError):
        profile = Profile(device=identity, entries={})
    profile.device = identity
    ceiling = measure_ceiling(1 << 30)
    gemm = _Gemm()
    budgets = (8, 0) if quick else (2, 8, 0)
    reps = 2 if quick else 3
    timer = Timer(budget_s=0.05 if quick else 0.1)
    gen = torch.Generator().manual_seed(0)
    t_start = time.perf_counter()
    print(f"calibrating {identity['gpu']} (driver {identity['driver']}, link {identity['link']}); "
          f"ceiling H2D {ceiling['h2d_gbps']:.1f} GB/s, D2H {ceiling['d2h_gbps']:.1f} GB/s")  # fmt: skip
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        most = max(tokens)
        dev = shape.device_pool(most + 2 * page_size, page_size=page_size, device="cuda")
        for layout, decl in sorted(registry.layouts.items()):
            if not storable(shape, decl) or (layouts and layout not in layouts):
                continue
            host = make_host_pool(dev, layout=layout, io_backend="reference", size=dev.size, operations=())
            from .bench.overlap import fill_random_fast

            fill_random_fast([t for p in host.plan.parts for t in p.device_layers]
                             + list(host.plan.host_buffers.values()))  # fmt: skip
            geometry = host.geometry
            made: dict[str, Implementation] = {}
            for op in OPS:
                request = TransferRequest("auto", op, geometry, decl, True)
                claimants = [c for c in registry.candidates("auto") if not reasons_for(c, request)]
                if not claimants:
                    continue
                for cls in claimants:
                    if cls.name not in made:
                        made[cls.name] = cls(host.plan)
                for n in tokens:
                    pages = max(1, n // page_size)
                    hp = random_pages(host.page_num + 1, pages, page_size, gen) - page_size
                    dp = random_pages(dev.size // page_size, pages, page_size, gen)
                    if geometry.items_are_pages:
                        hp, dp = hp[::page_size] // page_size, dp[::page_size] // page_size
                    per_call = n * shape.item_bytes() // (page_size if geometry.items_are_pages else 1)
                    nbytes_one = per_call * (host.layer_num if op == BACKUP_ALL else 1)
                    link = ceiling["h2d_gbps"] if op == LOAD else ceiling["d2h_gbps"]
                    measured, best = {}, None
                    for cls in claimants:
                        impl = made[cls.name]
                        where = host.plan.device if impl.index_device == "device" else torch.device("cpu")
                        h, d = hp.to(where), dp.to(where)
                        for budget in budgets if hasattr(impl, "max_ctas") else (None,):
                            if budget is not None:
                                impl.max_ctas = budget
                            label = cls.name + ("" if budget is None else f"@{budget}")
                            try:
                                idle = timer(lambda i=impl, o=op, hh=h, dd=d: _call(i, o, hh, dd, 0))
                                under = under_compute(impl, op, h, d, host.layer_num, nbytes_one, link, gemm, reps)
                            except Exception as exc:  # noqa: BLE001 - a candidate that fails is not chosen
                                measured[label] = {"error": f"{type(exc).__name__}: {exc}"}
                                continue
                            row = {"idle_s": idle, "idle_fraction": nbytes_one / idle / 1e9 / link, **under}
                            measured[label] = row
                            if best is None or _better(row, best[2]):
                                best = (cls.name, budget, row)
                    if best is None:
                        continue
                    name, budget, row = best
                    why = (f"measured: {row['score']:.2f} of ideal beside GEMMs, {row['idle_fraction']:.2f} of the "
                           f"ceiling idle (best of {len(measured)})")  # fmt: skip
                    choice = Choice(name, budget, "profile", why)
                    profile.record(request, autoselect.bucket_of(n), choice, measured)
                    print(f"{shape_name:13} {layout:20} {op:29} {n:6}: {choice.label():34} {why}", flush=True)
            del host, made
            torch.cuda.empty_cache()
            profile.save(path)  # after every layout: a run cut short keeps what it measured
        del dev
        torch.cuda.empty_cache()
    saved = profile.save(path)
    autoselect.forget_profiles()
    print(f"wrote {saved} in {time.perf_counter() - t_start:.0f} s")
    return 0


def _better(row: dict, best: dict) -> bool:
    """Higher score under compute; within ``TIE`` of it, the faster idle call."""
    if row["score"] > best["score"] * (1 + TIE):
        return True
    if row["score"] < best["score"] * (1 - TIE):
        return False
    return row["idle_s"] < best["idle_s"]
