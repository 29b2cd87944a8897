"""GPU check for hicache-jit (run by hand on a CUDA machine; pytest does not collect it).

For model shapes (default llama-8b, deepseek-mla, dsa-indexer; full layer counts, so host
strides are the real ones), every layout jit.one_layer claims, page size 64, random
scattered whole pages, and every launch variant (``HICACHE_JIT_VARIANT``):

* byte-exact against the core reference: per-layer load and per-layer backup, int64 and
  int32 indices, every fast-launch mode (Triton's path, the compiled launcher, its C function);
* stream order: a backup queued behind a slow producer on the caller's stream sees its bytes;
* GB/s as a fraction of the pinned-memcpy ceiling (measured in the same run), with at most
  8 CTAs and with one CTA per tile up to the SM count, beside kernel.triton_uva when it is
  installed (same pool, same indices);
* host time per small load (64 tokens, one layer), through the host pool and direct;
* first-call time per specialisation, and that repeated calls built nothing.

Nothing asserts a time. Exit status 1 if any byte differs.

    python plugins/jit/tests/gpu_check.py                       # a few minutes on an H200
    python plugins/jit/tests/gpu_check.py --tokens 4096,32768 --variants rows,rows_pipelined --json out.json
    python plugins/jit/tests/gpu_check.py --sweep               # also tile bytes x warps x hints x prefetch
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time

import torch

import hicache_core as hc
from hicache_core.tools.bench.clock import Timer
from hicache_core.tools.shapes import SHAPES

ONE_LAYER = (hc.LOAD, hc.BACKUP_LAYER)
PAGE = 64
#: "cpu" only for ``--dry-run`` (with TRITON_INTERPRET=1 and tiny pools): runs this script's own code, times nothing.
DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def fill_random(tensors) -> None:
    """Random bytes, made on the device (fast even for GBs of pinned host pool)."""
    for t in tensors:
        flat = t.reshape(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, device=DEVICE))


def images(tensors) -> list[torch.Tensor]:
    """Byte images of ``tensors``, kept on the GPU (fast to take and compare, even for GBs of host pool)."""
    return [t.reshape(-1).view(torch.uint8).to(DEVICE, copy=True) for t in tensors]


def restore(tensors, saved) -> None:
    for t, image in zip(tensors, saved):
        t.reshape(-1).view(torch.uint8).copy_(image)


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def time_it(fn, budget_s: float = 0.15, min_reps: int = 5, max_reps: int = 50) -> float:
    """Median seconds per call between CUDA events (the bench's clock); one timed call off CUDA (a dry run)."""
    if DEVICE != "cuda":
        for _ in range(2):
            fn()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return Timer(warmup=2, min_reps=min_reps, max_reps=max_reps, budget_s=budget_s)(fn)


def ceiling(nbytes: int = 1 << 30) -> dict[str, float]:
    """GB/s of one contiguous pinned <-> device copy, per direction (keyed by the operation it bounds)."""
    if DEVICE != "cuda":
        return {hc.LOAD: 1.0, hc.BACKUP_LAYER: 1.0}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = time_it(lambda: dev.copy_(host, non_blocking=True), budget_s=1.0, min_reps=3, max_reps=5)
    d2h = time_it(lambda: host.copy_(dev, non_blocking=True), budget_s=1.0, min_reps=3, max_reps=5)
    return {hc.LOAD: nbytes / h2d / 1e9, hc.BACKUP_LAYER: nbytes / d2h / 1e9}


class Pool:
    """One (shape, layout) pool: the jit host pool, the same plan under kernel.triton_uva, random indices."""

    def __init__(self, shape, layout: str, tokens: int, gen: torch.Generator, layers: int | None) -> None:
        self.shape, self.layout = shape, layout
        self.dev = shape.device_pool(tokens + 4 * PAGE, page_size=PAGE, device=DEVICE, layers=layers)
        self.host = hc.make_host_pool(self.dev, layout=layout, io_backend="kernel", operations=list(ONE_LAYER),
                                      implementation="jit.one_layer", size=tokens + 4 * PAGE)  # fmt: skip
        self.plan = self.host.plan
        self.jit = self.host.implementation_for(hc.LOAD)
        kernel_cls = hc.get_registry().implementations.get("kernel.triton_uva")
        self.kernel = kernel_cls(self.plan) if kernel_cls is not None else None
        self.items_are_pages = self.host.geometry.items_are_pages
        self.device_tensors = list({id(t): t for p in self.plan.parts for t in p.device_layers}.values())
        self.host_tensors = list(self.plan.host_buffers.values())
        fill_random(self.device_tensors + self.host_tensors)
        self.gen = gen

    def indices(self, tokens: int, dtype=torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
        """Item indices (page rows for page-row pools) of ``tokens`` tokens in random whole pages, on the device."""
        n_pages = tokens // PAGE
        device_pages = self.plan.device_rows // (1 if self.items_are_pages else PAGE)
        host_pages = torch.randperm(self.host.page_num, generator=self.gen)[:n_pages]
        dev_pages = torch.randperm(device_pages - 1, generator=self.gen)[:n_pages] + 1  # page 0: SGLang's padding
        if self.items_are_pages:
            h, d = host_pages, dev_pages
        else:
            offs = torch.arange(PAGE)
            h = (host_pages[:, None] * PAGE + offs).reshape(-1)
            d = (dev_pages[:, None] * PAGE + offs).reshape(-1)
        return h.to(DEVICE, dtype), d.to(DEVICE, dtype)

    def moved_bytes(self, tokens: int) -> int:
        return (tokens // PAGE if self.items_are_pages else tokens) * sum(p.item_bytes for p in self.plan.parts)

    def exact(self, impl, op: str, h: torch.Tensor, d: torch.Tensor, layer: int) -> bool:
        """``impl``'s ``op`` against the reference from the same bytes, over every byte it could touch."""
        layer_tensors = [p.device_layers[layer] for p in self.plan.parts]
        fill_random(layer_tensors)  # fresh bytes on the device side, so every check moves bytes that differ
        targets = self.host_tensors if op == hc.BACKUP_LAYER else layer_tensors
        start = images(targets)
        getattr(impl, op)(h, d, layer)
        sync()
        got = images(targets)
        restore(targets, start)
        hc.reference_copy(self.plan, h.cpu(), d.cpu(), [layer], to_device=op == hc.LOAD)
        sync()
        return same(got, images(targets)) and not same(got, start)

    def stream_order(self, impl, h: torch.Tensor, d: torch.Tensor, layer: int) -> bool:
        """A backup on a side stream, queued behind a slow producer of the rows on that stream, sees the new rows."""
        layer_tensors = [p.device_layers[layer] for p in self.plan.parts]
        fresh = [torch.empty_like(t) for t in layer_tensors]
        fill_random(fresh)
        start = images(self.host_tensors + layer_tensors)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)
            for t, f in zip(layer_tensors, fresh):
                t.copy_(f)
            impl.backup_from_device_per_layer(h, d, layer)
        torch.cuda.synchronize()
        got = images(self.host_tensors)
        restore(self.host_tensors + layer_tensors, start)
        for t, f in zip(layer_tensors, fresh):
            t.copy_(f)
        hc.reference_copy(self.plan, h.cpu(), d.cpu(), [layer], to_device=False)
        torch.cuda.synchronize()
        return same(got, images(self.host_tensors))


def op_call(impl, op: str, h: torch.Tensor, d: torch.Tensor):
    if op == hc.LOAD:
        return lambda: impl.load_to_device_per_layer(h, d, 0)
    return lambda: impl.backup_from_device_per_layer(h, d, 0)


def check_pool(pool: Pool, variants: list[str], token_counts: list[int], link, report, failures, sweep: bool) -> None:
    import hicache_jit

    jit = pool.jit
    shape_name, layout = pool.shape.name, pool.layout
    # -- byte-exactness: every variant, both index dtypes, every launch mode of the first variant.
    h_small, d_small = pool.indices(4 * PAGE)
    last = pool.plan.num_layers - 1
    for variant in variants:
        jit.variant = variant
        checks = []
        for dtype in (torch.int64, torch.int32):
            h, d = h_small.to(dtype), d_small.to(dtype)
            for op in ONE_LAYER:
                checks.append((f"{op[:6]}/{str(dtype)[6:]}", pool.exact(jit, op, h, d, last)))
                checks.append((f"{op[:6]}/{str(dtype)[6:]}/again", pool.exact(jit, op, h, d, 0)))
        if variant == variants[0] and DEVICE == "cuda":
            for mode in (0, 1, 2):
                jit.fast_launch = mode
                checks.append((f"fast_launch={mode}", pool.exact(jit, hc.LOAD, h_small, d_small, 1)))
            jit.fast_launch = 2
            checks.append(("stream order", pool.stream_order(jit, h_small, d_small, 0)))
        bad = [name for name, ok in checks if not ok]
        cfg = jit.launch_config()[0]
        tile = cfg.get("rows_per_tile", cfg.get("words_per_tile"))
        print(f"   {'PASS' if not bad else 'FAIL'} exact  {variant:15} ({cfg['kernel']} kernel, tile {tile} "
              f"({cfg['tile_bytes']} B), {jit.num_warps} warps)" + (f"  failed: {bad}" if bad else ""))  # fmt: skip
        if bad:
            failures.append(f"{shape_name} {layout} {variant}: {bad}")

    # -- GB/s: every variant and kernel.triton_uva, at most 8 CTAs and unlimited, each token count.
    built_before = hicache_jit.compile_count(), hicache_jit.triton_cache_entries()
    contenders = [(v, jit) for v in variants]
    if pool.kernel is not None:
        contenders.append(("kernel.triton_uva", pool.kernel))
    for tokens in token_counts:
        h, d = pool.indices(tokens)
        nbytes = pool.moved_bytes(tokens)
        for op in ONE_LAYER:
            line = []
            for name, impl in contenders:
                if impl is jit:
                    jit.variant = name
                for ctas in (8, 0):
                    impl.max_ctas = ctas
                    gbps = nbytes / time_it(op_call(impl, op, h, d)) / 1e9
                    frac = gbps / link[op]
                    report(shape=shape_name, layout=layout, tokens=tokens, operation=op, implementation=name,
                           max_ctas=ctas or None, gbps=gbps, fraction_of_ceiling=frac)  # fmt: skip
                    line.append((name, ctas, frac))
            cells = "  ".join(f"{n[:14]}{'/8' if c == 8 else '/all'} {f:.3f}" for n, c, f in line)
            best = max((f for n, c, f in line if c == 8 and n != "kernel.triton_uva"), default=0.0)
            base = [f for n, c, f in line if c == 8 and n == "kernel.triton_uva"]
            versus = f"  | best jit@8 / kernel@8 = {best / base[0]:.2f}x" if base else ""
            print(f"   {op[:22]:22} {tokens:>6} tok  {cells}{versus}")
    built_after = hicache_jit.compile_count(), hicache_jit.triton_cache_entries()
    if built_after != built_before:
        print(f"   note: timing built {built_after[0] - built_before[0]} specialisations "
              f"(Triton cache {built_before[1]} -> {built_after[1]})")  # fmt: skip
    jit.variant = hicache_jit.DEFAULT_VARIANT
    jit.max_ctas = 8

    # -- optional: sweep the knobs the presets set, on page_first, at most 8 CTAs.
    if sweep and layout == "page_first":
        tokens = max(token_counts)
        h, d = pool.indices(tokens)
        nbytes = pool.moved_bytes(tokens)
        for tile, warps, hints, pipe in itertools.product((16384, 32768, 65536), (4, 8, 16), (0, 1, 2), (0, 1, 2)):
            jit.variant = "rows"
            jit.tile_bytes, jit.num_warps, jit.hints, jit.prefetch = tile, warps, hints, pipe
            for op in ONE_LAYER:
                frac = nbytes / time_it(op_call(jit, op, h, d)) / 1e9 / link[op]
                report(shape=shape_name, layout=layout, tokens=tokens, operation=op, sweep=True, tile_bytes=tile,
                       num_warps=warps, hints=hints, prefetch=pipe, max_ctas=8, fraction_of_ceiling=frac)  # fmt: skip
                print(f"   sweep tile={tile:>5} warps={warps:>2} hints={hints} prefetch={pipe} {op[:22]:22} "
                      f"{frac:.3f}")  # fmt: skip
        jit.variant = hicache_jit.DEFAULT_VARIANT


def host_time(report) -> None:
    """Host-side time per small load: 64 tokens, one layer (deepseek-mla, page_first), the GPU keeping up."""
    dev = SHAPES["deepseek-mla"].device_pool(4096, page_size=PAGE, device=DEVICE, layers=2)
    host = hc.make_host_pool(dev, layout="page_first", io_backend="kernel", operations=list(ONE_LAYER), size=4096,
                             implementation="jit.one_layer")  # fmt: skip
    jit = host.implementation_for(hc.LOAD)
    jit.warmup()
    h = torch.arange(64, 128, device=DEVICE)
    d = torch.arange(128, 192, device=DEVICE)
    calls = 3000 if DEVICE == "cuda" else 3

    def per_call_us(fn) -> float:
        for _ in range(min(200, calls)):
            fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - t0
        sync()
        return elapsed / calls * 1e6

    for mode in (2, 1, 0):
        jit.fast_launch = mode
        pool_us = per_call_us(lambda: host.load_to_device_per_layer(dev, h, d, 0, "kernel"))
        direct_us = per_call_us(lambda: jit.load_to_device_per_layer(h, d, 0))
        report(metric="host_time_us", implementation="jit.one_layer", fast_launch=jit.fast_launch,
               through_pool_us=pool_us, direct_us=direct_us)  # fmt: skip
        print(f"host time per small load (deepseek-mla, 64 tokens, 1 layer), jit fast_launch={mode}: "
              f"{pool_us:.1f} us through the host pool, {direct_us:.1f} us calling the implementation")  # fmt: skip
    jit.fast_launch = 2
    kernel_cls = hc.get_registry().implementations.get("kernel.triton_uva")
    if kernel_cls is not None:
        kernel = kernel_cls(host.plan)
        kernel.warmup()
        us = per_call_us(lambda: kernel.load_to_device_per_layer(h, d, 0))
        report(metric="host_time_us", implementation="kernel.triton_uva", direct_us=us)
        print(f"host time per small load, kernel.triton_uva: {us:.1f} us calling the implementation")

    import hicache_jit

    before = hicache_jit.compile_count(), hicache_jit.triton_cache_entries()
    for _ in range(10):
        jit.load_to_device_per_layer(h, d, 0)
        jit.backup_from_device_per_layer(h, d, 1)
    sync()
    after = hicache_jit.compile_count(), hicache_jit.triton_cache_entries()
    print(f"\nspecialisations built in this run: {after[0]} (Triton in-memory cache entries: {after[1]}); "
          f"ten more calls of each direction built {after[0] - before[0]} "
          f"(Triton cache grew by {after[1] - before[1]})")  # fmt: skip


def main() -> int:
    global DEVICE
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="llama-8b,deepseek-mla,dsa-indexer")
    p.add_argument("--tokens", default="4096", help="tokens per call for the GB/s figures (comma-separated)")
    p.add_argument("--variants", default="all", help="comma-separated HICACHE_JIT_VARIANT names, or all")
    p.add_argument("--layers", type=int, default=None, help="cut pools to this many layers (default: the model's)")
    p.add_argument("--sweep", action="store_true", help="also sweep tile bytes x warps x hints x prefetch")
    p.add_argument("--json", default=None, help="write every record here")
    p.add_argument("--dry-run", action="store_true", help=argparse.SUPPRESS)  # CPU, TRITON_INTERPRET=1, tiny pools
    args = p.parse_args()
    if args.dry_run:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("needs CUDA (a dry run of this script's own code: TRITON_INTERPRET=1 ... --dry-run)")
        return 2
    import hicache_jit
    import triton

    variants = list(hicache_jit.VARIANTS) if args.variants == "all" else args.variants.split(",")
    token_counts = [int(t) for t in args.tokens.split(",")]
    gpu = (f"{torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs"
           if DEVICE == "cuda" else "dry run on the CPU")  # fmt: skip
    print(f"torch {torch.__version__}, triton {triton.__version__}, {gpu}; default {hicache_jit.DEFAULT_VARIANT}")
    link = ceiling()
    print(f"ceiling (pinned memcpy 1 GiB): H2D {link[hc.LOAD]:.1f} GB/s, D2H {link[hc.BACKUP_LAYER]:.1f} GB/s")
    print("figures below: fraction of that ceiling; name/8: at most 8 CTAs, name/all: a CTA per tile up to the SMs\n")
    gen = torch.Generator().manual_seed(0)
    records: list[dict] = []
    failures: list[str] = []

    def report(**row) -> None:
        records.append(row)

    registry = hc.get_registry()
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        for layout, decl in sorted(registry.layouts.items()):
            if not hc.TransferRequest("reference", hc.LOAD, shape.geometry(page_size=PAGE), decl).storable:
                continue
            request = hc.TransferRequest("kernel", hc.LOAD, shape.geometry(page_size=PAGE), decl, True)
            why = hicache_jit.JitOneLayer.not_supported_reasons(request)
            if why:
                print(f"-- {shape_name} {layout}: refused ({why[0][:100]}...)")
                continue
            pool = Pool(shape, layout, max(token_counts), gen, args.layers)
            parts = "+".join(str(p.item_bytes) for p in pool.plan.parts)
            print(f"== {shape_name} {layout}: {pool.plan.num_layers} layers, item {parts} B, "
                  f"word {pool.jit.word_bytes} B")  # fmt: skip
            try:
                check_pool(pool, variants, token_counts, link, report, failures, args.sweep)
            except Exception as exc:  # noqa: BLE001 - report and go on to the next pool
                failures.append(f"{shape_name} {layout}: {type(exc).__name__}: {exc}")
                print(f"   FAIL {type(exc).__name__}: {exc}")
            del pool
            if DEVICE == "cuda":
                torch.cuda.empty_cache()

    print()
    host_time(report)
    seconds = hicache_jit.compile_seconds()
    for key, s in seconds.items():
        report(metric="first_call_s", key=str(key), seconds=s)
    if seconds:
        ordered = sorted(seconds.values())
        print(f"first call per key (compile, or load from Triton's disk cache): "
              f"median {statistics.median(ordered):.3f} s, max {ordered[-1]:.3f} s over {len(ordered)} keys; "
              "slowest:")  # fmt: skip
        for key, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:5]:
            print(f"   {s:7.3f} s  {key}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceiling": link, "records": records}, f, indent=1)
        print(f"wrote {args.json}")
    print("\nall byte-exact" if not failures else f"\n{len(failures)} FAILED:\n  " + "\n  ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
