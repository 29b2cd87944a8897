"""Byte-exact checks of direct's batched path on CUDA, and the summary of scripts/gpu/direct-check.sh.

    python scripts/gpu/direct_check.py --out DIR          # every layout direct claims, plain/sharded/draft pools
    python scripts/gpu/direct_check.py --memcheck         # a short subset, for compute-sanitizer
    python scripts/gpu/direct_check.py --summary DIR      # the compact table of a direct-check.sh run

For each pool kind and layout direct claims (model-like item sizes, few layers), page
size 64 and 1, plain, layer-sharded and MTP-draft pools, int64 and int32 indices in
random page order: per-layer loads, per-layer backups and all-layer backups through a
host pool of io backend ``direct``, against the reference on a twin pool, under every
submission setting (one batch, split batches, two streams, one copy per run), on a side
stream, on the legacy default stream, and behind a slow producer on the caller's stream.
Exit status 1 if any byte differs. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import hicache_core as hc
from hicache_core.plugins.dispatch import reasons_for
from hicache_core.plugins.reference import reference_copy
from hicache_core.tools.shapes import shape_for_kind

SETTINGS = {
    "batch": {},
    "max_batch3": {"max_batch": 3},
    "streams2": {"streams": 2},
    "one_by_one": {"batch": False},
    "no_overlap_hint": {"prefer_overlap": False},
    "batch_2d": {"batch_2d": True},
}
VARIANT_ORDER = ("default", "streams2", "max_batch32", "no_overlap_hint", "one_by_one", "batch_2d")
#: CUDA on the GPU machine; the CPU runs the same code paths as a dry run (memmove, no streams).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _rand(tensors, gen):
    for t in tensors:
        flat = t.reshape(-1).view(torch.uint8)
        # The generator is a CPU one (the same bytes on every machine): draw there, then copy.
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen).to(flat.device))


def _dev_tensors(dev, drafts):
    attrs = ("k_buffer", "v_buffer", "kv_buffer", "index_k_with_scale_buffer")
    return [t for p in (dev, *drafts) for a in attrs for t in (getattr(p, a, None) or [])]


def _images(tensors):
    return [t.reshape(-1).view(torch.uint8).to(DEVICE, copy=True) for t in tensors]


def _restore(tensors, images):
    for t, im in zip(tensors, images):
        t.reshape(-1).view(torch.uint8).copy_(im)


def _same(tensors, images) -> bool:
    return all(torch.equal(t.reshape(-1).view(torch.uint8).to(DEVICE), im) for t, im in zip(tensors, images))


class Pool:
    def __init__(self, kind: str, layout: str, variant: str, page: int, layers: int, tokens: int) -> None:
        shape = shape_for_kind(kind)
        kw = {"start_layer": layers // 2, "end_layer": layers} if variant == "sharded" else {}
        rows = tokens * 2 + page
        self.dev = shape.device_pool(rows, page_size=page, device=DEVICE, layers=layers, **kw)
        self.drafts = ()
        if variant == "draft":  # a draft with fewer rows than the target (bounds are per layer)
            self.drafts = (shape.device_pool(rows - 2 * page, page_size=page, device=DEVICE, layers=1),)
        # Unverified: each case writes random bytes into the host pool itself (by other means than a backup,
        # which verification would rightly report), then checks the copies against the reference copy.
        self.host = hc.make_host_pool(self.dev, layout=layout, io_backend="direct", size=self.dev.size,
                                      draft_pools=self.drafts, operations=list(hc.OPERATIONS),
                                      verify=False)  # fmt: skip
        self.impl = self.host.implementation_for(hc.LOAD)
        self.dt = _dev_tensors(self.dev, self.drafts)
        self.ht = list(self.host.plan.host_buffers.values())
        self.page, self.tokens, self.kind, self.variant = page, tokens, kind, variant

    def indices(self, gen, dtype):
        p, n = self.page, self.tokens
        hp = torch.randperm(self.host.page_num, generator=gen)[: n // p]
        min_rows = min(self.host.plan.device_rows_per_layer)
        dev_pages = min_rows if self.host.geometry.items_are_pages else min_rows // p
        dp = torch.randperm(dev_pages - 1, generator=gen)[: n // p] + 1
        if self.host.geometry.items_are_pages:
            return hp.to(dtype) * p, dp.to(dtype) * p  # slots of whole pages (the pool takes every p-th)
        h = (hp[:, None] * p + torch.arange(p)).reshape(-1)
        d = (dp[:, None] * p + torch.arange(p)).reshape(-1)
        return h.to(dtype), d.to(dtype)

    def slots(self, idx):
        if self.host.geometry.items_are_pages:
            return (idx[:, None] + torch.arange(self.page)).reshape(-1)
        return idx


def check_pool(pool: Pool, gen, results: list, combos) -> None:
    host = pool.host
    for setting, dtype, where in combos:
        h_idx, d_idx = pool.indices(gen, dtype)
        h, d = pool.slots(h_idx), pool.slots(d_idx)
        name = f"{pool.kind}/{host.layout}/p{pool.page}/{pool.variant}/{setting}/{str(dtype)[6:]}/{where}"
        ok, why = True, ""
        try:
            for op in hc.OPERATIONS:
                if not _one_op(pool, op, h, d, setting, where, gen):
                    ok, why = False, f"{op} differs from the reference"
                    break
        except Exception as exc:  # noqa: BLE001 - a failure is a result; the next case still runs
            ok, why = False, f"{type(exc).__name__}: {exc}"
        results.append({"case": name, "ok": ok, "why": why, "path": getattr(pool.impl.copier, "path", "")})
        print(("PASS " if ok else "FAIL ") + name + (f": {why}" if why else ""), flush=True)


def combos_for(variant: str, memcheck: bool, only_2d: bool = False) -> list[tuple[str, torch.dtype, str]]:
    """(submission setting, index dtype, stream) cases: every setting on plain pools, the rest once."""
    if only_2d:
        return [("batch_2d", torch.int64, "side"), ("batch_2d", torch.int32, "legacy"),
                ("batch_2d", torch.int64, "behind")]  # fmt: skip
    if memcheck:
        return [("batch", torch.int64, "side")]
    if DEVICE == "cpu":  # no streams and no submission knobs on the CPU
        return [("batch", torch.int64, "side"), ("batch", torch.int32, "side")]
    if variant == "plain":  # batch_2d runs in a process of its own (--only-2d): it is new on GPUs
        settings = [s for s in SETTINGS if s not in ("batch_2d", "no_overlap_hint")]  # a hint moves no byte
        return [(s, torch.int64, "side") for s in settings] + [("batch", torch.int32, "side"),
                                                                ("batch", torch.int64, "legacy"),
                                                                ("batch", torch.int64, "behind"),
                                                                # the legacy stream's implicit synchronisation
                                                                # with the per-thread stream direct uses there
                                                                ("batch", torch.int64, "legacy_behind")]  # fmt: skip
    return [("batch", torch.int32, "legacy"), ("batch", torch.int64, "behind")]


def _one_op(pool: Pool, op: str, h, d, setting: str, where: str, gen) -> bool:
    host, dev = pool.host, pool.dev
    _rand(pool.dt + pool.ht, gen)
    before_dev, before_host = _images(pool.dt), _images(pool.ht)
    layers = list(range(host.layer_num))
    owned = range(host.start_layer, host.end_layer)
    copier = pool.impl.copier
    changes = {k: v for k, v in SETTINGS[setting].items() if hasattr(copier, k)}  # the CPU copier has no knobs
    saved = {k: getattr(copier, k) for k in changes}
    for k, v in changes.items():
        setattr(copier, k, v)
    try:
        if DEVICE == "cpu":
            stream = None
        else:
            stream = torch.cuda.current_stream() if where.startswith("legacy") else torch.cuda.Stream()
        with torch.cuda.stream(stream):
            if where.endswith("behind"):
                # The caller's stream is busy, then rewrites the device pool: a backup must see the new
                # bytes, and a load must land after them (else loaded rows come out one higher).
                if DEVICE == "cuda":
                    torch.cuda._sleep(5_000_000)
                for t in pool.dt:
                    t.reshape(-1).view(torch.uint8).add_(1)
            if op == hc.LOAD:
                for lid in owned:
                    host.load_to_device_per_layer(dev, h, d, lid, "direct")
                for i, draft in enumerate(pool.drafts):
                    host.load_to_device_per_layer(draft, h, d, host.geometry.layer_num + i, "direct", is_draft=True)
            elif op == hc.BACKUP_LAYER:
                for lid in owned:
                    host.backup_from_device_per_layer(dev, h, d, lid, "direct")
                for i, draft in enumerate(pool.drafts):
                    host.backup_from_device_per_layer(draft, h, d, host.geometry.layer_num + i, "direct",
                                                      is_draft=True)  # fmt: skip
            else:
                host.backup_from_device_all_layer(dev, h, d, "direct")
        _sync()
    finally:
        for k, v in saved.items():
            setattr(copier, k, v)
    got_dev, got_host = _images(pool.dt), _images(pool.ht)
    _restore(pool.dt, before_dev)
    _restore(pool.ht, before_host)
    if where.endswith("behind"):
        for t in pool.dt:
            t.reshape(-1).view(torch.uint8).add_(1)
    hi = h[:: pool.page] // pool.page if host.geometry.items_are_pages else h
    di = d[:: pool.page] // pool.page if host.geometry.items_are_pages else d
    reference_copy(host.plan, hi.long().cpu(), di.long().to(DEVICE), layers, to_device=op == hc.LOAD)
    _sync()
    return _same(pool.dt, got_dev) and _same(pool.ht, got_host)


def run_checks(memcheck: bool, out: Path | None = None, only_2d: bool = False, results=None) -> list[dict]:
    registry = hc.get_registry()
    direct = registry.implementations["direct.copy_engine"]
    gen = torch.Generator().manual_seed(0)
    results = [] if results is None else results
    # Every pool kind registered (third parties' too); under the sanitizer, one of each path (token rows,
    # MLA rows with 2-D halves, page rows).
    kinds = [k for k in ("mha", "mla", "page_rows") if k in registry.pool_kinds] if memcheck else sorted(
        registry.pool_kinds)  # fmt: skip
    for kind in kinds:
        for layout, decl in sorted(registry.layouts.items()):
            if only_2d and layout != "page_first_kv_split":
                continue
            page_kind = registry.pool_kinds[kind].items_are_pages
            for page in (64,) if memcheck or page_kind else (64, 1):
                for variant in ("plain", "sharded", "draft") if not memcheck else ("draft",):
                    geometry = shape_for_kind(kind).geometry(page_size=page, sharded=variant == "sharded",
                                                                  draft=variant == "draft", layers=4)  # fmt: skip
                    request = hc.TransferRequest("direct", hc.LOAD, geometry, decl, True)
                    if reasons_for(direct, request):
                        continue
                    tokens = 64 if page == 1 else 256
                    try:
                        pool = Pool(kind, layout, variant, page, 4, tokens)
                    except Exception as exc:  # noqa: BLE001
                        results.append({"case": f"{kind}/{layout}/p{page}/{variant}", "ok": False, "why": repr(exc)})
                        print(f"FAIL {kind}/{layout}/p{page}/{variant}: {exc!r}", flush=True)
                        continue
                    check_pool(pool, gen, results, combos_for(variant, memcheck, only_2d))
                    del pool
                    if out is not None:  # after every pool: a run cut short still leaves its results
                        (out / "direct-check.json").write_text(json.dumps({"results": results}, indent=1))
    return results


def bars(recs: list[dict]) -> list[str]:
    """The bars for direct (default settings), each with the best variant beside it."""
    out = []

    def rows(shape, layouts, ops, tokens):
        return [r for r in recs if r.get("implementation") == "direct.copy_engine" and "fraction_of_ceiling" in r
                and r["shape"] == shape and r["layout"] in layouts and r["operation"] in ops
                and r["tokens"] in tokens]  # fmt: skip

    one_layer = ("load_to_device_per_layer", "backup_from_device_per_layer")
    checks = [
        (
            "llama-8b per-layer >= 4096 tok",
            rows("llama-8b", ("page_first_direct", "layer_first"), one_layer, (4096, 32768)),
            0.85,
        ),  # fmt: skip
        ("MLA load 4096 tok", rows("deepseek-mla", ("page_first_direct", "layer_first"), one_layer[:1], (4096,)), 0.75),
        (
            "MLA load 32768 tok",
            rows("deepseek-mla", ("page_first_direct", "layer_first"), one_layer[:1], (32768,)),
            0.85,
        ),  # fmt: skip
        (
            "all-layer backups",
            [
                r
                for r in recs
                if r.get("implementation") == "direct.copy_engine"
                and r.get("operation") == "backup_from_device_all_layer"
                and "fraction_of_ceiling" in r
                and r["layout"] != "page_first_kv_split"
            ],
            0.90,
        ),  # fmt: skip
    ]
    for label, found, bar in checks:
        default = [r["fraction_of_ceiling"] for r in found if r.get("variant", "default") == "default"]
        if not default:
            out.append(f"bar {label} >= {bar}: not measured")
            continue
        best = {}
        for r in found:
            best[r.get("variant", "default")] = min(best.get(r.get("variant", "default"), 9), r["fraction_of_ceiling"])
        top = max(best, key=best.get)
        verdict = "PASS" if min(default) >= bar else "MISS"
        out.append(f"bar {label} >= {bar}: {verdict} (default worst {min(default):.2f}; best setting {top} worst "
                   f"{best[top]:.2f})")  # fmt: skip
    host = [r["host_time_us"] for r in recs if r.get("metric") == "host_time_us"
            and r["implementation"] == "direct.copy_engine"]  # fmt: skip
    if host:
        out.append(f"bar 64-token load <= 15 us host: {'PASS' if max(host) <= 15 else 'MISS'} (worst {max(host):.1f})")
    return out


def summary(folder: Path) -> int:
    """The compact table at the end of direct-check.sh."""
    lines = []
    check = folder / "direct-check.json"
    if check.exists():
        data = json.loads(check.read_text())
        bad = [r for r in data["results"] if not r["ok"]]
        lines.append(f"batched byte-exact checks: {len(data['results']) - len(bad)} passed, {len(bad)} failed"
                     + (f"; path: {data['results'][0].get('path')}" if data["results"] else ""))  # fmt: skip
        lines += [f"    FAIL {r['case']}: {r['why']}" for r in bad[:10]]
    bench = folder / "direct-bench.json"
    if bench.exists():
        data = json.loads(bench.read_text())
        recs = data["records"]
        ceiling = data.get("ceiling", {})
        lines.append(f"ceiling H2D {ceiling.get('h2d_gbps', 0):.1f} GB/s, D2H {ceiling.get('d2h_gbps', 0):.1f} GB/s")
        lines.append("fraction of the ceiling (direct: default / streams2 / max_batch32 / no_overlap_hint / "
                     "one_by_one / batch_2d; kernels at 8 CTAs / unlimited):")  # fmt: skip
        keys = sorted({(r["shape"], r["layout"], r["operation"], r["tokens"]) for r in recs
                       if "fraction_of_ceiling" in r and r["tokens"] >= 4096})  # fmt: skip
        for key in keys:
            rows = [r for r in recs if "fraction_of_ceiling" in r and (r["shape"], r["layout"], r["operation"],
                    r["tokens"]) == key]  # fmt: skip
            cells = []
            for impl in ("direct.copy_engine", "kernel.triton_uva", "jit.one_layer"):
                mine = [r for r in rows if r["implementation"] == impl]
                if not mine:
                    continue
                if impl.startswith("direct"):
                    by = {r.get("variant", "default"): r["fraction_of_ceiling"] for r in mine}
                    vals = "/".join(f"{by[v]:.2f}" if v in by else "-" for v in VARIANT_ORDER)
                else:
                    by = {r.get("max_ctas"): r["fraction_of_ceiling"] for r in mine}
                    vals = "/".join(f"{by[b]:.2f}" if b in by else "-" for b in (8, 0))
                cells.append(f"{impl.split('.')[0]} {vals}")
            op = key[2].replace("_to_device_per_layer", "").replace("backup_from_device_", "backup_")
            lines.append(f"    {key[0]:12} {key[1]:19} {op:16} {key[3]:6}  " + "  ".join(cells))
        lines += ["    " + x for x in bars(recs)]
        for r in recs:
            if r.get("metric") == "host_time_us":
                lines.append(
                    f"    host us per 64-token load: {r['implementation']:20} {r['layout']:19} "
                    f"{r['host_time_us']:.1f} (same indices), {r.get('host_time_fresh_us', 0):.1f} (fresh)"
                )
    overlap = folder / "overlap.json"
    if overlap.exists():
        data = json.loads(overlap.read_text())
        lines.append("overlap (efficiency = max(compute, bytes/ceiling) / overlapped):")
        lines += ["    " + x for x in (data.get("summary") or "(incomplete run)").splitlines()]
        for r in data["records"]:
            if r.get("metric") == "backup_during_decode":
                lines.append(f"    backup-all during decode: {r['implementation']:20} ctas {r.get('max_ctas')!s:4} "
                             f"decode {r['decode_slowdown']:+.0%}, backup {r['backup_fraction_beside_decode']:.2f} "
                             f"of the ceiling beside decode ({r['backup_fraction_alone']:.2f} alone)")  # fmt: skip
    profile = folder / "profile.json"
    if profile.exists():
        data = json.loads(profile.read_text())
        lines.append(f"calibrated profile: {sum(len(v) for v in data['entries'].values())} entries "
                     f"for {data['device']}")  # fmt: skip
    print("\n".join(lines))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for direct-check.json")
    ap.add_argument("--memcheck", action="store_true", help="a short subset (for compute-sanitizer)")
    ap.add_argument("--summary", help="print the summary of a direct-check.sh output folder")
    ap.add_argument(
        "--only-2d",
        action="store_true",
        help="kv_split pools with 2-D copies as one cudaMemcpy3DBatchAsync (added to --out's results)",
    )
    args = ap.parse_args()
    if args.summary:
        return summary(Path(args.summary))
    t0 = time.perf_counter()
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "no GPU: a CPU dry run"
    print(f"torch {torch.__version__}, {gpu}", flush=True)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    earlier = None
    if args.only_2d and out is not None and (out / "direct-check.json").exists():
        earlier = json.loads((out / "direct-check.json").read_text())["results"]
    results = run_checks(args.memcheck, out, args.only_2d, earlier)
    bad = sum(not r["ok"] for r in results)
    print(f"{len(results) - bad} passed, {bad} failed in {time.perf_counter() - t0:.0f} s")
    if out is not None:
        (out / "direct-check.json").write_text(json.dumps({"results": results, "complete": True}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
