"""Why a verified per-layer load can cost more than its check: the same load with parts of verification taken away.

Run on the GPU machine::

    python benchmarks/verify_probe.py --out $OUT/verify-probe-h200.json

Per case (pool:layout:io:tokens), synchronous per-layer loads (as ``verify_cost.py``'s ``load``) in six
variants, interleaved (the order rotating each repeat), CUDA events, ``--repeats`` each:

* ``plain``: the unverified pool;
* ``verified``: the verifying pool;
* ``detached``: the verifying pool with its verifier taken off for the call: the same pinned pages, no
  verification at all (tells the pool's memory from verification);
* ``no_check``: the verifying pool, every step of verification but the check kernel's launch;
* ``plain_host_wait``: the unverified pool, each call followed by a host busy-wait as long as the
  verifying pool's extra host time per call (tells whether the host's pace slows the copies);
* ``on_copy_stream``: the verifying pool with its side stream taken off for the call, so the check is
  launched on the copies' own stream, in order. It found the cause this probe was written for: a check
  queued on the side stream behind an event wait; since hicache_core df8b0f2b the pool itself launches
  a load's check in order, and this variant differs from ``verified`` only in the event it records and waits on.

With ``--path layerwise``, the same for loads through the layer loader (``submit_load``), timed by the
load's own events (the GPU alone), without ``plain_host_wait``.

Reported per variant: the median, and the median of each repeat's ratio to ``plain``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from verify_cost import host_call_us, pool_pair, write_result  # noqa: E402


def _host_us_per_call(host, dp, hs, dev, io, layers: int) -> float:
    return sum(host_call_us(host, dp, hs, dev, io, layers)) / layers


def _case(kind: str, layout: str, io: str, tokens: int, page: int, repeats: int, path: str = "per_layer") -> dict:
    dp, pools = pool_pair(kind, layout, io, tokens, page)
    layers = dp.layer_num
    (p, phs, pdev), (v, vhs, vdev) = pools[False], pools[True]
    for _ in range(3):
        _host_us_per_call(p, dp, phs, pdev, io, layers)
        _host_us_per_call(v, dp, vhs, vdev, io, layers)
    extra_us = max(0.0, statistics.median(_host_us_per_call(v, dp, vhs, vdev, io, layers) for _ in range(5))
                   - statistics.median(_host_us_per_call(p, dp, phs, pdev, io, layers) for _ in range(5)))  # fmt: skip
    verifier = v.verifier

    gpu_ms: list[float] = []

    def load(host, hs, dev, wait_us: float = 0.0):
        if path == "layerwise":
            done = host.submit_load(dp, hs, dev, io, timing=True)
            done.finish_event.wait()
            torch.cuda.synchronize()  # the events must have completed, not only been recorded
            gpu_ms.append(done.start_event.elapsed_time(done.finish_event))
            return
        for layer in range(layers):
            host.load_to_device_per_layer(dp, hs, dev, layer, io)
            if wait_us:
                end = time.perf_counter() + wait_us * 1e-6
                while time.perf_counter() < end:
                    pass

    def detached():
        v.verifier = None
        try:
            load(v, vhs, vdev)
        finally:
            v.verifier = verifier

    def no_check():
        real = verifier._check_layers
        verifier._check_layers = lambda *a, **k: None
        try:
            load(v, vhs, vdev)
        finally:
            verifier._check_layers = real

    def on_copy_stream():
        side, verifier._side = verifier._side, None
        try:
            load(v, vhs, vdev)
        finally:
            verifier._side = side

    fns = {
        "plain": lambda: load(p, phs, pdev),
        "verified": lambda: load(v, vhs, vdev),
        "detached": detached,
        "no_check": no_check,
        "on_copy_stream": on_copy_stream,
    }
    if path == "per_layer":
        fns["plain_host_wait"] = lambda: load(p, phs, pdev, extra_us)
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    gpu_ms.clear()
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            a.record()
            fns[name]()
            b.record()
            b.synchronize()
            times[name].append(gpu_ms.pop() if path == "layerwise" else a.elapsed_time(b))
    v.check_verified()
    row = {"pool": kind, "layout": layout, "io_backend": io, "tokens": tokens, "layers": layers, "path": path,
           "extra_host_us_per_call": extra_us, "samples_ms": times,
           "implementation": v.implementations.get("load_to_device_per_layer")}  # fmt: skip
    for name in names:
        row[f"{name}_ms"] = statistics.median(times[name])
        row[f"{name}_paired"] = statistics.median(x / y - 1 for x, y in zip(times[name], times["plain"]))
    for host, _, _ in pools.values():
        host.destroy()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="mla:page_first:kernel:4096,mha:page_first:kernel:4096,"
                    "mha:layer_first:kernel:32768")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--path", choices=("per_layer", "layerwise"), default="per_layer")
    args = ap.parse_args()
    rows = []
    for case in args.cases.split(","):
        kind, layout, io, tokens = case.split(":")
        r = _case(kind, layout, io, int(tokens), 64, args.repeats, args.path)
        rows.append(r)
        print(f"{tokens:>6} {kind} {layout} {io} (+{r['extra_host_us_per_call']:.1f} us host/call): "
              + ", ".join(f"{n} {r[n + '_ms']:.3f} ms ({r[n + '_paired']:+.1%})"
                          for n in r["samples_ms"]), flush=True)  # fmt: skip
    write_result(args.out, f"verified {args.path} loads with parts of verification taken away, same run", rows)


if __name__ == "__main__":
    main()
