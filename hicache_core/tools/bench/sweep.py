"""``hicache bench``: the sweep over model-like pools, with the ceiling measured in the same run.

Every figure is bytes that crossed the link over wall time between CUDA events
(median of repeats), and is reported as a fraction of a contiguous pinned
``cudaMemcpyAsync`` of 2 GiB measured at the start of the run. Results go to
JSON (one record per row, with the machine, versions and the ceiling) and a PNG
plot. Timings live here, never in tests.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from ...plugins.dispatch import reasons_for
from ...plugins.implementation import BACKUP_ALL, BACKUP_LAYER, LOAD, Implementation, TransferRequest
from ...plugins.registry import Registry, get_registry
from ...pool.host_pool import make_host_pool
from ..demo import fill_random, random_pages
from ..progress import progress
from ..shapes import SHAPES, ModelShape
from .clock import Timer, batch_for, host_us, queued_seconds
from .machine import measure_ceiling, measure_dispatch_overhead
from .records import environment, made_by, write_records

TOKENS = (64, 512, 4096, 32768)
PAGE_SIZES = (1, 16, 64)
SM_BUDGETS = (2, 4, 8, 16, None)
OPS = (LOAD, BACKUP_ALL, BACKUP_LAYER)


class Case:
    """One pool (shape, layout, page size) with every implementation that claims it bound to it."""

    def __init__(self, registry: Registry, shape: ModelShape, layout: str, page_size: int, tokens: int, impls):
        self.shape, self.layout, self.page_size, self.registry = shape, layout, page_size, registry
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


def storable(shape: ModelShape, layout) -> bool:
    """Whether ``layout`` can store pools of ``shape`` (a layout's kinds, a split it needs)."""
    return TransferRequest("reference", LOAD, shape.geometry(page_size=64), layout).storable


def _variants(impl: Implementation, tokens: int) -> dict[str, dict]:
    """The settings timed for ``impl`` at ``tokens`` tokens: the defaults, plus its declared variants at 4096+."""
    return {"default": {}} | (impl.tuning_variants() if tokens >= 4096 else {})


def run_op(impl: Implementation, op: str, h: torch.Tensor, d: torch.Tensor, layer: int = 0) -> Callable[[], None]:
    """A call of ``op`` on ``impl`` with these indices, ready to time (layer ``layer`` for per-layer ops)."""
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
              name: str | None = None, tokens: tuple[int, ...] | None = None,
              shapes: tuple[str, ...] | None = None, layouts: tuple[str, ...] | None = None,
              anchor_module: str | None = None) -> int:  # fmt: skip
    """The sweep: every implementation on every pool it claims, both clocks, the ceilings, SGLang's anchor."""
    from .sglang_kernels import find_anchor

    if not torch.cuda.is_available():
        overhead = measure_dispatch_overhead()
        print(f"No GPU: measured the core dispatch overhead only: {overhead['overhead_us']:.3f} us per call")
        write_records(Path(out), "dispatch-cpu", {"environment": environment(), "dispatch_overhead": overhead}, [])
        return 0
    registry = get_registry()
    impls = implementations_to_time(registry, only)
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
            if not storable(shape, decl) or (layouts and layout not in layouts):
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
        write_records(Path(out), file_name, {**meta, "complete": False}, records, plot=False)
    summary = _summary(records)
    print(summary)
    path = write_records(Path(out), file_name, {**meta, "summary": summary, "complete": True}, records)
    print(f"wrote {path}")
    return 0


def implementations_to_time(registry: Registry, only: str | None) -> list[type[Implementation]]:
    """The implementations a sweep times: those ``auto`` may pick, or the comma-separated names in ``only``."""
    wanted = set(only.split(",")) if only else None
    return [c for n, c in sorted(registry.implementations.items())
            if c.auto_selectable and (wanted is None or n in wanted)]  # fmt: skip


def _ceiling_records(plan: list, ceiling: dict) -> list[dict]:
    """The SM-copy ceiling (256 MiB) and, at each per-layer load's byte count, the copy engine's and the SM copy's."""
    from .ceilings import ceilings_at_sizes, sm_ceiling

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
                for variant, settings in _variants(impl, tokens).items():
                    with impl.tuned(settings):
                        if tokens >= 4096 and op != BACKUP_ALL:  # one all-layer call outlasts its submission
                            seconds, queued = time_both(partial(run_op, impl, op, h, d), layers, timer)
                        else:
                            seconds, queued = timer(run_op(impl, op, h, d)), None
                    row = {
                        "implementation": name, **made_by(case.registry, impl), "io_backend": impl.io_backend,
                        "shape": case.shape.name,
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
                "implementation": name, **made_by(case.registry, impl), "shape": case.shape.name,
                "layout": case.layout, "page_size": p, "tokens": 64, "operation": LOAD, "metric": "host_time_us",
                "host_time_us": host_time_us(impl, h, d),
                # fresh index tensors every call (no reuse of an earlier call's runs or copies)
                "host_time_fresh_us": host_time_us(impl, h, d, fresh=True),
                "through_pool_us": _pool_host_time_us(case, impl, h, d),
            })  # fmt: skip
    if impl.path is not None:
        records.append({"implementation": name, "shape": case.shape.name, "layout": case.layout, "page_size": p,
                        "metric": "path", "path": impl.path})  # fmt: skip
    return records


def _pool_host_time_us(case: Case, impl: Implementation, h: torch.Tensor, d: torch.Tensor) -> float:
    """Host time per 64-token load through a host pool bound to ``impl`` (what a server calls)."""
    # Unverified, as the rows beside it: benchmarks/verify_cost.py measures what verification adds.
    host = make_host_pool(case.dev, layout=case.layout, io_backend=impl.io_backend, size=case.host.size,
                          implementation=impl.name, operations=(LOAD,), validate=False, verify=False)  # fmt: skip
    mine = host.implementation_for(LOAD)
    if hasattr(mine, "max_ctas"):
        mine.max_ctas = 8
    us = host_us(lambda: host.load_to_device_per_layer(case.dev, h, d, 1, impl.io_backend))
    host.destroy()
    return us


def _time_anchor(case: Case, anchor, token_counts, ceiling: dict, timer: Timer) -> list[dict]:
    """SGLang's transfer functions on this pool, checked byte for byte first (see .sglang_kernels)."""
    from .sglang_kernels import BLOCK_QUOTAS, AnchorCalls

    if not AnchorCalls.supports(case.host) or case.page_size != 64:
        return []
    calls = AnchorCalls(anchor, case.host, case.dev)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    records = []

    class OnGpu:  # Case.indices places indices where an implementation wants them; SGLang's: the GPU
        index_device = "device"

    for op in (LOAD, BACKUP_ALL):
        # SGLang's transfer kernels: GPU threads, from SGLang rather than a plugin.
        base = {"implementation": "sglang." + calls.function(op), "engine": "sm", "plugin": "sglang",
                "io_backend": "sglang-anchor",
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
            result = gemm_interference(impl, run_op(impl, LOAD, h, d), case.bytes_moved(4096, LOAD))
            records.append({"implementation": name, **made_by(case.registry, impl), "shape": case.shape.name,
                            "layout": case.layout, "page_size": case.page_size, "tokens": 4096, "operation": LOAD,
                            "metric": "gemm_interference", "max_ctas": budget, **result})  # fmt: skip
    return records


def _summary(records: list[dict]) -> str:
    """docs/performance.md's table: per implementation, operation and shape, the best layout at >= 4096 tokens."""
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
