"""Where a verified load's extra time goes: the GPU timeline of one load, verified and not, from the profiler.

Run on the GPU machine::

    python benchmarks/verify_profile.py --out $OUT/verify-profile-h200.json

Per pool (as ``verify_cost.py`` builds them), io backend, token count and path (``layerwise``: the layer
loader's ``submit_load``; ``per_layer``: synchronous per-layer calls on one stream), five loads are
traced with the torch profiler (CUPTI). Per load: the span from the first GPU activity to the last,
the copies' busy time and the idle gaps between them on the copies' stream, and for the verified
load when its check starts after the last copy ends, how long it runs, and what follows it. Also
the check kernel alone over the whole load's layers (CUDA events, median of 20) with each tile
width it could use.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from verify_cost import device_pool, items_and_page, write_result  # noqa: E402

import hicache_core as hc  # noqa: E402
from hicache_core.verification import check_batch as hc_check_batch  # noqa: E402

CHECK_KERNEL = "page_checksums"
#: (TILE_T, BLOCK_W, stages, num_warps) of the check kernel tried alone; the first is the shape it had before.
#: Pages of one item (a page kind's row, Mamba's request) try tiles along the row: 32 words was their tile before.
VARIANTS = [(64, 64, 3, 8)] + [(t, w, s, n) for t in (32, 64) for w in (16, 32) for s in (3, 4, 6) for n in (2, 4, 8)]
VARIANTS += [(1, w, s, n) for w in (32, 256, 512, 1024, 2048) for s in (2, 4, 6) for n in (2, 4, 8)]


def _timeline(trace: dict, loads: int) -> list[dict]:
    """Per traced load (its ``load{i}`` range on the host), the GPU activity inside it, in µs."""
    events = trace["traceEvents"]
    ranges = sorted(
        (e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("load")),
        key=lambda e: e["ts"],
    )
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy") and "dur" in e]
    out = []
    for r in ranges[:loads]:
        lo, hi = r["ts"], r["ts"] + r["dur"]
        inside = sorted((e for e in gpu if lo <= e["ts"] <= hi), key=lambda e: e["ts"])
        if not inside:
            continue
        checks = [e for e in inside if CHECK_KERNEL in e["name"]]
        copies = [e for e in inside if CHECK_KERNEL not in e["name"]]
        row: dict = {
            "host_range_us": r["dur"],
            "span_us": inside[-1]["ts"] + inside[-1]["dur"] - inside[0]["ts"],
            "copies": len(copies),
            "copy_busy_us": sum(e["dur"] for e in copies),
            "copy_names": sorted({e["name"][:60] for e in copies}),
        }
        if copies:
            ends = [e["ts"] + e["dur"] for e in copies]
            gaps = [max(0.0, copies[i + 1]["ts"] - ends[i]) for i in range(len(copies) - 1)]
            row["copy_gaps_us"] = sum(gaps)
            row["copy_max_gap_us"] = max(gaps, default=0.0)
            row["copy_window_us"] = ends[-1] - copies[0]["ts"]
            row["first_copy_after_range_start_us"] = copies[0]["ts"] - lo
            row["copy_us_each"] = [round(e["dur"], 1) for e in copies]
        if checks:
            c = checks[-1]
            row["checks"] = len(checks)
            row["check_us"] = sum(e["dur"] for e in checks)
            row["check_start_after_last_copy_us"] = c["ts"] - (copies[-1]["ts"] + copies[-1]["dur"]) if copies else None
            row["after_check_us"] = (inside[-1]["ts"] + inside[-1]["dur"]) - (c["ts"] + c["dur"])
        out.append(row)
    return out


def _summary(rows: list[dict]) -> dict:
    keys = [k for k in rows[0] if isinstance(rows[0][k], (int, float)) and rows[0][k] is not None]
    return {k: statistics.median(r[k] for r in rows if r.get(k) is not None) for k in keys}


def _case(kind: str, layout: str, io: str, tokens: int, page: int, check_only: bool = False,
          runs_list: tuple[int, ...] = (1,)) -> dict:  # fmt: skip
    items, page = items_and_page(kind, tokens, page)
    dp = device_pool(kind, items, page)
    layers = dp.layer_num
    result: dict = {"pool": kind, "layout": layout, "io_backend": io, "tokens": tokens, "items": items}
    defaults = hc_check_batch.CHECK_RUNS, hc_check_batch.CHECK_RUNS_COPY_ENGINE
    for verify in (True,) if check_only else (False, True):
        host = hc.make_host_pool(dp, layout=layout, io_backend=io, verify=verify, size=2 * (items + 4 * page))
        slots = host.alloc(items)
        dev = torch.arange(page, page + items, device="cuda")
        hs = slots.cuda() if io != "direct" else slots
        host.backup_from_device_all_layer(dp, hs, dev, io)

        def per_layer(host=host, hs=hs, dev=dev):
            for layer in range(layers):
                host.load_to_device_per_layer(dp, hs, dev, layer, io)

        def layerwise(host=host, hs=hs, dev=dev):
            host.submit_load(dp, hs, dev, io).finish_event.wait()

        for runs in runs_list if verify else (None,):
            tag = "plain" if runs is None else "verified" if runs == runs_list[0] else f"verified_r{runs}"
            if runs is not None:
                hc_check_batch.CHECK_RUNS = hc_check_batch.CHECK_RUNS_COPY_ENGINE = runs
            _timelines(result, tag, () if check_only else (("layerwise", layerwise), ("per_layer", per_layer)))
        if verify and host.verifier is not None and host.verifier.kernel:
            if host.geometry.items_are_pages:  # the verifier takes a page kind's page rows, as the pool hands them
                hs, dev = hs.reshape(-1, page)[:, 0] // page, dev.reshape(-1, page)[:, 0] // page
            result["check_alone"] = _check_alone(host.verifier, hs, dev, layers)
        host.check_verified()
        host.destroy()
    hc_check_batch.CHECK_RUNS, hc_check_batch.CHECK_RUNS_COPY_ENGINE = defaults
    return result


def _timelines(result: dict, tag: str, fns) -> None:
    for name, fn in fns:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(5):
                torch.cuda.synchronize()
                with record_function(f"load{i}"):
                    fn()
                    torch.cuda.synchronize()
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            trace = json.load(open(f.name))
        loads = _timeline(trace, 5)
        result[f"{name}_{tag}"] = {"median": _summary(loads), "loads": loads}


def _check_alone(v, hs: torch.Tensor, dev: torch.Tensor, layers: int) -> dict:
    """The whole load's check in one launch, with each tile width it could use (median of 20, µs)."""
    from hicache_core.gpu import page_checksum_kernel as k

    h, d = v._move(hs, v.device), v._move(dev, v.device)
    entries, entries_off = v._entries(list(range(layers)))
    out = {}
    _, group, _ = v._tile
    for tile_t, block_w, stages, warps in VARIANTS:
        if tile_t > v.tokens or tile_t < group:  # a tile holds whole groups of rows
            continue

        def go(tile_t=tile_t, block_w=block_w, stages=stages, warps=warps):
            k.launch(v._anchor, entries_off, h.data_ptr() - v._base, d.data_ptr() - v._base, v._table_off,
                     v._flag_off, v._failed_off, -1, v.num_pages, v.columns, h.numel() // v.tokens,
                     entries.shape[0], v.groups, v.tokens, (tile_t, group, block_w), True, len(v.components),
                     v._align, stages, warps)  # fmt: skip
        go()
        torch.cuda.synchronize()
        times = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            go()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        out[f"t{tile_t}_w{block_w}_s{stages}_n{warps}"] = statistics.median(times)
    out["chosen_tile"] = list(v._tile)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="mla:page_first:kernel,mha:page_first:kernel,mha:layer_first:direct")
    ap.add_argument("--tokens", default="4096,32768")
    ap.add_argument("--runs", default="1", help="runs of checks of a verified load (both engines), comma-separated; "
                    "the first one's timelines are named 'verified'")
    ap.add_argument("--check-only", action="store_true", help="time the check kernel's variants alone, no timelines")
    args = ap.parse_args()
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for case in args.cases.split(","):
            kind, layout, io = case.split(":")
            runs = tuple(int(x) for x in args.runs.split(","))
            r = _case(kind, layout, io, tokens, 64, args.check_only, runs)
            rows.append(r)
            if args.check_only:
                best = sorted((x, k) for k, x in r["check_alone"].items() if isinstance(x, float))[:5]
                before = r["check_alone"].get("t64_w64_s3_n8") or r["check_alone"].get("t1_w32_s6_n4")
                print(f"{tokens:6} {kind} {layout}: the tile before {before:.1f} us; chosen "
                      f"{r['check_alone']['chosen_tile']}; best "
                      + ", ".join(f"{k} {x:.1f}" for x, k in best), flush=True)
                continue
            for key in [f"{k}_verified{'' if n == runs[0] else f'_r{n}'}" for k in ("layerwise", "per_layer")
                        for n in runs]:  # fmt: skip
                p, v = r[key.split("_verified")[0] + "_plain"]["median"], r[key]["median"]
                print(f"{tokens:6} {kind} {layout} {io} {key}: span {p['span_us']:.0f} -> {v['span_us']:.0f} us, "
                      f"host range {p['host_range_us']:.0f} -> {v['host_range_us']:.0f}, copy busy "
                      f"{p['copy_busy_us']:.0f} -> {v['copy_busy_us']:.0f}, gaps {p.get('copy_gaps_us', 0):.0f} -> "
                      f"{v.get('copy_gaps_us', 0):.0f}, check {v.get('check_us', 0):.0f} starting "
                      f"{v.get('check_start_after_last_copy_us', 0):.0f} after the last copy, "
                      f"{v.get('after_check_us', 0):.0f} after it", flush=True)  # fmt: skip
            print("   check alone:", {k: round(x, 1) if isinstance(x, float) else x
                                      for k, x in r.get("check_alone", {}).items()}, flush=True)  # fmt: skip
    write_result(args.out, "verified vs unverified load, GPU timeline from the profiler, same run", rows)


if __name__ == "__main__":
    main()
