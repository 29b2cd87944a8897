"""Where a verified per-layer load's extra time comes from: the same load with parts of verification taken away.

Run on the GPU machine::

    python benchmarks/verify_ablate.py --out $OUT/verify-ablate-h200.json [--tokens 4096] [--cases ...]

Per case (``pool:layout:io``, as ``verify_cost.py`` builds them, backed up), one synchronous per-layer load of
every layer, timed with CUDA events (median of ``--repeats``, the variants interleaved, their order alternating):

* ``plain``: the unverified pool;
* ``verified``: the verifying pool, as it serves;
* ``observer_off``: the verifying pool with its verification detached for the load (its own host memory, nothing
  of verification runs): what the two pools' memory alone makes of the difference;
* ``no_launch``: the verifying pool noting every layer, the one check of the load not launched (its noting,
  its first call's index move, no kernel);
* ``before_call_only`` / ``after_load_only``: verification hears only that event of each call (no launch).

Also the host time of each variant's load (``time.perf_counter``, the GPU kept busy: submission alone).

``verified - no_launch`` is the check's share; ``no_launch - observer_off`` the noting's; ``observer_off -
plain`` the memory's. The check's pages are all clean (``check_verified`` at the end).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from verify_cost import items_and_page, pool_pair, write_result  # noqa: E402

VARIANTS = ("plain", "verified", "observer_off", "no_launch", "before_call_only", "after_load_only")


def _case(kind: str, layout: str, io: str, tokens: int, page: int, repeats: int) -> dict:
    items, page = items_and_page(kind, tokens, page)
    dp, pools = pool_pair(kind, layout, io, tokens, page)
    layers = dp.layer_num
    plain, verified = pools[False], pools[True]
    host_v = verified[0]
    verification = host_v.verification
    verifier = host_v.verifier

    def no_check(hidx, didx, layers_, seqs, stream=None, in_order=False, moved=False):
        return None

    def run(variant: str) -> None:
        host, hs, dev = plain if variant == "plain" else verified
        for layer in range(layers):
            host.load_to_device_per_layer(dp, hs, dev, layer, io)

    def nothing(*args):
        return None

    def setup(variant: str) -> None:
        if variant == "observer_off":
            host_v.unobserve(verification)
        elif variant != "plain" and variant != "verified":
            verifier._check_layers = no_check
            if variant != "no_launch":  # one event silenced: the pool's event tuples are rebuilt without it
                setattr(verification, "after_load" if variant == "before_call_only" else "before_call", nothing)
                host_v.unobserve(verification)
                host_v.observe(verification)

    def teardown(variant: str) -> None:
        if variant == "observer_off":
            host_v.observe(verification)
        elif variant != "plain" and variant != "verified":
            verifier.close_run()
            del verifier._check_layers
            if variant != "no_launch":  # bound to the verifier again, as the pool serves
                verification.use(None)
                verification.use(verifier)

    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(3 + repeats):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            setup(variant)
            torch.cuda.synchronize()
            start.record()
            run(variant)
            stop.record()
            stop.synchronize()
            teardown(variant)
            if r >= 3:
                times[variant].append(start.elapsed_time(stop))
    host_us: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(repeats):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            setup(variant)
            torch.cuda._sleep(20_000_000)  # the GPU busy: the loop's host time is submission alone
            t0 = time.perf_counter()
            run(variant)
            host_us[variant].append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
            teardown(variant)
    host_v.check_verified()
    row = {"pool": kind, "layout": layout, "io_backend": io, "tokens": tokens, "layers": layers}
    row |= {f"{v}_ms": statistics.median(t) for v, t in times.items()}
    base = row["plain_ms"]
    row |= {f"{v}_over_plain": row[f"{v}_ms"] / base - 1 for v in VARIANTS[1:]}
    row |= {f"{v}_host_us": statistics.median(t) for v, t in host_us.items()}
    row["samples_ms"] = times
    for host, _, _ in pools.values():
        host.destroy()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--cases", default="page_rows:page_first:direct,dsv4_paged:page_first_direct:direct,"
                    "mha_k_only:page_first_direct:direct,kv_scale_pages:page_first:kernel")  # fmt: skip
    args = ap.parse_args()
    rows = []
    for case in args.cases.split(","):
        kind, layout, io = case.split(":")
        try:
            rows.append(_case(kind, layout, io, args.tokens, args.page, args.repeats))
        except Exception as exc:  # one case's failure is a row of the result
            rows.append({"pool": kind, "layout": layout, "io_backend": io, "error": f"{type(exc).__name__}: {exc}"})
        torch.cuda.empty_cache()
        r = rows[-1]
        if "error" in r:
            print(case, r["error"])
            continue
        print(f"{args.tokens} {case:40s} plain {r['plain_ms']:.3f} ms; " + ", ".join(
            f"{v} {r[f'{v}_ms']:.3f} ({r[f'{v}_over_plain']:+.1%})" for v in VARIANTS[1:]) + "; host us "
              + ", ".join(f"{r[f'{v}_host_us']:.0f}" for v in VARIANTS))  # fmt: skip
        write_result(args.out, "verified per-layer loads with parts of verification taken away", rows, quiet=True)
    write_result(args.out, "verified per-layer loads with parts of verification taken away", rows)


if __name__ == "__main__":
    main()
