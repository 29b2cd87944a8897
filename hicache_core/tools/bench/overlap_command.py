"""``hicache bench --overlap``: runs the workloads of :mod:`hicache_core.tools.bench.overlap` and reports them."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ...plugins import autoselect
from ...plugins.dispatch import reasons_for, resolve
from ...plugins.implementation import BACKUP_ALL, LOAD, Implementation, TransferRequest
from ...plugins.registry import get_registry
from ...pool.host_pool import make_host_pool
from ..demo import random_pages
from ..shapes import SHAPES
from .machine import measure_ceiling
from .overlap import (
    CASES,
    MODELS,
    MODES,
    Streams,
    decode_backup,
    fill_random_fast,
    median_run,
    prefill_overlap,
    prefill_run,
)
from .plots import row_label
from .records import environment, made_by, write_records
from .sweep import implementations_to_time


def _sglang_note() -> dict:
    """The baseline: SGLang's own transfer functions, where ``sgl_kernel`` is importable."""
    try:
        import sgl_kernel
    except Exception as exc:  # noqa: BLE001 - any import failure means: no anchor in this run
        return {"sglang": "skipped", "why": f"sgl_kernel is not importable here ({type(exc).__name__}: {exc})"}
    found = sorted(n for n in dir(sgl_kernel) if n.startswith("transfer_kv"))
    return {"sglang": "skipped", "functions_found": found,
            "why": "sgl_kernel is importable, but this benchmark does not call its transfer_kv_* functions yet: "
                   "the row lists what this build exports"}  # fmt: skip


def run_overlap(out: str = "benchmarks/results", quick: bool = False, only: str | None = None,
                name: str | None = None, modes: tuple[str, ...] | None = None,
                layouts: tuple[str, ...] | None = None) -> int:  # fmt: skip
    """Layer-wise loads under prefill GEMMs, and all-layer backups under decode (hicache_core.tools.bench.overlap).

    ``modes`` (default: ``sglang`` and ``loader`` with ``quick``, else all): how the loads are issued,
    :data:`hicache_core.tools.bench.overlap.MODES`."""
    if not torch.cuda.is_available():
        print("hicache bench: --overlap needs a GPU", file=sys.stderr)
        return 1
    registry = get_registry()
    impls = implementations_to_time(registry, only)
    env = environment()
    ceiling = measure_ceiling(1 << 30)
    print(f"ceiling: H2D {ceiling['h2d_gbps']:.1f} GB/s, D2H {ceiling['d2h_gbps']:.1f} GB/s")
    modes = tuple(modes or (("sglang", "loader") if quick else MODES))
    budgets = (2, 8, 0) if quick else (2, 4, 8, 16, 0)
    layouts = tuple(layouts or (("page_first_direct",) if quick else ("page_first_direct", "layer_first")))
    reps = 2 if quick else 3
    records: list[dict] = []
    meta = {"environment": env, "ceiling": ceiling, "anchor": _sglang_note(),
            "compute_model": "per layer 2*N*params_per_layer FLOPs as [N, hidden] @ [hidden, 8192] bf16 GEMMs; "
                             "attention left out (hicache_core.tools.bench.overlap)"}  # fmt: skip
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
                    made[cls.name] = impl = cls(host.plan)
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
                alone = median_run(lambda s=streams, n=layers: prefill_run(s, n, None, True), reps)
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
                            "implementation": impl_name, **made_by(registry, impl), "layout": layout,
                            "model": model_name, "shape": shape.name,
                            "new_tokens": new_tokens, "cached_tokens": m, "regime": regime, "page_size": page,
                            "max_ctas": budget, "chosen": chosen,
                            "path": impl.path, **result,
                        })  # fmt: skip
                        r = records[-1]
                        print(f"{mode:11} {model_name:12} {m:6} {layout:18} {row_label(r):34} "
                              f"eff {r['efficiency']:.2f} "
                              f"overlapped {r['overlapped_s'] * 1e3:7.1f} ms (compute {r['compute_s'] * 1e3:6.1f}, "
                              f"transfer {r['transfer_s'] * 1e3:6.1f}) GEMM {r['gemm_slowdown']:+.0%} "
                              f"first GEMM at {r['first_gemm_start_s'] * 1e3:.1f} ms, loads submitted in "
                              f"{r['load_submit_s'] * 1e3:.2f} ms", flush=True)  # fmt: skip
                del streams
                write_records(Path(out), name or "overlap", {**meta, "complete": False}, records, plot=False)
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
                    for budget in (8, 0) if hasattr(impl, "max_ctas") else (None,):
                        if budget is not None:
                            impl.max_ctas = budget
                        try:
                            result = decode_backup(impl, model, hp.to(where), dp.to(where), host.layer_num, nbytes,
                                                   ceiling["d2h_gbps"], reps=reps)  # fmt: skip
                        except Exception as exc:  # noqa: BLE001
                            print(f"{impl_name} decode backup failed: {type(exc).__name__}: {exc}")
                            continue
                        records.append({"implementation": impl_name, **made_by(registry, impl), "layout": layout,
                                        "model": model_name,
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
    path = write_records(Path(out), name or "overlap", {**meta, "summary": summary, "complete": True}, records)
    print(f"wrote {path}")
    return 0


def _chosen(impl: Implementation, tokens: int) -> str:
    """What an auto implementation runs for ``tokens`` tokens, in words."""
    picked = impl.pick(tokens) if hasattr(impl, "pick") else impl
    ctas = getattr(picked, "max_ctas", None)
    return picked.name + (f" {ctas or 'all'} CTAs" if ctas is not None else "")


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
            return "-" if r is None else f"{row_label(r)}: {r['efficiency']:.2f}, GEMM {r['gemm_slowdown']:+.0%}"

        def ratio(r, best=best):
            return f"{r['efficiency'] / best['efficiency']:.3f}" if r and best else "-"

        lines.append(f"| {mode} | {model} {n} new / {m} cached, {layout} | {cell(best)} | {cell(direct)} "
                     f"| {cell(auto)} | {ratio(auto)} | {ratio(rule)} |")  # fmt: skip
    return "\n".join(lines)
