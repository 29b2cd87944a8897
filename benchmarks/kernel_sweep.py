"""GPU sweep of the Triton kernel variants: correctness first, then GB/s, host time, overlap.

One call on an H200, about 5-6 minutes (``--budget-s`` trims the optional phases to fit):

    pip install --no-deps --no-build-isolation -e . -e plugins/kernel -e plugins/jit
    python benchmarks/kernel_sweep.py                  # writes $OUT/kernel-sweep.json (default benchmarks/results)

Phases, in order (each prints as it goes; the compact table comes last):

1. **precompile**: worker processes compile every (variant, shape, layout, direction) kernel into
   Triton's disk cache, so the main process only loads them (falls back to compiling in place).
2. **ceiling**: a 2 GiB pinned ``cudaMemcpyAsync`` each way (the bar's denominator), and memcpy
   of exactly the bytes of each timed transfer (what the copy engine does at that size).
3. **exact**: every variant on CUDA pools with the real layer counts: per-layer load and backup
   (and the all-layer backup for kernel.triton_uva), random pages plus out-of-range and negative
   indices, int64 and int32; every byte of both pools compared with the reference moving the
   valid pairs only, and the drop word must name the call (and stay clear for good indices).
   A variant that fails is left out of the timing.
4. **timing**: variant x {MLA 1152 B, llama 2 x 2048 B} x {page_first, layer_first,
   page_first_direct} x {4096, 32768 tokens} x {load, backup}, at 8 CTAs (and 4/16 for some),
   random scattered 64-token pages. Two clocks: ``queued`` (calls queued back to back behind a
   GPU sleep, so host submission never shows: the GPU time per call, what a server's layer-wise
   load pays) and ``isolated`` (one call between two events on an idle stream, as ``hicache
   bench`` and the issue's figures: includes the ~10+ us the host takes to submit the launch).
   Each call of a batch loads a different layer, so no cache holds the host bytes between calls.
   All-layer backups for kernel.triton_uva.
5. **host**: host time per 64-token load (through the pool and calling the implementation), and
   the floors beneath it: Triton's C launcher with prebuilt arguments, an empty Triton kernel,
   a torch launch.
6. **diagnostics**: contiguous host reads (layer_first with sequential indices) to separate the
   link's limit from the cost of scattered rows.
7. **graph**: one load captured in a CUDA graph, replayed: byte-exact, time per replay.
8. **overlap**: llama-8b layer-wise loads on a side stream under per-layer prefill GEMMs: the
   GEMMs' own slowdown and the fraction of the ideal, for a few variants at 4 and 8 CTAs.

``--dry-run`` runs every phase's code on the CPU under ``TRITON_INTERPRET=1`` with tiny pools
(times are meaningless): how this script is tested without a GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import hicache_core as hc
from hicache_core.pool.drops import DroppedIndicesError
from hicache_core.tools.bench.clock import Timer, queued_seconds
from hicache_core.tools.shapes import SHAPES

HERE = Path(__file__).resolve().parent
PAGE = 64
LOAD, BACKUP, BACKUP_ALL = hc.LOAD, hc.BACKUP_LAYER, hc.BACKUP_ALL


@dataclass(frozen=True)
class Config:
    """One variant under test: an implementation and the knobs set on it."""

    name: str
    impl: str  # "jit.one_layer" or "kernel.triton_uva"
    knobs: tuple[tuple[str, object], ...]
    extra_ctas: bool = False  # also time at 4 and 16 CTAs

    def apply(self, impl) -> None:
        for key, value in self.knobs:
            setattr(impl, key, value)


CONFIGS = [
    Config("jit/rows", "jit.one_layer", (("variant", "rows"),), extra_ctas=True),
    Config("jit/rows_prefetch", "jit.one_layer", (("variant", "rows_prefetch"),)),
    Config("jit/rows_deep", "jit.one_layer", (("variant", "rows_deep"),)),
    Config("jit/rows_async", "jit.one_layer", (("variant", "rows_async"),), extra_ctas=True),
    Config("jit/rows_async_small", "jit.one_layer", (("variant", "rows_async_small"),)),
    Config("kernel/loop", "kernel.triton_uva", (("stages", 0),), extra_ctas=True),
    Config("kernel/stages3", "kernel.triton_uva", (("tile_words", 1024), ("stages", 3))),
]
SHAPE_NAMES = ("deepseek-mla", "llama-8b")
LAYOUTS = ("page_first", "layer_first", "page_first_direct")
TOKENS = (4096, 32768)
#: Tokens of the pools the exactness phase compares whole (real layer counts, so real strides).
EXACT_TOKENS = 2048
#: Overlap phase: per layer, this many [2048 x 4096] @ [4096 x 14336] bf16 GEMMs (~llama-8b prefill of
#: 2048 new tokens): compute-bound beside 8192 cached tokens, transfer-bound beside 32768.
GEMMS_PER_LAYER = 4


# ---- the clock and the device ------------------------------------------------------------------


class Env:
    """Where the sweep runs: CUDA, or the CPU under the interpreter (``--dry-run``: times are placeholders)."""

    def __init__(self, dry_run: bool) -> None:
        self.dry = dry_run
        self.device = "cpu" if dry_run else "cuda"
        self.t0 = time.perf_counter()

    def sync(self) -> None:
        if not self.dry:
            torch.cuda.synchronize()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def isolated(self, fn: Callable[[], None], reps: int = 10) -> float:
        """Median seconds of one call between two events on an idle stream (host submission included).

        ``hicache bench``'s clock (and the issue's figures): the first event is reached at once, then
        the GPU waits for the host to submit the launch.
        """
        if self.dry:
            fn()
            return _wall(fn)
        return Timer(warmup=1, min_reps=reps, max_reps=reps, budget_s=60.0)(fn)  # exactly reps

    def queued(self, calls: list[Callable[[], None]], trials: int = 5) -> float:
        """Median GPU seconds per call, ``calls`` queued back to back behind a GPU sleep (no host time shows)."""
        if self.dry:
            for call in calls[:2]:
                call()
            return _wall(calls[0])
        return queued_seconds(calls, trials)


def _wall(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return max(time.perf_counter() - t, 1e-9)


def fill_random(tensors, device: str) -> None:
    """Random bytes, drawn on the GPU in chunks and copied (fast even for GBs of pinned host pool)."""
    chunk = 1 << 28
    for t in tensors:
        flat = t.reshape(-1).view(torch.uint8)
        for start in range(0, flat.numel(), chunk):
            part = flat[start : start + chunk]
            part.copy_(torch.randint(0, 256, part.shape, dtype=torch.uint8, device=device))


def random_pages(num_pages: int, count: int, gen: torch.Generator, first: int = 0) -> torch.Tensor:
    """Token slots of ``count`` distinct random pages of 64 in ``[first, num_pages)``, pages in random order."""
    pages = torch.randperm(num_pages - first, generator=gen)[:count] + first
    return (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)


# ---- pools -----------------------------------------------------------------------------------------


class Pools:
    """One (shape, layout): a device pool and a host pool (real layer counts), and the configs bound to the plan."""

    def __init__(self, env: Env, shape_name: str, layout: str, tokens: int, layers: int | None) -> None:
        self.env, self.shape_name, self.layout = env, shape_name, layout
        self.shape = SHAPES[shape_name]
        self.tokens = tokens
        self.dev = self.shape.device_pool(tokens + 2 * PAGE, page_size=PAGE, device=env.device, layers=layers)
        self.host = hc.make_host_pool(self.dev, layout=layout, io_backend="reference", size=tokens + 2 * PAGE,
                                      operations=(), validate=False)  # fmt: skip
        self.plan = self.host.plan
        self.layers = self.plan.num_layers
        self.item_bytes = self.shape.item_bytes()
        self.device_tensors = list({id(t): t for p in self.plan.parts for t in p.device_layers}.values())
        self.host_tensors = list(self.plan.host_buffers.values())
        fill_random(self.device_tensors + self.host_tensors, env.device)
        self.gen = torch.Generator().manual_seed(1)
        self.impls: dict[str, object] = {}
        registry = hc.get_registry()
        for config in CONFIGS:
            cls = registry.implementations.get(config.impl)
            if cls is None:
                continue
            try:
                impl = cls(self.plan)
                config.apply(impl)
            except Exception as exc:  # noqa: BLE001 - a variant that cannot bind is reported, not fatal
                print(f"   {config.name}: cannot bind: {exc}")
                continue
            self.impls[config.name] = impl

    def indices(self, tokens: int, *, sequential: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        host_pages = self.plan.num_items // PAGE
        dev_pages = self.plan.min_device_rows // PAGE
        n = tokens // PAGE
        if sequential:
            h = torch.arange(n * PAGE)
            d = torch.arange(n * PAGE) + PAGE
        else:
            h = random_pages(host_pages, n, self.gen)
            d = random_pages(dev_pages, n, self.gen, first=1)
        return h.to(self.env.device), d.to(self.env.device)

    def moved(self, tokens: int, op: str) -> int:
        return tokens * self.item_bytes * (self.layers if op == BACKUP_ALL else 1)


def run_op(impl, op: str, h, d, layer: int) -> None:
    if op == LOAD:
        impl.load_to_device_per_layer(h, d, layer)
    elif op == BACKUP:
        impl.backup_from_device_per_layer(h, d, layer)
    else:
        impl.backup_from_device_all_layer(h, d)


def op_call(impl, op: str, h, d, layer: int) -> Callable[[], None]:
    """A closure running one operation (bound now, so loops may build many)."""
    return lambda: run_op(impl, op, h, d, layer)


def copy_call(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
    return lambda: dst.copy_(src, non_blocking=True)


def ops_of(config: Config) -> tuple[str, ...]:
    return (LOAD, BACKUP, BACKUP_ALL) if config.impl == "kernel.triton_uva" else (LOAD, BACKUP)


# ---- phase 1: precompile --------------------------------------------------------------------------


def _precompile_worker(jobs: list[tuple[str, str, str]]) -> list[str]:
    """In a fresh process: compile the given (config, shape, layout) kernels for sm_90 into Triton's disk cache."""
    sys.path.insert(0, str(HERE))
    os.environ.pop("TRITON_INTERPRET", None)
    from kernel_aot import TargetOnlyDriver, compile_impl
    from triton.runtime import driver

    driver.set_active(TargetOnlyDriver(90))
    registry = hc.get_registry()
    done = []
    for config_name, shape_name, layout in jobs:
        config = next(c for c in CONFIGS if c.name == config_name)
        dev = SHAPES[shape_name].device_pool(256, page_size=PAGE, device="cpu")
        host = hc.make_host_pool(dev, layout=layout, io_backend="reference", size=256, operations=())
        impl = registry.implementations[config.impl](host.plan)
        config.apply(impl)
        rows = compile_impl(impl, config.name, None, quiet=True)
        done += [f"{config_name} {shape_name} {layout}: {r.get('error', 'ok')}" for r in rows]
    return done


