"""Where a verified per-layer load's host time goes: each verification step's own time per load, call by call.

Run on the GPU machine::

    python benchmarks/verify_host_time.py --out $OUT/verify-host-time-h200.json [--cases pool:layout:io,...]

A small load's per-layer loop is host-bound (verify_cost.py: 32-61 calls of 10-15 us), so what
verification adds on the host is what it adds to the load. Per case (pools as ``verify_cost.py``
builds them, ``--tokens`` cached tokens), with the GPU kept busy so nothing waits on it: the host
time of each call of one load, first / middle / last (median of ``--repeats`` loads, verified and
not); then the verification steps' inclusive times (``time.perf_counter`` around each, the wrappers'
own cost included: compare steps with each other, not with the plain load); then a cProfile of the
verified loads' first and last calls, the top functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from verify_cost import host_call_us, pool_pair, write_result  # noqa: E402

import hicache_core.verification.check_batch as hc_check_batch  # noqa: E402
import hicache_core.verification.verify as hc_verify  # noqa: E402

#: (module, class or None, function) of each timed step.
STEPS = [
    (hc_verify, "PageVerifier", "check"),
    (hc_check_batch, "CheckBatch", "__init__"),
    (hc_check_batch, "CheckBatch", "add"),
    (hc_check_batch, "CheckBatch", "extend"),
    (hc_check_batch, "CheckBatch", "flush"),
    (hc_verify, "PageVerifier", "_check_layers"),
    (hc_verify, "PageVerifier", "_launch"),
    (hc_verify, None, "at_load_end"),
]
# (Verification's event methods and index move are bound when the pool is made: a wrapper set later is not called.)


def _calls(host, dp, hs, dev, io_backend: str, layers: int, repeats: int) -> list[float]:
    """Median host time of the first, a middle and the last call of a load, and of the whole load, in µs."""
    per = [host_call_us(host, dp, hs, dev, io_backend, layers) for _ in range(repeats)]
    first = statistics.median(p[0] for p in per)
    middle = statistics.median(statistics.median(p[1:-1]) for p in per)
    last = statistics.median(p[-1] for p in per)
    return [first, middle, last, statistics.median(sum(p) for p in per)]


def _timed_steps(host, dp, hs, dev, io_backend: str, layers: int, repeats: int) -> dict:
    """Per step: calls per load and inclusive µs per load (median over loads)."""
    spent: dict[str, list[float]] = {}
    originals = []
    for module, cls, name in STEPS:
        owner = getattr(module, cls) if cls else module
        fn = getattr(owner, name)
        key = f"{cls}.{name}" if cls else name
        spent[key] = []

        @functools.wraps(fn)
        def timed(*a, _fn=fn, _key=key, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                spent[_key].append((time.perf_counter() - t0) * 1e6)

        originals.append((owner, name, fn))
        setattr(owner, name, timed)
    per_load: dict[str, list[tuple[int, float]]] = {k: [] for k in spent}
    try:
        for _ in range(repeats):
            for v in spent.values():
                v.clear()
            host_call_us(host, dp, hs, dev, io_backend, layers)
            for k, v in spent.items():
                per_load[k].append((len(v), sum(v)))
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    return {k: {"calls": statistics.median(c for c, _ in v), "us": statistics.median(s for _, s in v)}
            for k, v in per_load.items() if any(c for c, _ in v)}  # fmt: skip


def _profile(host, dp, hs, dev, io_backend: str, layers: int, repeats: int) -> dict:
    """cProfile of the first and of the last call of ``repeats`` loads: the top 25 functions by own time."""
    out = {}
    for which, layer_of in (("first", 0), ("last", layers - 1)):
        prof = cProfile.Profile()
        for _ in range(repeats):
            torch.cuda._sleep(20_000_000)  # the GPU stays busy: the calls measure submission only
            for layer in range(layers):
                if layer == layer_of:
                    prof.enable()
                host.load_to_device_per_layer(dp, hs, dev, layer, io_backend)
                if layer == layer_of:
                    prof.disable()
            torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        out[which] = text.getvalue().splitlines()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="kv_scale_pages:page_first:kernel,page_rows:layer_first:direct,"
                    "mha_k_only:page_first_direct:direct,mha:page_first:kernel")  # fmt: skip
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    rows = []
    for case in args.cases.split(","):
        kind, layout, io_backend = case.split(":")
        dp, pools = pool_pair(kind, layout, io_backend, args.tokens, 64)
        layers = dp.layer_num
        row: dict = {"pool": kind, "layout": layout, "io_backend": io_backend, "tokens": args.tokens, "layers": layers}
        for verify, (host, hs, dev) in pools.items():
            tag = "verified" if verify else "plain"
            _calls(host, dp, hs, dev, io_backend, layers, 5)  # warm-up
            row[f"first_middle_last_total_us_{tag}"] = _calls(host, dp, hs, dev, io_backend, layers, args.repeats)
            if verify:
                row["steps"] = _timed_steps(host, dp, hs, dev, io_backend, layers, args.repeats)
                row["profile"] = _profile(host, dp, hs, dev, io_backend, layers, min(args.repeats, 20))
            host.check_verified() if verify else None
            host.destroy()
        rows.append(row)
        p, v = row["first_middle_last_total_us_plain"], row["first_middle_last_total_us_verified"]
        print(f"{kind} {layout} {io_backend}: first/middle/last/total us {p[0]:.0f}/{p[1]:.0f}/{p[2]:.0f}/{p[3]:.0f}"
              f" -> {v[0]:.0f}/{v[1]:.0f}/{v[2]:.0f}/{v[3]:.0f}", flush=True)  # fmt: skip
        for k, s in row["steps"].items():
            print(f"    {k:32} {s['calls']:5.0f} calls {s['us']:8.1f} us a load")
        write_result(args.out, "verification's host time in a per-layer load, step by step", rows, quiet=True)
    write_result(args.out, "verification's host time in a per-layer load, step by step", rows)


if __name__ == "__main__":
    main()
