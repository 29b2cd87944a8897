"""GPU stress check for io backend "kernel" (run by hand on a CUDA machine; pytest does not collect it).

For every model-like shape and every layout it can store, on a side stream, while a bf16 GEMM
loops on another stream:

* backup of all layers, per-layer backup, per-layer load, with random scattered whole pages;
* byte-exact comparison of every host buffer and device layer against the core reference;
* both launch paths (Triton's own, then the cached launcher) and SM budgets 8 and unlimited;
* a stream-ordering check: a transfer queued behind a slow producer on the same stream must
  see the producer's bytes.

It prints one line per case and, for information only, GB/s and host time per small call.
Nothing here asserts a time. Exit status 1 if any byte differs.

    python plugins/kernel/tests/gpu_stress.py [--tokens 4096] [--layers 8] [--shapes llama-8b,deepseek-mla]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

os.environ.setdefault("HICACHE_PLUGINS", "kernel")  # this script is about hicache-kernel, not hicache-jit

import hicache_core as hc  # noqa: E402
from hicache_core.tools.shapes import SHAPES


def random_bytes(tensors, gen: torch.Generator) -> None:
    for t in tensors:
        flat = t.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen).to(t.device))


def device_tensors(pool) -> list[torch.Tensor]:
    attrs = ("k_buffer", "v_buffer", "kv_buffer", "index_k_with_scale_buffer")
    return [t for a in attrs for t in (getattr(pool, a, None) or [])]


def page_slots(num_pages: int, count: int, page_size: int, gen: torch.Generator, first: int = 0) -> torch.Tensor:
    pages = torch.randperm(num_pages - first, generator=gen)[:count] + first
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    as_bytes = lambda t: t.reshape(-1).view(torch.uint8).cpu()  # noqa: E731
    return all(torch.equal(as_bytes(x), as_bytes(y)) for x, y in zip(a, b))


class Gemm:
    """A bf16 GEMM looping on its own stream until stopped."""

    def __init__(self, n: int = 8192) -> None:
        self.stream = torch.cuda.Stream()
        with torch.cuda.stream(self.stream):
            self.a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            self.b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        self.stream.synchronize()

    def queue(self, reps: int) -> None:
        with torch.cuda.stream(self.stream):
            for _ in range(reps):
                self.a @ self.b  # noqa: B018 - the work is the point


def run_case(shape, layout: str, args, gemm: Gemm, gen: torch.Generator, max_ctas, fast: bool) -> tuple[bool, str]:
    tokens, page_size = args.tokens, args.page_size
    dev = shape.device_pool(2 * tokens, page_size=page_size, device="cuda", layers=args.layers)
    kw = dict(layout=layout, size=dev.size, operations=hc.OPERATIONS)  # never smaller than the device pool
    host = hc.make_host_pool(dev, io_backend="kernel", **kw)
    ref = hc.make_host_pool(dev, io_backend="reference", **kw)
    impls = {host.implementation_for(op) for op in hc.OPERATIONS}
    for impl in impls:
        impl.max_ctas = max_ctas
        impl.fast_launch = 2 if fast else 0
    hosts = list(host.plan.host_buffers.values())
    refs = list(ref.plan.host_buffers.values())
    devs = device_tensors(dev)
    random_bytes(hosts + devs, gen)
    for name, buf in host.plan.host_buffers.items():
        ref.plan.host_buffers[name].copy_(buf)
    n_pages = tokens // page_size
    dev_pages = (2 * tokens) // page_size + 1
    h = page_slots(2 * tokens // page_size, n_pages, page_size, gen)
    d = page_slots(dev_pages, n_pages, page_size, gen, first=1)
    hd, dd = h.cuda(), d.cuda()
    if args.int32:
        hd, dd = hd.int(), dd.int()
    side = torch.cuda.Stream()
    host.implementation_for(hc.LOAD).warmup((hd.dtype,))  # compile now, not inside the timed region
    torch.cuda.synchronize()

    # Backup of every layer on the side stream while the GEMM runs.
    gemm.queue(20)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        start.record()
        for _ in range(args.reps):
            host.backup_from_device_all_layer(dev, hd, dd, "kernel")
        stop.record()
    torch.cuda.synchronize()
    backup_s = start.elapsed_time(stop) / 1e3 / args.reps
    ref.backup_from_device_all_layer(dev, h, d, "reference")
    ok_backup = same(hosts, refs)

    # Per-layer load into scrambled device rows, on the side stream, beside the GEMM.
    random_bytes(devs, gen)
    before = [t.clone() for t in devs]
    gemm.queue(20)
    side.wait_stream(torch.cuda.current_stream())  # the scrambled rows are written on this stream
    with torch.cuda.stream(side):
        start.record()
        for layer in range(dev.layer_num):
            host.load_to_device_per_layer(dev, hd, dd, layer, "kernel")
        stop.record()
    torch.cuda.synchronize()
    load_s = start.elapsed_time(stop) / 1e3 / dev.layer_num
    got = [t.clone() for t in devs]
    for t, b in zip(devs, before):
        t.copy_(b)
    for layer in range(dev.layer_num):
        ref.load_to_device_per_layer(dev, h, d, layer, "reference")
    ok_load = same(got, devs)

    # Per-layer backup, and stream order: a slow producer on the same stream writes the rows first.
    h2, d2 = h[: 2 * page_size], d[: 2 * page_size]
    fresh = [torch.empty_like(t) for t in devs]
    random_bytes(fresh, gen)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~25 ms: a transfer on the wrong stream would read stale rows
        for t, f in zip(devs, fresh):
            t.copy_(f)
        for layer in range(dev.layer_num):
            host.backup_from_device_per_layer(dev, h2.cuda(), d2.cuda(), layer, "kernel")
    torch.cuda.synchronize()
    for layer in range(dev.layer_num):
        ref.backup_from_device_per_layer(dev, h2, d2, layer, "reference")
    ok_layer = same(hosts, refs)

    item = sum(p.item_bytes for p in host.plan.parts)
    moved_load = (n_pages if host.geometry.items_are_pages else tokens) * item
    moved_backup = moved_load * host.plan.num_layers
    impl = host.implementation_for(hc.LOAD)
    fast_used = any(g.fast for g in impl._groups)
    ok = ok_backup and ok_load and ok_layer
    line = (
        f"{'PASS' if ok else 'FAIL'} {shape.name:17s} {layout:20s} ctas={str(max_ctas):4s} "
        f"launch={'cached' if fast_used else 'triton':6s} word={impl.word_bytes:2d}B "
        f"backup_all {moved_backup / backup_s / 1e9:6.1f} GB/s  load {moved_load / load_s / 1e9:6.1f} GB/s"
        + ("" if ok else f"  [backup_all={ok_backup} load={ok_load} per_layer+stream_order={ok_layer}]")
    )
    del host, ref, dev
    torch.cuda.empty_cache()
    return ok, line


def host_time(shape, args) -> str:
    """Host-side time per small load (64 tokens, one layer), cached launcher, not synchronised per call."""
    dev = shape.device_pool(4096, page_size=64, device="cuda", layers=2)
    host = hc.make_host_pool(dev, layout="page_first", io_backend="kernel", size=4096)
    impl = host.implementation_for(hc.LOAD)
    impl.warmup()
    h = torch.arange(64, 128, device="cuda")
    d = torch.arange(128, 192, device="cuda")
    for _ in range(100):
        host.load_to_device_per_layer(dev, h, d, 0, "kernel")
    torch.cuda.synchronize()
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        host.load_to_device_per_layer(dev, h, d, 0, "kernel")
    through_pool = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        impl.load_to_device_per_layer(h, d, 0)
    direct = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return (
        f"host time per small load ({shape.name}, 64 tokens, 1 layer): {through_pool:.1f} us via the host pool, "
        f"{direct:.1f} us calling the implementation"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=8, help="layers per pool (model shapes are cut to this)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--int32", action="store_true", help="int32 indices (default int64)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    registry = hc.get_registry()
    gen = torch.Generator().manual_seed(0)
    gemm = Gemm()
    failures = 0
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        geometry = shape.geometry(page_size=args.page_size)
        layouts = [n for n, lay in sorted(registry.layouts.items())
                   if hc.TransferRequest("reference", hc.LOAD, geometry, lay).storable]  # fmt: skip
        for layout in layouts:
            for max_ctas, fast in ((8, False), (8, True), (0, True)):
                try:
                    ok, line = run_case(shape, layout, args, gemm, gen, max_ctas, fast)
                except Exception as exc:  # noqa: BLE001 - report and go on to the next case
                    ok, line = False, f"FAIL {name} {layout} ctas={max_ctas}: {type(exc).__name__}: {exc}"
                failures += not ok
                print(line, flush=True)
    print(host_time(SHAPES["deepseek-mla"], args))
    print("all byte-exact" if not failures else f"{failures} case(s) FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