def precompile(workers: int, shapes, layouts, timeout_s: float) -> dict:
    """Fill Triton's disk cache in parallel processes (the main process then loads instead of compiling)."""
    import concurrent.futures as cf
    import multiprocessing as mp

    jobs = [(c.name, s, lay) for c in CONFIGS for s in shapes for lay in layouts]
    chunks = [jobs[i::workers] for i in range(workers)]
    t0 = time.perf_counter()
    results: list[str] = []
    try:
        with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
            futures = [pool.submit(_precompile_worker, chunk) for chunk in chunks if chunk]
            for future in cf.as_completed(futures, timeout=timeout_s):
                results += future.result()
    except Exception as exc:  # noqa: BLE001 - the main process compiles what is missing
        print(f"   precompile stopped: {exc!r}")
    seconds = time.perf_counter() - t0
    failed = [r for r in results if not r.endswith(": ok")]
    print(f"   {len(results)} kernels in {seconds:.1f} s with {workers} processes; {len(failed)} failed to compile")
    for line in failed[:10]:
        print(f"     {line[:200]}")
    return {"seconds": seconds, "kernels": len(results), "failed": failed}


# ---- phase 2: the ceiling -------------------------------------------------------------------------


def ceiling(env: Env, nbytes: int) -> dict[str, float]:
    """GB/s of one contiguous pinned <-> device ``cudaMemcpyAsync`` of ``nbytes``, each direction."""
    if env.dry:
        return {LOAD: 1.0, BACKUP: 1.0, "bytes": nbytes}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    reps = 3 if nbytes >= 1 << 30 else 8
    h2d = env.queued([copy_call(dev, host)] * reps)
    d2h = env.queued([copy_call(host, dev)] * reps)
    return {LOAD: nbytes / h2d / 1e9, BACKUP: nbytes / d2h / 1e9, "bytes": nbytes}


