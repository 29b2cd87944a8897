"""``hicache bench``: the sweep of ../shared/benchmarks.md, with the ceiling measured in the same run.

Every figure is bytes that crossed the link over wall time between CUDA events
(median of repeats), and is reported as a fraction of a contiguous pinned
``cudaMemcpyAsync`` of 2 GiB measured at the start of the run. Results go to
JSON (one record per row, with the machine, versions and the ceiling) and a PNG
plot. Timings live here, never in tests.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from .demo import fill_random, random_pages
from .dispatch import reasons_for
from .host_pool import make_host_pool
from .implementation import BACKUP_ALL, BACKUP_LAYER, LOAD, Implementation, TransferRequest
from .progress import progress
from .registry import Registry, get_registry
from .shapes import SHAPES, ModelShape

TOKENS = (64, 512, 4096, 32768)
PAGE_SIZES = (1, 16, 64)
SM_BUDGETS = (2, 4, 8, 16, None)
OPS = (LOAD, BACKUP_ALL, BACKUP_LAYER)


@dataclass
class Timer:
    """Median wall time of a CUDA callable between events, repeated within a time box."""

    warmup: int = 2
    min_reps: int = 3
    max_reps: int = 20
    budget_s: float = 0.25

    def __call__(self, fn: Callable[[], None]) -> float:
        t0 = time.perf_counter()
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        slow = (time.perf_counter() - t0) / max(self.warmup, 1) > self.budget_s
        times: list[float] = []
        start_wall = time.perf_counter()
        while len(times) < self.max_reps:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
            if (slow or len(times) >= self.min_reps) and time.perf_counter() - start_wall > self.budget_s:
                break
        return statistics.median(times)


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
        from .hookspecs import hookimpl

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


def environment() -> dict:
    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    env = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "versions": {
            d: version(d)
            for d in ("torch", "triton", "hicache-core", "hicache-direct", "hicache-kernel", "hicache-jit")
        },  # fmt: skip
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env |= {"gpu": props.name, "sms": props.multi_processor_count, "cuda": torch.version.cuda}
    return env


class Case:
    """One pool (shape, layout, page size) with every implementation that claims it bound to it."""

    def __init__(self, registry: Registry, shape: ModelShape, layout: str, page_size: int, tokens: int, impls):
        self.shape, self.layout, self.page_size = shape, layout, page_size
        device_tokens = 2 * tokens + page_size
        self.dev = shape.device_pool(device_tokens, page_size=page_size, device="cuda")
        self.host = make_host_pool(
            self.dev, layout=layout, io_backend="reference", size=tokens, registry=registry, operations=()
        )
        gen = torch.Generator().manual_seed(0)
        fill_random([t for p in self.host.plan.parts for t in p.device_layers], gen)
        self.items_are_pages = self.host.geometry.items_are_pages
        self.impls: dict[str, Implementation] = {}
        self.claimed: dict[str, tuple[str, ...]] = {}  # operations each implementation claims here
        for cls in impls:
            decl, geometry = registry.layouts[layout], self.host.geometry
            ops = tuple(op for op in OPS if not reasons_for(cls, TransferRequest(cls.io_backend, op, geometry, decl)))
            if ops:
                self.impls[cls.name] = cls(self.host.plan)
                self.claimed[cls.name] = ops
        self.gen = gen

    def indices(self, tokens: int, impl: Implementation) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.page_size
        host = random_pages(self.host.page_num + 1, tokens // p, p, self.gen) - p  # any host page, random order
        rows = self.host.plan.device_rows  # device pages: rows // p for token pools, rows for page rows
        dev = random_pages(rows if self.items_are_pages else rows // p, tokens // p, p, self.gen)
        if self.items_are_pages:
            host, dev = host[::p] // p, dev[::p] // p
        where = self.host.plan.device if impl.index_device == "device" else torch.device("cpu")
        return host.to(where), dev.to(where)

    def bytes_moved(self, tokens: int, op: str) -> int:
        per_token = self.shape.item_bytes() // (self.page_size if self.items_are_pages else 1)
        return tokens * per_token * (self.host.layer_num if op == BACKUP_ALL else 1)


def _run_op(impl: Implementation, op: str, h: torch.Tensor, d: torch.Tensor) -> Callable[[], None]:
    if op == LOAD:
        return lambda: impl.load_to_device_per_layer(h, d, 0)
    if op == BACKUP_LAYER:
        return lambda: impl.backup_from_device_per_layer(h, d, 0)
    return lambda: impl.backup_from_device_all_layer(h, d)


def host_time_us(impl: Implementation, h: torch.Tensor, d: torch.Tensor, calls: int = 300) -> float:
    """Host-side time per small load: submission cost, with the GPU keeping up."""
    for _ in range(10):
        impl.load_to_device_per_layer(h, d, 0)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        impl.load_to_device_per_layer(h, d, 0)
    elapsed = time.perf_counter() - t
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def gemm_interference(impl: Implementation, fn: Callable[[], None], bytes_per_call: int) -> dict[str, float]:
    """bf16 GEMM slowdown with transfers running on another stream, and the transfer's GB/s meanwhile."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    compute, copy = torch.cuda.Stream(), torch.cuda.Stream()
    timer = Timer(warmup=2, min_reps=5, max_reps=10, budget_s=0.5)
    with torch.cuda.stream(compute):
        alone = timer(lambda: [a @ b for _ in range(10)])
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    with torch.cuda.stream(copy):
        events[2].record()
        for _ in range(200):  # ~10-20 ms of transfers: overlaps the 10 GEMMs below
            fn()
        events[3].record()
    with torch.cuda.stream(compute):
        events[0].record()
        for _ in range(10):
            a @ b
        events[1].record()
    torch.cuda.synchronize()
    together = events[0].elapsed_time(events[1]) / 1e3
    copy_s = events[2].elapsed_time(events[3]) / 1e3
    return {
        "gemm_alone_s": alone,
        "gemm_with_transfer_s": together,
        "gemm_slowdown": together / alone - 1,
        "transfer_gbps_beside_gemm": 200 * bytes_per_call / copy_s / 1e9,
    }


