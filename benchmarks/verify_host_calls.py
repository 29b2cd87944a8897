"""Where a verified per-layer load's host time goes: each call of a load timed on its own, and a profile.

Run on the GPU machine::

    python benchmarks/verify_host_calls.py --out $OUT/verify-host-calls-h200.json [--cases mla:page_first_direct:direct]

Per case (pool:layout:io), at ``--tokens``: ``--loads`` per-layer loads by the unverified pool and as many by
the verifying one, interleaved, each with the GPU kept busy (submission only), every call timed with
``time.perf_counter``. Reported per pool: the median over the loads of the first call, of the middle calls'
median, of the last call, and of the load's total; then ``--profile`` loads of each pool under cProfile,
with the functions taking the most of their own time (cProfile slows every call alike, so the shares
matter, not the times); and a breakdown: µs per load spent in the verifier's steps (wrapped with timers),
with the GPU kept busy and with it idle.
"""

from __future__ import annotations

import argparse
import cProfile
import io as _io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from verify_cost import host_call_us, pool_pair, write_result  # noqa: E402


def _profile(host, dp, hs, dev, io: str, layers: int, loads: int, top: int) -> list[str]:
    prof = cProfile.Profile()
    for _ in range(loads):
        torch.cuda._sleep(50_000_000)
        prof.enable()
        for layer in range(layers):
            host.load_to_device_per_layer(dp, hs, dev, layer, io)
        prof.disable()
        torch.cuda.synchronize()
    out = _io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats("verify|checksum|triton", top)
    return out.getvalue().splitlines()


#: What the breakdown times: (module, owner, attribute). Each is wrapped with a timer for the breakdown's loads.
_TIMED = [
    ("hicache_core.verification.check_batch", "CheckBatch", "flush"),
    ("hicache_core.verification.check_batch", "CheckBatch", "add"),
    ("hicache_core.verification.check_batch", "CheckBatch", "extend"),
    ("hicache_core.verification.verify", "PageVerifier", "_check_layers"),
    ("hicache_core.verification.verify", "PageVerifier", "_launch"),
    ("hicache_core.verification.verify", "PageVerifier", "check"),
    ("hicache_core.verification.check_batch", "CheckBatch", "__init__"),
    ("hicache_core.gpu.page_checksum_kernel", "ChecksumLaunch", "__call__"),
]


def _breakdown(host, dp, hs, dev, io: str, layers: int, loads: int, sleep: bool) -> dict[str, float]:
    """Mean µs per load spent in each of ``_TIMED`` (nested times overlap), over ``loads`` loads; for what runs once
    per layer call, also its first, middle (median) and last call's µs (medians over the loads)."""
    import importlib

    spent: dict[str, list[float]] = {}
    saved = []
    for module, owner, attr in _TIMED:
        obj = importlib.import_module(module)
        obj = getattr(obj, owner) if owner else obj
        fn = getattr(obj, attr)
        name = f"{owner or module.rsplit('.', 1)[-1]}.{attr}"
        spent[name] = []

        def timed(*a, _fn=fn, _times=spent[name], **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                _times.append(time.perf_counter() - t0)

        saved.append((obj, attr, fn))
        setattr(obj, attr, timed)
    spent["load"] = []
    try:
        for _ in range(loads):
            if sleep:
                torch.cuda._sleep(50_000_000)
            t0 = time.perf_counter()
            for layer in range(layers):
                host.load_to_device_per_layer(dp, hs, dev, layer, io)
            spent["load"].append(time.perf_counter() - t0)
            torch.cuda.synchronize()
    finally:
        for obj, attr, fn in saved:
            setattr(obj, attr, fn)
    out = {name: sum(times) * 1e6 / loads for name, times in spent.items()}
    for name, times in spent.items():
        if len(times) == layers * loads and name != "load":
            per = [times[i * layers : (i + 1) * layers] for i in range(loads)]
            out[f"{name} first"] = statistics.median(p[0] for p in per) * 1e6
            out[f"{name} middle"] = statistics.median(statistics.median(p[1:-1]) for p in per) * 1e6
            out[f"{name} last"] = statistics.median(p[-1] for p in per) * 1e6
    return out


def _case(kind: str, layout: str, io: str, tokens: int, page: int, loads: int, profile: int, top: int) -> dict:
    dp, pair = pool_pair(kind, layout, io, tokens, page)
    layers = dp.layer_num
    pools = {"verified" if verify else "plain": made for verify, made in pair.items()}
    for host, hs, dev in pools.values():  # warm-up
        for _ in range(3):
            host_call_us(host, dp, hs, dev, io, layers)
    calls: dict[str, list[list[float]]] = {tag: [] for tag in pools}
    for r in range(loads):
        for tag in list(pools) if r % 2 == 0 else list(pools)[::-1]:
            host, hs, dev = pools[tag]
            calls[tag].append(host_call_us(host, dp, hs, dev, io, layers))
    row = {"pool": kind, "layout": layout, "io_backend": io, "tokens": tokens, "layers": layers, "loads": loads}
    for tag, runs in calls.items():
        row[f"first_us_{tag}"] = statistics.median(us[0] for us in runs)
        row[f"middle_us_{tag}"] = statistics.median(statistics.median(us[1:-1]) for us in runs)
        row[f"last_us_{tag}"] = statistics.median(us[-1] for us in runs)
        row[f"total_us_{tag}"] = statistics.median(sum(us) for us in runs)
    for tag, (host, hs, dev) in pools.items():
        row[f"breakdown_us_busy_gpu_{tag}"] = _breakdown(host, dp, hs, dev, io, layers, loads, True)
        row[f"breakdown_us_idle_gpu_{tag}"] = _breakdown(host, dp, hs, dev, io, layers, loads, False)
        row[f"profile_{tag}"] = _profile(host, dp, hs, dev, io, layers, profile, top)
        host.check_verified()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--loads", type=int, default=40)
    ap.add_argument("--profile", type=int, default=20, help="loads per pool under cProfile")
    ap.add_argument("--top", type=int, default=25, help="functions listed per profile")
    ap.add_argument("--cases", default="mla:page_first_direct:direct", help="pool:layout:io, comma-separated")
    args = ap.parse_args()
    rows = []
    for case in args.cases.split(","):
        kind, layout, io = case.split(":")
        row = _case(kind, layout, io, args.tokens, args.page, args.loads, args.profile, args.top)
        rows.append(row)
        print(f"{kind} {layout} {io} {args.tokens}: " + ", ".join(
            f"{tag} first {row[f'first_us_{tag}']:.0f} middle {row[f'middle_us_{tag}']:.1f} "
            f"last {row[f'last_us_{tag}']:.0f} total {row[f'total_us_{tag}']:.0f} us"
            for tag in ("plain", "verified")), flush=True)  # fmt: skip
        for key in ("breakdown_us_busy_gpu_verified", "breakdown_us_idle_gpu_verified"):
            print(f"  {key}: " + ", ".join(f"{k} {v:.0f}" for k, v in row[key].items()), flush=True)
    write_result(args.out, "host time of each per-layer load call, unverified and verified", rows)


if __name__ == "__main__":
    main()