# ---- phase 3: exactness ---------------------------------------------------------------------------


def byte_images(env: Env, tensors) -> list[torch.Tensor]:
    """Byte copies, on the GPU (fast to take and compare even for GBs), stream-ordered after the kernels."""
    return [t.reshape(-1).view(torch.uint8).to(env.device, copy=True) for t in tensors]


def restore(tensors, images) -> None:
    for t, image in zip(tensors, images):
        t.reshape(-1).view(torch.uint8).copy_(image)


def clear_drops(plan) -> None:
    try:
        plan.drop_report.raise_if_dropped()
    except DroppedIndicesError:
        pass


def exact(env: Env, pools: Pools, impl, op: str, h, d, hv, dv, layer: int) -> tuple[bool, str]:
    """``op`` moves exactly the valid pairs (every byte of both pools compared) and reports drops iff any."""
    plan = pools.plan
    tensors = pools.host_tensors + pools.device_tensors
    start = byte_images(env, tensors)
    clear_drops(plan)
    seq = plan.drop_report.begin(op, layer, int(h.numel()))
    run_op(impl, op, h, d, layer)
    got = byte_images(env, tensors)
    env.sync()
    flagged = plan.drop_report.dropped()
    clear_drops(plan)
    restore(tensors, start)
    env.sync()
    layers = range(plan.num_layers) if op == BACKUP_ALL else [layer]
    hc.reference_copy(plan, hv.cpu(), dv.to(env.device), layers, to_device=op == LOAD)
    want = byte_images(env, tensors)
    restore(tensors, start)
    env.sync()
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
    dropped = len(hv) < len(h)
    report_ok = flagged == (seq if dropped else 0)
    why = []
    if bad:
        why.append(f"tensors {bad[:4]} differ")
    if not report_ok:
        why.append(f"drop word {flagged}, call {seq}, dropped={dropped}")
    return not why, "; ".join(why)