def run_bench(out: str = "benchmarks/results", quick: bool = False, only: str | None = None) -> int:
    if not torch.cuda.is_available():
        overhead = measure_dispatch_overhead()
        print(f"No GPU: measured the core dispatch overhead only: {overhead['overhead_us']:.3f} us per call")
        _write(Path(out), "dispatch-cpu", {"environment": environment(), "dispatch_overhead": overhead}, [])
        return 0
    registry = get_registry()
    wanted = set(only.split(",")) if only else None
    impls = [c for n, c in sorted(registry.implementations.items())
             if c.auto_selectable and (wanted is None or n in wanted)]  # fmt: skip
    env = environment()
    ceiling = measure_ceiling()
    overhead = measure_dispatch_overhead(50_000 if quick else 200_000)
    print(f"ceiling: H2D {ceiling['h2d_gbps']:.1f} GB/s, D2H {ceiling['d2h_gbps']:.1f} GB/s; "
          f"core dispatch overhead {overhead['overhead_us']:.2f} us")  # fmt: skip
    shapes = [SHAPES["deepseek-mla"], SHAPES["llama-8b"]] if quick else list(SHAPES.values())
    token_list = (64, 4096) if quick else TOKENS
    plan = []
    for shape in shapes:
        for layout, decl in sorted(registry.layouts.items()):
            if shape.kind not in decl.pool_kinds:
                continue
            # The page-size effect is measured on page_first only: the other layouts follow it.
            small_pages = shape.kind != "page_rows" and not quick and layout == "page_first"
            page_sizes = PAGE_SIZES if small_pages else (64,)
            for p in page_sizes:
                tokens = token_list if p == 64 else (4096,)
                plan.append((shape, layout, p, tokens))
            if not quick and (shape.name, layout) == ("llama-8b", "page_first_direct"):
                # pages of 256 and 512 KiB per layer and part: the copy engine's regime (its bar)
                plan += [(shape, layout, p, (4096, 32768)) for p in (128, 256)]
    records: list[dict] = []
    timer = Timer(budget_s=0.1)
    for shape, layout, p, token_counts in progress(plan, len(plan), "pools"):
        case = Case(registry, shape, layout, p, max(token_counts), impls)
        for name, impl in case.impls.items():
            if not hasattr(impl, "max_ctas"):
                budgets: tuple = (None,)
            elif p == 64 and layout == "page_first":
                budgets = SM_BUDGETS  # the full SM-budget sweep, on one layout per shape
            else:
                budgets = (8, None)  # the bars: at most 8 CTAs, and unlimited
            for tokens in token_counts:
                h, d = case.indices(tokens, impl)
                for op in case.claimed[name]:
                    for budget in budgets if tokens >= 4096 else (8,) if budgets[0] is not None else (None,):
                        if hasattr(impl, "max_ctas"):
                            impl.max_ctas = budget if budget is not None else 0
                        seconds = timer(_run_op(impl, op, h, d))
                        nbytes = case.bytes_moved(tokens, op)
                        link = ceiling["h2d_gbps"] if op == LOAD else ceiling["d2h_gbps"]
                        records.append({
                            "implementation": name, "io_backend": impl.io_backend, "shape": shape.name,
                            "pool_kind": shape.kind, "layout": layout, "page_size": p, "tokens": tokens,
                            "operation": op, "layers": case.host.layer_num if op == BACKUP_ALL else 1,
                            "max_ctas": getattr(impl, "max_ctas", None), "bytes": nbytes, "seconds": seconds,
                            "gbps": nbytes / seconds / 1e9, "fraction_of_ceiling": nbytes / seconds / 1e9 / link,
                        })  # fmt: skip
                if tokens == 64 and LOAD in case.claimed[name]:
                    if hasattr(impl, "max_ctas"):
                        impl.max_ctas = 8
                    records.append({
                        "implementation": name, "shape": shape.name, "layout": layout, "page_size": p,
                        "tokens": 64, "operation": LOAD, "metric": "host_time_us",
                        "host_time_us": host_time_us(impl, h, d),
                    })  # fmt: skip
        if shape.name == "deepseek-mla" and layout in ("page_first", "layer_first") and p == 64:
            for name, impl in case.impls.items():
                if LOAD not in case.claimed[name]:
                    continue
                h, d = case.indices(4096, impl)
                for budget in (8, None) if hasattr(impl, "max_ctas") else (None,):
                    if hasattr(impl, "max_ctas"):
                        impl.max_ctas = budget or 0
                    result = gemm_interference(impl, _run_op(impl, LOAD, h, d), case.bytes_moved(4096, LOAD))
                    records.append({"implementation": name, "shape": shape.name, "layout": layout, "page_size": p,
                                    "tokens": 4096, "operation": LOAD, "metric": "gemm_interference",
                                    "max_ctas": budget, **result})  # fmt: skip
        del case
        torch.cuda.empty_cache()
        # Written after every pool, so a run cut short by a time limit still leaves its results.
        _write(Path(out), "quick" if quick else "sweep", {"environment": env, "ceiling": ceiling,
               "dispatch_overhead": overhead, "complete": False}, records, plot=False)  # fmt: skip
    summary = _summary(records)
    print(summary)
    path = _write(Path(out), "quick" if quick else "sweep",
                  {"environment": env, "ceiling": ceiling, "dispatch_overhead": overhead, "summary": summary,
                   "complete": True},
                  records)  # fmt: skip
    print(f"wrote {path}")
    return 0


