"""What the machine does without hicache's transfers: the copy ceiling, and the core's dispatch overhead."""

from __future__ import annotations

import statistics
import time

import torch

from ...plugins.implementation import LOAD, Implementation
from ...plugins.registry import Registry
from ...pool.host_pool import make_host_pool
from ..shapes import SHAPES
from .clock import Timer


def measure_ceiling(nbytes: int = 2 << 30) -> dict[str, float]:
    """GB/s of one contiguous pinned <-> device copy of ``nbytes``, each direction."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    timer = Timer(warmup=1, min_reps=3, max_reps=5, budget_s=1.0)
    h2d = timer(lambda: dev.copy_(host, non_blocking=True))
    d2h = timer(lambda: host.copy_(dev, non_blocking=True))
    return {"h2d_gbps": nbytes / h2d / 1e9, "d2h_gbps": nbytes / d2h / 1e9, "bytes": nbytes}


def measure_dispatch_overhead(calls: int = 200_000) -> dict[str, float]:
    """Per-call cost of the core: a call through the host pool against the implementation called directly."""

    class Noop(Implementation):
        name = "bench.noop"
        io_backend = "noop"
        device_types = frozenset({"cpu", "cuda"})

        def load_to_device_per_layer(self, h, d, layer):
            pass

        def backup_from_device_per_layer(self, h, d, layer):
            pass

        def backup_from_device_all_layer(self, h, d):
            pass

    class Plugin:
        from ...plugins.hookspecs import hookimpl

        @hookimpl
        def hicache_register_backends(self, register):
            register(Noop)

    registry = Registry()
    registry.add_plugin(Plugin(), "bench")
    dev = SHAPES["deepseek-mla"].device_pool(256, page_size=64, device="cpu", layers=4)
    host = make_host_pool(dev, layout="page_first", io_backend="noop", registry=registry)
    impl = host.implementation_for(LOAD)
    h, d = torch.arange(64), torch.arange(64, 128)
    through, direct = [], []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            host.load_to_device_per_layer(dev, h, d, 1, "noop")
        through.append((time.perf_counter() - t) / calls)
        t = time.perf_counter()
        for _ in range(calls):
            impl.load_to_device_per_layer(h, d, 1)
        direct.append((time.perf_counter() - t) / calls)
    a, b = statistics.median(through), statistics.median(direct)
    return {"through_pool_us": a * 1e6, "direct_us": b * 1e6, "overhead_us": (a - b) * 1e6, "calls": calls}
