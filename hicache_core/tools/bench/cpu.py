"""``hicache bench --device cpu``: the implementations that run on a CPU, against a plain memcpy of the same bytes.

On a machine without a GPU the device pool lives in host memory too, so the ceiling
is a contiguous ``memcpy`` of exactly the bytes a transfer moves, timed in the same
run. Each row is one (shape, layout, operation, implementation): the best time of repeated
calls after a warm-up, alternating with the memcpy so that both see the same machine,
GB/s, and the fraction of the memcpy.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ...plugins.dispatch import reasons_for
from ...plugins.implementation import BACKUP_ALL, LOAD, TransferRequest
from ...plugins.registry import get_registry
from ...pool.host_pool import make_host_pool
from ..shapes import SHAPES


def _interleaved_seconds(fn: Callable[[], None], nbytes: int, *, reps: int = 15) -> tuple[float, float]:
    """Best time of ``fn`` and of a memcpy of ``nbytes``, timed alternately so both see the same machine.

    The minimum, not the median: on a shared CPU, other processes only ever add time.
    """
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    fn()  # warm-up: thread pools, first-touch pages, converted indices
    dst.copy_(src)
    ours, theirs = [], []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        dst.copy_(src)
        theirs.append(time.perf_counter() - t)
    return min(ours), min(theirs)


def run_cpu_bench(out: str = "benchmarks/results", quick: bool = False, layers: int = 4) -> int:
    """Measure every CPU implementation on every shape and layout; write ``cpu-bench.json``."""
    from .records import environment, made_by

    registry = get_registry()
    tokens, page = (1024 if quick else 4096), 64
    impls = [c for c in registry.implementations.values() if c.auto_selectable and "cpu" in c.device_types]
    rows = []
    gen = torch.Generator().manual_seed(0)
    for shape in SHAPES.values():
        for layout, decl in sorted(registry.layouts.items()):
            geometry = shape.geometry(page_size=page, device_type="cpu", layers=layers)
            if not TransferRequest("reference", LOAD, geometry, decl).storable:
                continue
            dev = shape.device_pool(2 * tokens, page_size=page, device="cpu", layers=layers)
            host = make_host_pool(dev, layout=layout, io_backend="reference", size=dev.size, operations=())
            for t in [t for p in host.plan.parts for t in p.device_layers] + list(host.plan.host_buffers.values()):
                t.view(-1).view(torch.uint8).copy_(torch.randint(0, 256, (t.numel() * t.element_size(),),
                                                                 dtype=torch.uint8, generator=gen))  # fmt: skip
            pages = torch.randperm(host.page_num, generator=gen)[: tokens // page]
            h = (pages[:, None] * page + torch.arange(page)).reshape(-1)
            dpages = torch.randperm(dev.size // page, generator=gen)[: tokens // page]
            d = (dpages[:, None] * page + torch.arange(page)).reshape(-1)
            if host.geometry.items_are_pages:
                h, d = h[::page] // page, d[::page] // page
            per_item = sum(host.geometry.item_bytes)
            for cls in impls:
                for op in (LOAD, BACKUP_ALL):
                    if reasons_for(cls, TransferRequest(cls.io_backend, op, host.geometry, decl, False)):
                        continue
                    impl = cls(host.plan)
                    moved = h.numel() * per_item * (host.layer_num if op == BACKUP_ALL else 1)
                    args = (h, d, 0) if op == LOAD else (h, d)
                    seconds, ceiling = _interleaved_seconds(functools.partial(getattr(impl, op), *args), moved)
                    rows.append({
                        "shape": shape.name, "layout": layout, "operation": op, "implementation": cls.name,
                        **made_by(registry, cls),
                        "tokens": tokens, "page_size": page, "bytes": moved, "seconds": seconds,
                        "gbps": moved / seconds / 1e9, "memcpy_gbps": moved / ceiling / 1e9,
                        "fraction_of_memcpy": ceiling / seconds,
                    })  # fmt: skip
    result = {
        "environment": environment() | {"threads": torch.get_num_threads()},
        "method": "best of 15 calls after a warm-up, alternating with the ceiling: torch copy_ of the same number "
        "of contiguous bytes (best of 15)",
        "rows": rows,
    }
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "cpu-bench.json").write_text(json.dumps(result, indent=1))
    header = ("shape", "layout", "operation", "implementation", "GB/s", "memcpy", "fraction")
    table = [(r["shape"], r["layout"], r["operation"].split("_")[0], r["implementation"], f"{r['gbps']:.2f}",
              f"{r['memcpy_gbps']:.2f}", f"{r['fraction_of_memcpy']:.2f}") for r in rows]  # fmt: skip
    widths = [max(len(str(x)) for x in col) for col in zip(header, *table)]
    for line in [header, *table]:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip())
    print(f"wrote {path / 'cpu-bench.json'}")
    return 0