def _summary(records: list[dict]) -> str:
    """The README table: per implementation, operation and shape, the best layout's fraction at >= 4096 tokens."""
    rows = {}
    for r in records:
        if "gbps" not in r or r["tokens"] < 4096 or r["page_size"] < 64:
            continue
        key = (r["implementation"], r["operation"], r["shape"], f"{r['layout']} p{r['page_size']}")
        budget = r.get("max_ctas")
        col = "unlimited" if not budget else ("8 CTAs" if budget == 8 else None)
        if col:
            rows.setdefault(key, {}).setdefault(col, []).append(r["fraction_of_ceiling"])
    lines = ["| implementation | operation | shape | layout | fraction, 8 CTAs | fraction, unlimited |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for (impl, op, shape, layout), cols in sorted(rows.items()):
        small, big = (_span(cols.get(c)) for c in ("8 CTAs", "unlimited"))
        lines.append(f"| {impl} | {op} | {shape} | {layout} | {small} | {big} |")
    return "\n".join(lines)


def _span(values: list[float] | None) -> str:
    """``min-max`` over the token counts >= 4096 (``-`` where not measured)."""
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return f"{lo:.2f}" if round(lo, 2) == round(hi, 2) else f"{lo:.2f}-{hi:.2f}"


def _write(out: Path, name: str, meta: dict, records: list[dict], plot: bool = True) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({**meta, "records": records}, indent=1, default=str))
    if records and plot:
        _plot(out / f"{name}.png", records)
    return path


def _plot(path: Path, records: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the plot is a convenience; the JSON is the result
        print("matplotlib not installed: no plot")
        return
    rows = [r for r in records if "gbps" in r and r["page_size"] == 64 and r["max_ctas"] in (None, 0, 8)]
    panels = sorted({(r["shape"], r["operation"]) for r in rows})
    cols = 3
    fig, axes = plt.subplots((len(panels) + cols - 1) // cols, cols, figsize=(6 * cols, 4 * len(panels) // cols + 4))
    for ax, (shape, op) in zip(axes.flat, panels):
        lines = sorted({(r["implementation"], r["layout"], r["max_ctas"]) for r in rows
                        if (r["shape"], r["operation"]) == (shape, op)})  # fmt: skip
        for impl, layout, budget in lines:
            pts = sorted((r["tokens"], r["gbps"]) for r in rows if (r["shape"], r["operation"], r["implementation"],
                         r["layout"], r["max_ctas"]) == (shape, op, impl, layout, budget))  # fmt: skip
            label = f"{impl} {layout}" + (f" ({budget} CTAs)" if budget else "")
            ax.plot([t for t, _ in pts], [g for _, g in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{shape}: {op}", fontsize=9)
        ax.set_xlabel("tokens per call")
        ax.set_ylabel("GB/s")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