def check_exact(env: Env, pools: Pools, results: list, skip: set[str]) -> None:
    n = min(1024, pools.tokens // 2)
    h, d = pools.indices(n)
    items = pools.plan.num_items
    bad_h = torch.tensor([-1, items, items + 5, 3, 2**40], device=h.device)
    bad_d = torch.tensor([5, 6, 7, -2, 8], device=h.device)
    hb, db = torch.cat([h, bad_h]), torch.cat([d, bad_d])
    cases = [
        ("int64 bad+good", hb, db),
        ("int64 good", h, d),
        ("int32 bad+good", torch.cat([h, bad_h[:3]]).int(), torch.cat([d, bad_d[:3]]).int()),  # int32-sized bad ones
        ("int32 good", h.int(), d.int()),
    ]
    for name, impl in pools.impls.items():
        config = next(c for c in CONFIGS if c.name == name)
        fails = []
        t0 = time.perf_counter()
        try:
            for op in ops_of(config):
                layer = pools.layers - 1 if op != BACKUP_ALL else 0
                for label, hx, dx in cases:
                    ok, why = exact(env, pools, impl, op, hx, dx, h, d, layer)
                    if not ok:
                        fails.append(f"{op} {label}: {why}")
        except Exception as exc:  # noqa: BLE001 - a variant that crashes is reported and left out
            fails.append(f"raised {exc!r}"[:300])
            traceback.print_exc(limit=3)
        ok = not fails
        if not ok:
            skip.add(name)
        results.append({"phase": "exact", "config": name, "shape": pools.shape_name, "layout": pools.layout,
                        "ok": ok, "failures": fails[:6], "seconds": time.perf_counter() - t0})  # fmt: skip
        print(f"   {'PASS' if ok else 'FAIL'} exact  {name:22} ({time.perf_counter() - t0:.1f} s)"
              + (f"  {fails[0][:160]}" if fails else ""))  # fmt: skip


# ---- phase 4: timing ------------------------------------------------------------------------------


def time_transfers(env: Env, pools: Pools, link: dict, results: list, skip: set[str], budget_left) -> None:
    for tokens in TOKENS:
        if tokens > pools.tokens:
            continue
        h, d = pools.indices(tokens)
        for name, impl in pools.impls.items():
            if name in skip:
                continue
            config = next(c for c in CONFIGS if c.name == name)
            for op in ops_of(config):
                if op == BACKUP_ALL and tokens > 4096:
                    continue
                for ctas in (8, 4, 16) if config.extra_ctas and budget_left() > 120 else (8,):
                    impl.max_ctas = ctas
                    nbytes = pools.moved(tokens, op)
                    single = env.isolated(op_call(impl, op, h, d, 0), reps=5 if nbytes > 1 << 27 else 10)
                    batch = max(4, min(32, int(2e-3 / max(single, 1e-6))))
                    calls = [op_call(impl, op, h, d, (i * 7) % pools.layers) for i in range(batch)]
                    queued = env.queued(calls)
                    frac_q = nbytes / queued / 1e9 / link[LOAD if op == LOAD else BACKUP]
                    frac_i = nbytes / single / 1e9 / link[LOAD if op == LOAD else BACKUP]
                    results.append({"phase": "timing", "config": name, "shape": pools.shape_name,
                                    "layout": pools.layout, "tokens": tokens, "operation": op, "max_ctas": ctas,
                                    "bytes": nbytes, "queued_s": queued, "isolated_s": single,
                                    "fraction_queued": frac_q, "fraction_isolated": frac_i})  # fmt: skip
                    print(f"   {name:22} {op[:24]:24} {tokens:>6} tok ctas={ctas:>2}  queued {frac_q:.3f}  "
                          f"isolated {frac_i:.3f}  ({queued * 1e6:8.1f} us)")  # fmt: skip
                impl.max_ctas = 8


def memcpy_at_sizes(env: Env, sizes: set[int], link: dict, results: list) -> None:
    """The copy engine at exactly the bytes of each timed transfer: its own small-size efficiency."""
    for nbytes in sorted(sizes):
        got = ceiling(env, nbytes)
        for op in (LOAD, BACKUP):
            frac = got[op] / link[op]
            results.append({"phase": "memcpy", "bytes": nbytes, "operation": op, "gbps": got[op], "fraction": frac})
        h2d, d2h = got[LOAD] / link[LOAD], got[BACKUP] / link[BACKUP]
        print(f"   memcpy {nbytes / 1e6:8.1f} MB   H2D {h2d:.3f}   D2H {d2h:.3f} of the 2 GiB ceiling")


# ---- phase 5: host time ---------------------------------------------------------------------------


def host_time(env: Env, results: list) -> None:
    """Host time per 64-token load (MLA, page_first): through the pool, direct, and the launch floors beneath."""
    calls = 2000 if not env.dry else 3
    dev = SHAPES["deepseek-mla"].device_pool(4096, page_size=PAGE, device=env.device, layers=4)
    registry = hc.get_registry()

    def per_call(fn) -> float:
        for _ in range(20):
            fn()
        env.sync()
        best = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            best.append((time.perf_counter() - t) / calls)
            env.sync()
        return statistics.median(best) * 1e6

    rows = []
    for config in CONFIGS:
        wanted = ("jit/rows", "jit/rows_async", "kernel/loop")
        if config.impl not in registry.implementations or config.name not in wanted:
            continue
        ops = [LOAD, BACKUP] if config.impl == "jit.one_layer" else list(hc.OPERATIONS)
        host = hc.make_host_pool(dev, layout="page_first", io_backend="kernel", operations=ops, size=4096,
                                 implementation=config.impl, validate=False)  # fmt: skip
        impl = host.implementation_for(LOAD)
        config.apply(impl)
        rows.append(_host_row(env, config.name, host, dev, impl, per_call))
    if not env.dry:
        from host_time import empty_triton_us  # benchmarks/host_time.py, beside this script

        rows.append({"phase": "host", "config": "floor/empty_triton", "direct_us": empty_triton_us()})
        x = torch.zeros(1, device="cuda")
        rows.append({"phase": "host", "config": "floor/torch_add_", "direct_us": per_call(lambda: x.add_(1))})
    for row in rows:
        results.append(row)
        cells = "  ".join(f"{k} {v:.2f}" for k, v in row.items() if k.endswith("_us"))
        print(f"   {row['config']:22} {cells}")


def _host_row(env: Env, name: str, host, dev, impl, per_call) -> dict:
    h = torch.arange(64, device=env.device) + 128
    d = torch.arange(64, device=env.device) + 64
    pool_us = per_call(lambda: host.load_to_device_per_layer(dev, h, d, 1, "kernel"))
    direct_us = per_call(op_call(impl, LOAD, h, d, 1))
    row = {"phase": "host", "config": name, "through_pool_us": pool_us, "direct_us": direct_us}
    group = impl._groups[0]
    fast = group.fast.get((True, h.dtype, d.dtype))
    if fast is not None:
        # The floor of this kernel's launch: Triton's C launcher with every argument prebuilt.
        call, head = fast
        stream = torch.cuda.current_stream().cuda_stream
        args = (impl._anchor_ptr, h.data_ptr(), d.data_ptr(), 1, 1, 64, 1, *group.args[True][1])
        row["triton_c_launch_us"] = per_call(lambda: call(1, 1, 1, stream, *head, *args))
    return row


# ---- phase 6: contiguous reads, phase 7: graphs, phase 8: overlap ---------------------------------


def contiguous(env: Env, pools: Pools, link: dict, results: list, skip: set[str]) -> None:
    """layer_first with sequential indices: each load reads one contiguous slab of the host pool."""
    tokens = min(32768, pools.tokens)
    h, d = pools.indices(tokens, sequential=True)
    for name in ("jit/rows", "jit/rows_async", "kernel/loop"):
        impl = pools.impls.get(name)
        if impl is None or name in skip:
            continue
        for op in (LOAD, BACKUP):
            calls = [op_call(impl, op, h, d, layer) for layer in range(min(8, pools.layers))]
            frac = pools.moved(tokens, op) / env.queued(calls) / 1e9 / link[op]
            results.append({"phase": "contiguous", "config": name, "shape": pools.shape_name, "tokens": tokens,
                            "operation": op, "fraction_queued": frac})  # fmt: skip
            print(f"   contiguous {name:18} {op[:24]:24} {tokens:>6} tok  queued {frac:.3f}")


def graph(env: Env, pools: Pools, results: list, skip: set[str]) -> None:
    """Capture one load per variant in a CUDA graph; replays must move the same bytes as the reference."""
    if env.dry:
        return
    h, d = pools.indices(4096)
    for name in ("jit/rows", "jit/rows_async", "kernel/loop"):
        impl = pools.impls.get(name)
        if impl is None or name in skip:
            continue
        row = {"phase": "graph", "config": name}
        try:
            run_op(impl, LOAD, h, d, 2)  # compile and cache the launcher outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                run_op(impl, LOAD, h, d, 2)
            tensors = pools.device_tensors
            fill_random(tensors, "cuda")
            start = byte_images(env, tensors)
            g.replay()
            got = byte_images(env, tensors)
            restore(tensors, start)
            torch.cuda.synchronize()
            hc.reference_copy(pools.plan, h.cpu(), d, [2], to_device=True)
            want = byte_images(env, tensors)
            row["exact"] = all(torch.equal(a, b) for a, b in zip(got, want))
            t = time.perf_counter()
            for _ in range(200):
                g.replay()
            row["replay_host_us"] = (time.perf_counter() - t) / 200 * 1e6
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001
            row["error"] = repr(exc)[:300]
        results.append(row)
        print(f"   graph {name:18} {row}")


class Overlap:
    """Per-layer prefill GEMMs on the current stream; per-layer loads on a side stream, each GEMM layer waiting
    for its layer's load (as a server's layer-done counter)."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.a = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16)
        self.side = torch.cuda.Stream()

    def gemms(self, events=None, times=None) -> None:
        for layer in range(self.layers):
            if events is not None:
                torch.cuda.current_stream().wait_event(events[layer])
            if times is not None:
                times[layer][0].record()
            for _ in range(GEMMS_PER_LAYER):
                self.a @ self.b  # noqa: B018 - the work is the point
            if times is not None:
                times[layer][1].record()

    def loads(self, impl, h, d) -> None:
        for layer in range(self.layers):
            impl.load_to_device_per_layer(h, d, layer)

    def together(self, impl, h, d) -> list:
        events = [torch.cuda.Event() for _ in range(self.layers)]
        times = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                 for _ in range(self.layers)]  # fmt: skip
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            for layer in range(self.layers):
                impl.load_to_device_per_layer(h, d, layer)
                events[layer].record()
        self.gemms(events, times)
        return times

    @staticmethod
    def timed(fn) -> tuple[float, object]:
        fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        out = fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / 1e3, out


def overlap(env: Env, results: list, skip: set[str], budget_left) -> None:
    """Layer-wise loads (side stream) under per-layer prefill GEMMs: GEMM slowdown and fraction of the ideal."""
    if env.dry:
        return
    shape = SHAPES["llama-8b"]
    cls = hc.get_registry().implementations.get("jit.one_layer")
    for cached in (8192, 32768):
        dev = shape.device_pool(cached + 2 * PAGE, page_size=PAGE, device="cuda")
        host = hc.make_host_pool(dev, layout="page_first", io_backend="reference", size=cached + 2 * PAGE,
                                 operations=())  # fmt: skip
        fill_random(list(host.plan.host_buffers.values()), "cuda")
        bench = Overlap(host.plan.num_layers)
        gen = torch.Generator().manual_seed(3)
        h = random_pages(host.plan.num_items // PAGE, cached // PAGE, gen).cuda()
        d = random_pages(host.plan.min_device_rows // PAGE, cached // PAGE, gen, first=1).cuda()
        alone, _ = bench.timed(bench.gemms)
        for name in ("jit/rows", "jit/rows_async"):
            if cls is None or name in skip or budget_left() < 30:
                continue
            impl = cls(host.plan)
            next(c for c in CONFIGS if c.name == name).apply(impl)
            for ctas in (4, 8):
                impl.max_ctas = ctas
                load_alone, _ = bench.timed(functools.partial(bench.loads, impl, h, d))
                total, times = bench.timed(functools.partial(bench.together, impl, h, d))
                gemm_time = sum(s.elapsed_time(e) for s, e in times) / 1e3
                row = {"phase": "overlap", "config": name, "cached_tokens": cached, "max_ctas": ctas,
                       "gemm_alone_s": alone, "load_alone_s": load_alone, "overlapped_s": total,
                       "gemm_in_overlap_s": gemm_time, "gemm_slowdown": gemm_time / alone - 1,
                       "fraction_of_ideal": max(alone, load_alone) / total}  # fmt: skip
                results.append(row)
                slow = row["gemm_slowdown"] * 100
                print(f"   overlap {name:18} cached={cached:>6} ctas={ctas}  GEMMs +{slow:5.1f}%  "
                      f"fraction of ideal {row['fraction_of_ideal']:.3f}")  # fmt: skip
        del dev, host, bench
        torch.cuda.empty_cache()


# ---- the table ------------------------------------------------------------------------------------


def table(results: list) -> str:
    lines = []
    timing = [r for r in results if r["phase"] == "timing" and r["max_ctas"] == 8]
    names = [c.name for c in CONFIGS if any(r["config"] == c.name for r in timing)]
    short = {n: n.split("/", 1)[1][:9] if n.startswith("jit/") else "K" + n.split("/", 1)[1][:8] for n in names}
    lines.append("fraction of the ceiling at 8 CTAs, queued (GPU time per call); isolated for jit/rows in [ ]; "
                 "pf page_first, lf layer_first, pfd page_first_direct; bk1 per-layer backup, bkall all layers")
    lines.append(f"{'shape':5} {'layout':9} {'op':6} {'tok':>5}  " + " ".join(f"{short[n]:>9}" for n in names)
                 + "   [rows iso]")  # fmt: skip
    keys = sorted({(r["shape"], r["layout"], r["operation"], r["tokens"]) for r in timing},
                  key=lambda k: (k[0], k[1], k[2], k[3]))  # fmt: skip
    for shape, layout, op, tokens in keys:
        cells = []
        iso = ""
        for n in names:
            match = [r for r in timing if (r["config"], r["shape"], r["layout"], r["operation"], r["tokens"])
                     == (n, shape, layout, op, tokens)]  # fmt: skip
            cells.append(f"{match[0]['fraction_queued']:9.3f}" if match else f"{'-':>9}")
            if match and n == "jit/rows":
                iso = f"   [{match[0]['fraction_isolated']:.3f}]"
        opname = {LOAD: "load", BACKUP: "bk1", BACKUP_ALL: "bkall"}[op]
        lay = {"page_first": "pf", "layer_first": "lf", "page_first_direct": "pfd"}.get(layout, layout[:9])
        lines.append(f"{shape[:5]:5} {lay:9} {opname:6} {tokens:>5}  " + " ".join(cells) + iso)
    for r in results:
        if r["phase"] == "exact" and not r["ok"]:
            lines.append(f"FAILED exact: {r['config']} {r['shape']} {r['layout']}: {r['failures'][:2]}")
    host = [r for r in results if r["phase"] == "host"]
    if host:
        cells = [f"{r['config']} " + "/".join(f"{v:.1f}" for k, v in r.items() if k.endswith("_us")) for r in host]
        lines.append("host us per 64-token load (pool/direct/C launch): " + "; ".join(cells))
    over = [r for r in results if r["phase"] == "overlap"]
    if over:
        lines.append("overlap (GEMM slowdown %, fraction of ideal): " + "; ".join(
            f"{r['config']}@{r['max_ctas']} {r['cached_tokens']}: +{r['gemm_slowdown'] * 100:.1f}% "
            f"{r['fraction_of_ideal']:.2f}" for r in over))  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or str(HERE / "results"))
    p.add_argument("--shapes", default=",".join(SHAPE_NAMES))
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--configs", default="", help="comma-separated config names (default: all)")
    p.add_argument("--budget-s", type=float, default=330.0, help="wall-clock budget; optional phases are trimmed")
    p.add_argument("--precompile", type=int, default=-1, help="worker processes (0: none; default: cores - 2)")
    p.add_argument("--skip", default="", help="phases to skip: precompile,memcpy,contiguous,graph,overlap,host")
    p.add_argument("--dry-run", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny pools, no real timing")
    args = p.parse_args()

    global CONFIGS, TOKENS
    if args.configs:
        wanted = set(args.configs.split(","))
        CONFIGS = [c for c in CONFIGS if c.name in wanted]
    env = Env(args.dry_run)
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--dry-run needs TRITON_INTERPRET=1")
        TOKENS = (128, 256)
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device (use --dry-run on a CPU)")
    skip_phases = set(args.skip.split(",")) - {""}
    shapes = [s for s in args.shapes.split(",") if s]
    layouts = [s for s in args.layouts.split(",") if s]

    def budget_left() -> float:
        return args.budget_s - env.elapsed()

    results: list = []
    info = {"argv": sys.argv, "configs": [c.__dict__ | {"knobs": dict(c.knobs)} for c in CONFIGS]}
    if not env.dry:
        from hicache_core.tools.bench.records import environment

        info["environment"] = environment()
        print(f"{info['environment'].get('gpu')}  torch {torch.__version__}  "
              f"triton {info['environment']['versions'].get('triton')}")  # fmt: skip

    print("== precompile")
    workers = args.precompile if args.precompile >= 0 else max(1, min(12, (os.cpu_count() or 2) - 2))
    if not env.dry and workers and "precompile" not in skip_phases:
        info["precompile"] = precompile(workers, shapes, layouts, timeout_s=min(150.0, budget_left() / 2))

    print("== ceiling (2 GiB pinned memcpy)")
    link = ceiling(env, 2 << 30 if not env.dry else 1 << 20)
    info["ceiling"] = {"h2d_gbps": link[LOAD], "d2h_gbps": link[BACKUP]}
    print(f"   H2D {link[LOAD]:.2f} GB/s   D2H {link[BACKUP]:.2f} GB/s")

    skip: set[str] = set()
    sizes: set[int] = set()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_file = out_dir / "kernel-sweep.json"

    def save() -> None:
        out_file.write_text(json.dumps({**info, "results": results}, indent=1, default=str))

    for shape_name in shapes:
        for layout in layouts:
            if budget_left() < 40:
                print(f"-- {shape_name} {layout}: skipped (budget)")
                continue
            print(f"== {shape_name} {layout}")
            layers = None if not env.dry else 3
            small = Pools(env, shape_name, layout, EXACT_TOKENS if not env.dry else 256, layers)
            check_exact(env, small, results, skip)
            del small
            t0 = time.perf_counter()
            pools = Pools(env, shape_name, layout, max(TOKENS), layers)
            print(f"   timing pools ready in {time.perf_counter() - t0:.1f} s ({pools.layers} layers)")
            time_transfers(env, pools, link, results, skip, budget_left)
            sizes |= {pools.moved(t, LOAD) for t in TOKENS}
            if layout == "layer_first" and "contiguous" not in skip_phases and budget_left() > 60:
                contiguous(env, pools, link, results, skip)
            if shape_name == shapes[0] and layout == layouts[0] and "graph" not in skip_phases:
                graph(env, pools, results, skip)
            save()
            del pools
            if not env.dry:
                torch.cuda.empty_cache()

    if "memcpy" not in skip_phases and budget_left() > 20:
        print("== memcpy at the transfer sizes")
        memcpy_at_sizes(env, sizes, link, results)
    if "host" not in skip_phases and budget_left() > 15:
        print("== host time per 64-token load (us)")
        host_time(env, results)
    if "overlap" not in skip_phases and budget_left() > 40:
        print("== overlap: llama-8b layer-wise loads under prefill GEMMs")
        overlap(env, results, skip, budget_left)
    save()
    print(f"\nwrote {out_file} ({env.elapsed():.0f} s)\n")
    print(table(results))
    return 1 if any(r["phase"] == "exact" and not r["ok"] for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
