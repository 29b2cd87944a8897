"""``hicache bench``: the sweep of ../shared/benchmarks.md, with the ceiling measured in the same run.

Every figure is bytes that crossed the link over wall time between CUDA events
(median of repeats), and is reported as a fraction of a contiguous pinned
``cudaMemcpyAsync`` of 2 GiB measured at the start of the run. Results go to
JSON (one record per row, with the machine, versions and the ceiling) and a PNG
plot. Timings live here, never in tests.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial
from importlib import metadata
from pathlib import Path

import torch

from .bench_clock import Timer, batch_for, host_us, queued_seconds
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
        # Every device page is used (in random order); the host pool is as large as the device pool.
        self.dev = shape.device_pool(tokens, page_size=page_size, device="cuda")
        self.host = make_host_pool(
            self.dev, layout=layout, io_backend="reference", size=max(tokens, self.dev.size), registry=registry,
            operations=(),
        )  # fmt: skip
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


#: Settings of the copy engine's submission measured beside its default (knobs of hicache_direct's CudaCopier).
DIRECT_VARIANTS: dict[str, dict] = {
    "default": {},
    "streams2": {"streams": 2},
    "max_batch8": {"max_batch": 8},
    "max_batch16": {"max_batch": 16},
    "max_batch64": {"max_batch": 64},
    "unbounded_batch": {"max_batch": 0},
    "no_overlap_hint": {"prefer_overlap": False},
    "one_by_one": {"batch": False},
    "batch_2d": {"batch_2d": True},
}


def _storable(shape: ModelShape, layout) -> bool:
    """Whether ``layout`` can store pools of ``shape`` (a layout's kinds, a split it needs)."""
    return TransferRequest("reference", LOAD, shape.geometry(page_size=64), layout).storable


def _variants(impl: Implementation, tokens: int) -> tuple[str, ...]:
    copier = getattr(impl, "copier", None)
    if copier is None or not hasattr(copier, "streams") or tokens < 4096:
        return ("default",)
    names = [v for v in DIRECT_VARIANTS if v != "batch_2d"]
    # 2-D copies as one cudaMemcpy3DBatchAsync: only where there are 2-D copies, and only when asked
    # (scripts/gpu/direct-check.sh asks once its byte-exact check of that path has passed).
    if getattr(getattr(impl, "builder", None), "sliced", ()) and os.environ.get("HICACHE_BENCH_BATCH_2D") == "1":
        names.append("batch_2d")
    return tuple(names)


class variant_applied:
    """Set a copier's knobs for the ``with`` block, then restore them."""

    def __init__(self, impl: Implementation, variant: str) -> None:
        self.copier = getattr(impl, "copier", None)
        self.changes = DIRECT_VARIANTS.get(variant, {})
        self.saved: dict = {}

    def __enter__(self):
        for key, value in self.changes.items():
            self.saved[key] = getattr(self.copier, key)
            setattr(self.copier, key, value)
        return self

    def __exit__(self, *exc) -> None:
        for key, value in self.saved.items():
            setattr(self.copier, key, value)


def _run_op(impl: Implementation, op: str, h: torch.Tensor, d: torch.Tensor, layer: int = 0) -> Callable[[], None]:
    if op == LOAD:
        return lambda: impl.load_to_device_per_layer(h, d, layer)
    if op == BACKUP_LAYER:
        return lambda: impl.backup_from_device_per_layer(h, d, layer)
    return lambda: impl.backup_from_device_all_layer(h, d)


def _layers_in_turn(layers: int, count: int) -> list[int]:
    """Layer ids for ``count`` queued calls: every layer in a stride, as a layer-by-layer load reads them."""
    return [(i * 7) % layers for i in range(count)]


def time_both(make_call: Callable[[int], Callable[[], None]], layers: int, timer: Timer) -> tuple[float, float]:
    """(isolated seconds of one call, queued GPU seconds per call) of the call ``make_call(layer)`` builds."""
    single = timer(make_call(0))
    calls = [make_call(layer) for layer in _layers_in_turn(layers, batch_for(single))]
    return single, queued_seconds(calls)


def host_time_us(impl: Implementation, h: torch.Tensor, d: torch.Tensor, fresh: bool = False) -> float:
    """Host-side time per small load: submission cost, with the GPU keeping up.

    ``fresh``: a different (equal-valued) pair of index tensors every call, so nothing an
    implementation keeps from an earlier call's indices applies."""
    if not fresh:
        return host_us(lambda: impl.load_to_device_per_layer(h, d, 0))
    pairs = itertools.cycle([(h.clone(), d.clone()) for _ in range(1000)])
    return host_us(lambda: impl.load_to_device_per_layer(*next(pairs), 0))


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


def run_bench(out: str = "benchmarks/results", quick: bool = False, only: str | None = None,
              overlap: bool = False, name: str | None = None, tokens: tuple[int, ...] | None = None,
              shapes: tuple[str, ...] | None = None, layouts: tuple[str, ...] | None = None,
              anchor_module: str | None = None, modes: tuple[str, ...] | None = None) -> int:  # fmt: skip
    """The sweep: every implementation on every pool it claims, both clocks, the ceilings, SGLang's anchor."""
    from .bench_anchor import find_anchor

    if overlap:
        return run_overlap(out=out, quick=quick, only=only, name=name, modes=modes, layouts=layouts)
    if not torch.cuda.is_available():
        overhead = measure_dispatch_overhead()
        print(f"No GPU: measured the core dispatch overhead only: {overhead['overhead_us']:.3f} us per call")
        _write(Path(out), "dispatch-cpu", {"environment": environment(), "dispatch_overhead": overhead}, [])
        return 0
    registry = get_registry()
    impls = _implementations(registry, only)
    env = environment()
    ceiling = measure_ceiling()
    overhead = measure_dispatch_overhead(50_000 if quick else 200_000)
    anchor = find_anchor(anchor_module)
    print(f"ceiling: H2D {ceiling['h2d_gbps']:.1f} GB/s, D2H {ceiling['d2h_gbps']:.1f} GB/s; "
          f"core dispatch overhead {overhead['overhead_us']:.2f} us; SGLang anchor: "
          f"{anchor.module if anchor.available else 'skipped (' + str(anchor.why_not) + ')'}")  # fmt: skip
    file_name = name or ("quick" if quick else "sweep")
    meta = {"environment": env, "ceiling": ceiling, "dispatch_overhead": overhead, "anchor": anchor.describe()}
    if shapes:
        shape_list = [SHAPES[s] for s in shapes]
    else:
        shape_list = [SHAPES["deepseek-mla"], SHAPES["llama-8b"]] if quick else list(SHAPES.values())
    token_list = tokens or ((64, 4096) if quick else TOKENS)
    plan = []
    for shape in shape_list:
        for layout, decl in sorted(registry.layouts.items()):
            if not _storable(shape, decl) or (layouts and layout not in layouts):
                continue
            # The page-size effect is measured on page_first only: the other layouts follow it.
            small_pages = not shape.declaration().items_are_pages and not quick and layout == "page_first"
            page_sizes = PAGE_SIZES if small_pages else (64,)
            for p in page_sizes:
                tokens = token_list if p == 64 else (4096,)
                plan.append((shape, layout, p, tokens))
            if not quick and (shape.name, layout) == ("llama-8b", "page_first_direct"):
                # pages of 256 and 512 KiB per layer and part: the copy engine's regime (its bar)
                plan += [(shape, layout, p, (4096, 32768)) for p in (128, 256)]
    records: list[dict] = _ceiling_records(plan, ceiling)
    timer = Timer(budget_s=0.1)
    for shape, layout, p, token_counts in progress(plan, len(plan), "pools"):
        case = Case(registry, shape, layout, p, max(token_counts), impls)
        for impl_name, impl in case.impls.items():
            records += _time_implementation(case, impl_name, impl, token_counts, ceiling, timer)
        if anchor.available:
            records += _time_anchor(case, anchor, token_counts, ceiling, timer)
        if shape.name == "deepseek-mla" and layout in ("page_first", "layer_first") and p == 64:
            records += _gemm_rows(case)
        del case
        torch.cuda.empty_cache()
        # Written after every pool, so a run cut short by a time limit still leaves its results.
        _write(Path(out), file_name, {**meta, "complete": False}, records, plot=False)
    summary = _summary(records)
    print(summary)
    path = _write(Path(out), file_name, {**meta, "summary": summary, "complete": True}, records)
    print(f"wrote {path}")
    return 0


def _implementations(registry: Registry, only: str | None) -> list[type[Implementation]]:
    """The implementations a sweep times: those ``auto`` may pick, or the comma-separated names in ``only``."""
    wanted = set(only.split(",")) if only else None
    return [c for n, c in sorted(registry.implementations.items())
            if c.auto_selectable and (wanted is None or n in wanted)]  # fmt: skip


def _ceiling_records(plan: list, ceiling: dict) -> list[dict]:
    """The SM-copy ceiling (256 MiB) and, at each per-layer load's byte count, the copy engine's and the SM copy's."""
    from .bench_ceilings import ceilings_at_sizes, sm_ceiling

    rows = sm_ceiling(256 << 20, ceiling)
    sizes = {shape.item_bytes() * t for shape, layout, p, tokens in plan if p == 64 for t in tokens if t >= 4096}
    rows += ceilings_at_sizes(sorted(sizes), ceiling)
    for r in rows:
        if r["metric"] == "ceiling_at_size" and r["direction"] == "h2d":
            print(f"  {r['bytes'] / 1e6:7.1f} MB H2D: copy engine {r['memcpy_fraction']:.3f}, SM copy "
                  f"{r['sm_8ctas_fraction']:.3f} at <= 8 CTAs, {r['sm_any_fraction']:.3f} at any")  # fmt: skip
    return rows


def _time_implementation(case: Case, name: str, impl: Implementation, token_counts, ceiling: dict,
                         timer: Timer) -> list[dict]:  # fmt: skip
    """Every claimed operation of one implementation on one pool: both clocks per SM budget, and host time."""
    records = []
    p, layers = case.page_size, case.host.layer_num
    if not hasattr(impl, "max_ctas"):
        budgets: tuple = (None,)
    elif p == 64 and case.layout == "page_first":
        budgets = SM_BUDGETS  # the full SM-budget sweep, on one layout per shape
    else:
        budgets = (8, None)  # the bars: at most 8 CTAs, and unlimited
    for tokens in token_counts:
        h, d = case.indices(tokens, impl)
        for op in case.claimed[name]:
            for budget in budgets if tokens >= 4096 else (8,) if budgets[0] is not None else (None,):
                if hasattr(impl, "max_ctas"):
                    impl.max_ctas = budget if budget is not None else 0
                nbytes = case.bytes_moved(tokens, op)
                link = ceiling["h2d_gbps"] if op == LOAD else ceiling["d2h_gbps"]
                for variant in _variants(impl, tokens):
                    with variant_applied(impl, variant):
                        if tokens >= 4096 and op != BACKUP_ALL:  # one all-layer call outlasts its submission
                            seconds, queued = time_both(partial(_run_op, impl, op, h, d), layers, timer)
                        else:
                            seconds, queued = timer(_run_op(impl, op, h, d)), None
                    row = {
                        "implementation": name, "io_backend": impl.io_backend, "shape": case.shape.name,
                        "pool_kind": case.shape.kind, "layout": case.layout, "page_size": p, "tokens": tokens,
                        "operation": op, "layers": layers if op == BACKUP_ALL else 1,
                        "max_ctas": getattr(impl, "max_ctas", None), "variant": variant, "bytes": nbytes,
                        "seconds": seconds, "gbps": nbytes / seconds / 1e9,
                        "fraction_of_ceiling": nbytes / seconds / 1e9 / link,
                    }  # fmt: skip
                    if queued is not None:
                        row |= {"seconds_queued": queued, "fraction_queued": nbytes / queued / 1e9 / link}
                    records.append(row)
        if tokens == 64 and LOAD in case.claimed[name]:
            if hasattr(impl, "max_ctas"):
                impl.max_ctas = 8
            records.append({
                "implementation": name, "shape": case.shape.name, "layout": case.layout, "page_size": p,
                "tokens": 64, "operation": LOAD, "metric": "host_time_us",
                "host_time_us": host_time_us(impl, h, d),
                # fresh index tensors every call (no reuse of an earlier call's runs or copies)
                "host_time_fresh_us": host_time_us(impl, h, d, fresh=True),
                "through_pool_us": _pool_host_time_us(case, impl, h, d),
            })  # fmt: skip
    if hasattr(impl, "copier") and hasattr(impl.copier, "path"):
        records.append({"implementation": name, "shape": case.shape.name, "layout": case.layout, "page_size": p,
                        "metric": "path", "path": impl.copier.path})  # fmt: skip
    return records


def _pool_host_time_us(case: Case, impl: Implementation, h: torch.Tensor, d: torch.Tensor) -> float:
    """Host time per 64-token load through a host pool bound to ``impl`` (what a server calls)."""
    host = make_host_pool(case.dev, layout=case.layout, io_backend=impl.io_backend, size=case.host.size,
                          implementation=impl.name, operations=(LOAD,), validate=False)  # fmt: skip
    mine = host.implementation_for(LOAD)
    if hasattr(mine, "max_ctas"):
        mine.max_ctas = 8
    us = host_us(lambda: host.load_to_device_per_layer(case.dev, h, d, 1, impl.io_backend))
    host.destroy()
    return us


def _time_anchor(case: Case, anchor, token_counts, ceiling: dict, timer: Timer) -> list[dict]:
    """SGLang's transfer functions on this pool, checked byte for byte first (see hicache_core.bench_anchor)."""
    from .bench_anchor import BLOCK_QUOTAS, AnchorCalls

    if not AnchorCalls.supports(case.host) or case.page_size != 64:
        return []
    calls = AnchorCalls(anchor, case.host, case.dev)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    records = []

    class OnGpu:  # Case.indices places indices where an implementation wants them; SGLang's: the GPU
        index_device = "device"

    for op in (LOAD, BACKUP_ALL):
        base = {"implementation": "sglang." + calls.function(op), "io_backend": "sglang-anchor",
                "shape": case.shape.name, "pool_kind": case.shape.kind, "layout": case.layout,
                "page_size": case.page_size, "operation": op, "variant": "default"}  # fmt: skip
        h, d = case.indices(min(token_counts), OnGpu())
        wrong = calls.moved_right(op, h.long(), d.long(), 1 if op == LOAD else 0)
        if wrong is not None:
            records.append({**base, "metric": "anchor_refused", "why": wrong})
            print(f"  anchor refused: {wrong}")
            continue
        link = ceiling["h2d_gbps"] if op == LOAD else ceiling["d2h_gbps"]
        for tokens in token_counts:
            h, d = (t.long() for t in case.indices(tokens, OnGpu()))
            if tokens == 64 and op == LOAD:
                records.append({**base, "tokens": 64, "metric": "host_time_us",
                                "host_time_us": host_us(calls.call(op, h, d, 1, 8))})  # fmt: skip
                continue
            if tokens < 4096:
                continue
            for quota in BLOCK_QUOTAS:
                blocks = quota or sms
                make = partial(calls.call, op, h, d, block_quota=blocks)
                if op == LOAD:
                    seconds, queued = time_both(make, case.host.layer_num, timer)
                else:
                    seconds, queued = timer(make(0)), None
                nbytes = case.bytes_moved(tokens, op)
                row = {**base, "tokens": tokens, "max_ctas": quota, "blocks": blocks, "bytes": nbytes,
                       "layers": case.host.layer_num if op == BACKUP_ALL else 1,
                       "seconds": seconds, "gbps": nbytes / seconds / 1e9,
                       "fraction_of_ceiling": nbytes / seconds / 1e9 / link}  # fmt: skip
                if queued is not None:
                    row |= {"seconds_queued": queued, "fraction_queued": nbytes / queued / 1e9 / link}
                records.append(row)
    return records


def _gemm_rows(case: Case) -> list[dict]:
    """GEMM slowdown beside each load implementation at 8 CTAs and unlimited (MLA, 4096 tokens)."""
    records = []
    for name, impl in case.impls.items():
        if LOAD not in case.claimed[name]:
            continue
        h, d = case.indices(4096, impl)
        for budget in (8, None) if hasattr(impl, "max_ctas") else (None,):
            if hasattr(impl, "max_ctas"):
                impl.max_ctas = budget or 0
            result = gemm_interference(impl, _run_op(impl, LOAD, h, d), case.bytes_moved(4096, LOAD))
            records.append({"implementation": name, "shape": case.shape.name, "layout": case.layout,
                            "page_size": case.page_size, "tokens": 4096, "operation": LOAD,
                            "metric": "gemm_interference", "max_ctas": budget, **result})  # fmt: skip
    return records


def _summary(records: list[dict]) -> str:
    """The README table: per implementation, operation and shape, the best layout's fraction at >= 4096 tokens."""
    rows = {}
    for r in records:
        if "tokens" not in r or "gbps" not in r or r["tokens"] < 4096 or r["page_size"] < 64 or \
                r.get("variant", "default") != "default":
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
    from .plots import plot_overlap, plot_sweep

    if any("efficiency" in r for r in records):
        plot_overlap(path, records)
    else:
        plot_sweep(path, records)


# ---- hicache bench --overlap ---------------------------------------------------------------------


def _sglang_note() -> dict:
    """Issue 12's anchor: SGLang's own transfer functions, where ``sgl_kernel`` is importable."""
    try:
        import sgl_kernel
    except Exception as exc:  # noqa: BLE001 - any import failure means: no anchor in this run
        return {"sglang": "skipped", "why": f"sgl_kernel is not importable here ({type(exc).__name__}: {exc})"}
    found = sorted(n for n in dir(sgl_kernel) if n.startswith("transfer_kv"))
    return {"sglang": "skipped", "functions_found": found,
            "why": "sgl_kernel is importable, but this benchmark does not call its transfer_kv_* functions yet "
                   "(issue 12): the row lists what this build exports"}  # fmt: skip


def run_overlap(out: str = "benchmarks/results", quick: bool = False, only: str | None = None,
                name: str | None = None, modes: tuple[str, ...] | None = None,
                layouts: tuple[str, ...] | None = None) -> int:  # fmt: skip
    """Layer-wise loads under prefill GEMMs, and all-layer backups under decode (hicache_core.overlap).

    ``modes`` (default: ``sglang`` alone with ``quick``, else both): how the loads are issued,
    :data:`hicache_core.overlap.MODES`."""
    from . import autoselect
    from .dispatch import resolve
    from .overlap import (
        CASES,
        MODELS,
        Streams,
        _median_run,
        decode_backup,
        fill_random_fast,
        prefill_overlap,
        prefill_run,  # fmt: skip
    )

    if not torch.cuda.is_available():
        print("hicache bench --overlap needs a GPU")
        return 1
    registry = get_registry()
    impls = _implementations(registry, only)
    env = environment()
    ceiling = measure_ceiling(1 << 30)
    print(f"ceiling: H2D {ceiling['h2d_gbps']:.1f} GB/s, D2H {ceiling['d2h_gbps']:.1f} GB/s")
    from .overlap import MODES

    modes = tuple(modes or (("sglang",) if quick else MODES))
    budgets = (2, 8, 0) if quick else (2, 4, 8, 16, 0)
    layouts = tuple(layouts or (("page_first_direct",) if quick else ("page_first_direct", "layer_first")))
    reps = 2 if quick else 3
    records: list[dict] = []
    meta = {"environment": env, "ceiling": ceiling, "anchor": _sglang_note(),
            "compute_model": "per layer 2*N*params_per_layer FLOPs as [N, hidden] @ [hidden, 8192] bf16 GEMMs; "
                             "attention left out (hicache_core.overlap)"}  # fmt: skip
    by_model: dict[str, list] = {}
    for case in CASES:
        by_model.setdefault(case[0], []).append(case)
    page = 64
    gen = torch.Generator().manual_seed(0)
    for model_name, cases in by_model.items():
        model = MODELS[model_name]
        shape = SHAPES[model.shape]
        cached = max(c[2] for c in cases)
        dev = shape.device_pool(cached + 2 * page, page_size=page, device="cuda")
        for layout in layouts:
            host = make_host_pool(dev, layout=layout, io_backend="reference", size=dev.size, operations=())
            fill_random_fast([t for p in host.plan.parts for t in p.device_layers]
                             + list(host.plan.host_buffers.values()))  # fmt: skip
            decl, geometry = registry.layouts[layout], host.geometry
            made: dict[str, Implementation] = {}
            for cls in impls:
                if not reasons_for(cls, TransferRequest(cls.io_backend, LOAD, geometry, decl)):
                    made[cls.name] = cls(host.plan)
                    if getattr(getattr(made[cls.name], "copier", None), "thread", False):
                        # The same copy engine submitting from the caller's thread: what the worker saves.
                        made[cls.name + " caller-thread"] = sync = cls(host.plan)
                        sync.copier.thread = False
                        # The worker for calls of every size (the default keeps the largest on the caller's thread).
                        made[cls.name + " worker"] = worker = cls(host.plan)
                        worker.copier.thread_max = 0
            request = TransferRequest("auto", LOAD, geometry, decl, True)
            try:
                base = resolve(registry, request)
                made["auto"] = autoselect.auto_class(registry, request, base)(host.plan)
                # The static rule alone, beside the profile (where one exists they may differ).
                made["auto-rule"] = autoselect.auto_class(registry, request, base, use_profile=False)(host.plan)
            except Exception as exc:  # noqa: BLE001 - auto is one row; report and go on
                print(f"auto: not measured for {model_name} {layout}: {exc}")
            for _, new_tokens, m, regime in cases:
                streams = Streams(model, new_tokens)
                hp = random_pages(host.page_num + 1, m // page, page, gen) - page
                dp = random_pages(dev.size // page, m // page, page, gen)
                nbytes = m * shape.item_bytes() * host.layer_num
                layers = host.layer_num
                alone = _median_run(lambda s=streams, n=layers: prefill_run(s, n, None, True), reps)
                for mode, (impl_name, impl) in ((mo, it) for mo in modes for it in made.items()):
                    where = host.plan.device if impl.index_device == "device" else torch.device("cpu")
                    h, d = hp.to(where), dp.to(where)
                    settings = budgets if hasattr(impl, "max_ctas") else (None,)
                    for budget in settings:
                        if budget is not None:
                            impl.max_ctas = budget
                        try:
                            result = prefill_overlap(impl, streams, h, d, layers, nbytes, ceiling["h2d_gbps"], reps,
                                                     compute_alone=alone, mode=mode)  # fmt: skip
                        except Exception as exc:  # noqa: BLE001 - one failing row must not end the run
                            print(f"{impl_name} {layout} {model_name} {m}: failed: {type(exc).__name__}: {exc}")
                            continue
                        chosen = _chosen(impl, m) if impl_name.startswith("auto") else None
                        records.append({
                            "implementation": impl_name, "layout": layout, "model": model_name, "shape": shape.name,
                            "new_tokens": new_tokens, "cached_tokens": m, "regime": regime, "page_size": page,
                            "max_ctas": budget, "chosen": chosen,
                            "path": getattr(getattr(impl, "copier", None), "path", None), **result,
                        })  # fmt: skip
                        r = records[-1]
                        print(f"{mode:11} {model_name:12} {m:6} {layout:18} {_row_label(r):34} "
                              f"eff {r['efficiency']:.2f} "
                              f"overlapped {r['overlapped_s'] * 1e3:7.1f} ms (compute {r['compute_s'] * 1e3:6.1f}, "
                              f"transfer {r['transfer_s'] * 1e3:6.1f}) GEMM {r['gemm_slowdown']:+.0%} "
                              f"first GEMM at {r['first_gemm_start_s'] * 1e3:.1f} ms, loads submitted in "
                              f"{r['load_submit_s'] * 1e3:.2f} ms", flush=True)  # fmt: skip
                del streams
                _write(Path(out), name or "overlap", {**meta, "complete": False}, records, plot=False)
            # All-layer backups during decode (4096 tokens), on the same pool.
            if layout == "page_first_direct" and (not quick or model_name == "llama-8b"):
                tokens = 4096
                hp = random_pages(host.page_num + 1, tokens // page, page, gen) - page
                dp = random_pages(dev.size // page, tokens // page, page, gen)
                nbytes = tokens * shape.item_bytes() * host.layer_num
                backups = {}
                for cls in impls:
                    if not reasons_for(cls, TransferRequest(cls.io_backend, BACKUP_ALL, geometry, decl)):
                        backups[cls.name] = made.get(cls.name) or cls(host.plan)
                req = TransferRequest("auto", BACKUP_ALL, geometry, decl, True)
                try:
                    backups["auto"] = autoselect.auto_class(registry, req, resolve(registry, req))(host.plan)
                except Exception as exc:  # noqa: BLE001
                    print(f"auto backup: not measured: {exc}")
                for impl_name, impl in backups.items():
                    where = host.plan.device if impl.index_device == "device" else torch.device("cpu")
                    for budget in ((8, 0) if hasattr(impl, "max_ctas") else (None,)):
                        if budget is not None:
                            impl.max_ctas = budget
                        try:
                            result = decode_backup(impl, model, hp.to(where), dp.to(where), host.layer_num, nbytes,
                                                   ceiling["d2h_gbps"], reps=reps)  # fmt: skip
                        except Exception as exc:  # noqa: BLE001
                            print(f"{impl_name} decode backup failed: {type(exc).__name__}: {exc}")
                            continue
                        records.append({"implementation": impl_name, "layout": layout, "model": model_name,
                                        "shape": shape.name, "tokens": tokens, "max_ctas": budget,
                                        "metric": "backup_during_decode", **result})  # fmt: skip
                        r = records[-1]
                        print(f"{model_name:12} backup-all {tokens} {impl_name:20} {budget!s:5} decode "
                              f"{r['decode_slowdown']:+.0%}, backup {r['backup_fraction_alone']:.2f} of the ceiling "
                              f"alone, {r['backup_fraction_beside_decode']:.2f} beside decode", flush=True)  # fmt: skip
            del host, made
            torch.cuda.empty_cache()
        del dev
        torch.cuda.empty_cache()
    summary = overlap_summary(records)
    print(summary)
    path = _write(Path(out), name or "overlap", {**meta, "summary": summary, "complete": True}, records)
    print(f"wrote {path}")
    return 0


def _chosen(impl: Implementation, tokens: int) -> str:
    """What an auto implementation runs for ``tokens`` tokens, in words."""
    picked = impl.pick(tokens) if hasattr(impl, "pick") else impl
    ctas = getattr(picked, "max_ctas", None)
    return picked.name + (f" {ctas or 'all'} CTAs" if ctas is not None else "")


def _row_label(r: dict) -> str:
    label = r["implementation"]
    if r.get("max_ctas") is not None:
        label += f" {r['max_ctas'] or 'all'} CTAs"
    if r.get("chosen"):
        label += f" ({r['chosen']})"
    return label


def overlap_summary(records: list[dict]) -> str:
    """Per mode and case: the best row, direct's best, auto's and auto's static rule, and auto / best."""
    lines = ["| mode | case | best | direct | auto | auto / best | auto-rule / best |", "|---|---|---|---|---|---|---|"]

    def case_of(r):
        return (r.get("mode", "interleaved"), r["model"], r["new_tokens"], r["cached_tokens"], r["layout"])

    for mode, model, n, m, layout in sorted({case_of(r) for r in records if "efficiency" in r}):
        rows = [r for r in records if "efficiency" in r and case_of(r) == (mode, model, n, m, layout)]
        best = max((r for r in rows if not r["implementation"].startswith("auto")), key=lambda r: r["efficiency"],
                   default=None)  # fmt: skip
        direct = max((r for r in rows if r["implementation"].startswith("direct")), key=lambda r: r["efficiency"],
                     default=None)  # fmt: skip
        auto = next((r for r in rows if r["implementation"] == "auto"), None)
        rule = next((r for r in rows if r["implementation"] == "auto-rule"), None)

        def cell(r):
            return "-" if r is None else f"{_row_label(r)}: {r['efficiency']:.2f}, GEMM {r['gemm_slowdown']:+.0%}"

        def ratio(r, best=best):
            return f"{r['efficiency'] / best['efficiency']:.3f}" if r and best else "-"

        lines.append(f"| {mode} | {model} {n} new / {m} cached, {layout} | {cell(best)} | {cell(direct)} "
                     f"| {cell(auto)} | {ratio(auto)} | {ratio(rule)} |")  # fmt: skip
    return "\n".join(lines)
