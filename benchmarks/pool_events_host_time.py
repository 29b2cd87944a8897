"""Host time of one per-layer load call (and one layer of a layer-wise load's submission checks) on CPU pools.

Run before and after a change to the pool's hot path: ``python benchmarks/pool_events_host_time.py``
prints microseconds per call (minimum and median of 20,000) for a pool with its default observers (the transfer
metrics), with none, and (where the pool has them) with verification's observer.
"""

from __future__ import annotations

import json
import os
import platform
import time

import torch

import hicache_core as hc


def main() -> None:
    torch.set_num_threads(1)
    page, layers, tokens = 16, 8, 16
    dp = hc.MHADevicePool(tokens * 4, page, torch.bfloat16, 1, 8, layers, "cpu")
    host = hc.make_host_pool(dp, layout="page_first_direct", io_backend="direct", pin_memory=False)
    slots = host.alloc(tokens)
    dev = torch.arange(page, page + tokens)
    host.backup_from_device_all_layer(dp, slots, dev, "direct")

    out = {}

    def best(name: str) -> None:
        # One call at a time, 20,000 times: the minimum and the median (this machine is shared: the minimum is
        # the figure to compare; the median shows the noise).
        times = []
        for _ in range(20_000 // layers):
            for layer in range(layers):
                t0 = time.perf_counter_ns()
                host.load_to_device_per_layer(dp, slots, dev, layer, "direct")
                times.append(time.perf_counter_ns() - t0)
        times.sort()
        out[name] = {"min_us": times[0] / 1e3, "median_us": times[len(times) // 2] / 1e3}

    best("default observers (metrics)")
    observers = getattr(host, "observers", None)
    if observers is not None:
        for o in observers:
            host.unobserve(o)
        best("no observer")
    out["machine"] = platform.processor() or platform.machine()
    out["load_average"] = os.getloadavg()
    out["torch"] = torch.__version__
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
