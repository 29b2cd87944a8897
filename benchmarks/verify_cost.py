"""What host-tier verification costs: verified against unverified loads and backups, beside the copy ceiling.

Run on the GPU machine (one process, every figure from the same run; the file is rewritten after every
case, and a case that fails is a row with its error)::

    pip install --no-deps --no-build-isolation --no-index -e . -e plugins/*
    python benchmarks/verify_cost.py --out $OUT/verify-cost-h200.json [--tokens 4096] [--repeats 30] [--cases all]

Pools: ``--cases`` pool:layout pairs (default llama-8b-like MHA in ``page_first`` and ``layer_first``, and
DeepSeek's MLA in ``page_first``), or ``all``: every registered pool kind in every layout it allows, each in
one model's geometry (:data:`GEOMETRIES`; ``--list`` prints the cases and their bytes without a GPU), at ``--tokens``
cached tokens. Per pool, io backend and verify setting: a per-layer load of every layer of
the tokens on one stream (synchronous per-layer calls, as SGLang's controller makes them: a verifying
pool checks them in one launch after the last layer, and the stream waits for it), the same load
through the layer loader (``submit_load``, the serving path: one launch after the last layer, which
its finish event follows), and an all-layer backup, timed with CUDA events (median of ``--repeats``,
verified and unverified runs interleaved), after warm-up. The ceiling is ``cudaMemcpyAsync`` of the
same bytes between one pinned buffer and one device buffer, in the same run. ``overhead`` is
verified / unverified - 1; the goal is <= 0.03 at 4096 and 32768 tokens. The verified runs end with
``check_verified()`` (nothing may be reported: every page is clean). Also reported: the host time of
one verified and one unverified per-layer load call (``time.perf_counter`` around the call, the GPU
kept busy so it measures submission only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field

import torch

import hicache_core as hc
import hicache_core.verification.check_batch as hc_check_batch
import hicache_core.verification.page_checksum as hc_page_checksum
from hicache_core.plugins.registry import get_registry
from hicache_core.pool.device_pools import DeclaredDevicePool


def _median_ms(fn, repeats: int) -> float:
    return _interleaved_ms({"fn": fn}, repeats)["fn"]


def _interleaved_ms(fns: dict, repeats: int, samples: dict | None = None) -> dict[str, float]:
    """Median CUDA-event time of each function, their runs interleaved (the order alternating each repeat),
    so that a drift of the machine during the run weighs on all of them alike; ``samples`` gets every time."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            start.record()
            fns[name]()
            stop.record()
            stop.synchronize()
            times[name].append(start.elapsed_time(stop))
    if samples is not None:
        samples.update(times)
    return {name: statistics.median(t) for name, t in times.items()}


@dataclass(frozen=True)
class Geometry:
    """One model's pool of a kind, per GPU: what the matrix times verification on.

    ``rows``: per component, ``(heads, dim)`` for token kinds and ``(bytes per page,)`` for page kinds;
    ``page``: the page size it is served with (``None``: ``--page``); ``tokens_per_item``: where an item is
    not a token slot (Mamba's is one request), the tokens of context one item stands for.
    """

    layers: int
    rows: dict[str, tuple[int, ...]]
    model: str
    dtype: torch.dtype = torch.bfloat16
    extras: dict[str, int] = field(default_factory=dict)
    page: int | None = None
    tokens_per_item: int = 1


#: The geometry of each built-in pool kind. The benchmark refuses a registered kind missing here rather
#: than leave it out of the matrix; the DeepSeek-V4 and MiniMax rows are assumed sizes of the right order.
GEOMETRIES: dict[str, Geometry] = {
    "mha": Geometry(32, {"k": (8, 128), "v": (8, 128)}, "Llama-3-8B: 8 KV heads x 128"),
    "mha_asym": Geometry(48, {"k": (4, 192), "v": (4, 128)}, "MiMo-V2-like: head_dim 192, v_head_dim 128"),
    "mha_k_only": Geometry(60, {"k": (1, 128)}, "MiniMax-like sparse index-K: one 128-wide head"),
    "mla": Geometry(
        61, {"kv": (1, 576)}, "DeepSeek-V3: 512 latent + 64 rope", extras={"kv_lora_rank": 512, "qk_rope_head_dim": 64}
    ),
    "page_rows": Geometry(61, {"row": (64 * 132,)}, "DeepSeek-V3.2 DSA indexer: 64 x (128 + 4) bytes a page"),
    "dsv4_paged": Geometry(61, {"row": (16 * 584,)}, "DeepSeek-V4-like C4 KV (assumed): 16 entries x 584 bytes"),
    "dsv4_state": Geometry(61, {"state": (8 * 4096,)}, "DeepSeek-V4-like compress state (assumed): ring 8 x 4 KiB"),
    "mamba": Geometry(
        36,
        {"temporal": (32 * 128 * 128 * 4,), "conv": (8192 * 3 * 2,)},
        "Qwen3-Next-80B linear attention: SSM state 32 x 128 x 128 fp32, conv 8192 x 3 bf16; "
        "one item per request of 512 tokens",
        page=1,
        tokens_per_item=512,
    ),
    "nvfp4_page_rows": Geometry(
        60, {"row": (64 * 8 * 72,)}, "MiniMax-M3-like NVFP4 K (assumed): 8 heads x (64 + 8) bytes a token"
    ),
    "vllm_page": Geometry(
        32,
        {"page": (16 * 2 * 8 * 128 * 2,)},
        "vLLM's KV block of Llama-3-8B (hicache-vllm): 16 tokens x (K, V) x 8 heads x 128 bf16, 64 KiB a block",
        page=16,
    ),
    "kv_scale_pages": Geometry(
        32, {"k_scale": (64 * 32,), "v_scale": (64 * 32,)}, "MXFP8 scales of Llama-3-8B: one E8M0 per 32 elements"
    ),
}


def geometry(kind: str) -> Geometry:
    if kind not in GEOMETRIES:
        raise SystemExit(f"no geometry for pool kind {kind!r}: add one to verify_cost.GEOMETRIES")
    return GEOMETRIES[kind]


def items_and_page(kind: str, tokens: int, page: int) -> tuple[int, int]:
    """The items (token slots, or requests) standing for ``tokens`` of context, and the page size they use."""
    g = geometry(kind)
    page = g.page or page
    items = tokens // g.tokens_per_item
    if items < page or items % page:
        raise SystemExit(f"{kind}: {tokens} tokens make {items} items, not a whole number of {page}-item pages")
    return items, page


def device_pool(kind: str, items: int, page: int, device: str = "cuda"):
    """The device pool of ``kind`` in its :data:`GEOMETRIES` geometry, ``items`` of it in use, random bytes."""
    g = geometry(kind)
    decl = get_registry().pool_kinds[kind]
    dp = DeclaredDevicePool(decl, items + 4 * page, page, g.layers, device, dtype=g.dtype, rows=g.rows,
                               extras=g.extras)  # fmt: skip
    fill_random(dp)
    return dp


def fill_random(dp) -> None:
    """Random bytes in every device row of ``dp`` (what backups take the checksums of)."""
    for comp in get_registry().pool_kinds[dp.pool_kind].components:
        for t in getattr(dp, comp.device_attr):
            t.view(torch.uint8).random_(0, 256)


def pool_pair(kind: str, layout: str, io: str, tokens: int, page: int, apart: bool = False):
    """The device pool of ``kind`` and, per verify setting (False, True), a host pool holding ``tokens`` of it,
    backed up: ``(host, host indices as ``io`` takes them, device indices)``. ``apart``: also a verifying pool
    whose loads are checked apart from the copy (key ``"apart"``), where ``True``'s may be checked in it."""
    items, page = items_and_page(kind, tokens, page)
    dp = device_pool(kind, items, page)
    pools = {}
    for verify in (False, True, "apart") if apart else (False, True):
        host = hc.make_host_pool(dp, layout=layout, io_backend=io, verify=bool(verify), size=2 * (items + 4 * page))
        if verify == "apart":
            host.verifier = host.verification.make_verifier(in_copy=False)
        slots = host.alloc(items)
        dev = torch.arange(page, page + items, device="cuda")
        hs = slots.cuda() if io != "direct" else slots
        host.backup_from_device_all_layer(dp, hs, dev, io)
        pools[verify] = (host, hs, dev)
    torch.cuda.synchronize()
    return dp, pools


def host_call_us(host, dp, hs, dev, io: str, layers: int) -> list[float]:
    """Host time of each per-layer load call of one load, in µs, with the GPU busy (submission only)."""
    torch.cuda._sleep(50_000_000)
    marks = [time.perf_counter()]
    for layer in range(layers):
        host.load_to_device_per_layer(dp, hs, dev, layer, io)
        marks.append(time.perf_counter())
    torch.cuda.synchronize()
    return [(b - a) * 1e6 for a, b in zip(marks, marks[1:])]


def _tag(verify: bool | str) -> str:
    return verify if isinstance(verify, str) else "verified" if verify else "plain"


def _case(kind: str, layout: str, io: str, tokens: int, page: int, repeats: int, apart: bool = False) -> dict:
    items, page = items_and_page(kind, tokens, page)
    dp, pools = pool_pair(kind, layout, io, tokens, page, apart)
    layers = dp.layer_num
    row = {"pool": kind, "layout": layout, "io_backend": io, "tokens": tokens, "items": items, "page": page,
           "layers": layers, "model": geometry(kind).model}  # fmt: skip
    fns, hosts = {}, {}
    loads: dict[str, list] = {_tag(v): [] for v in pools}
    for verify, (host, hc_slots, dev) in pools.items():
        tag = _tag(verify)

        def backup(host=host, hc_slots=hc_slots, dev=dev):
            host.backup_from_device_all_layer(dp, hc_slots, dev, io)

        def load(host=host, hc_slots=hc_slots, dev=dev):
            for layer in range(layers):
                host.load_to_device_per_layer(dp, hc_slots, dev, layer, io)

        def layerwise(host=host, hc_slots=hc_slots, dev=dev, tag=tag):
            # The serving path: the layer loader's thread submits every layer; a verifying pool checks
            # them in one launch after the last; the finish event follows the checks. Its own events also
            # time it on the GPU alone, from the loader's first copy to the finish (read after the repeat).
            called = time.perf_counter()
            load = host.submit_load(dp, hc_slots, dev, io, timing=True)
            load.finish_event.wait()
            loads[tag].append((load, called))

        hosts[tag] = (host, hc_slots, dev)
        fns.update({f"backup_ms_{tag}": backup, f"load_ms_{tag}": load, f"layerwise_ms_{tag}": layerwise})
    for _ in range(3):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    # Verified and plain runs interleaved, each kind of transfer in its own series.
    samples: dict[str, list[float]] = {}
    for kind_ in ("backup", "load", "layerwise"):
        for tag in loads:
            loads[tag].clear()
        row.update(_interleaved_ms({k: f for k, f in fns.items() if k.startswith(kind_ + "_")}, repeats, samples))
    for tag, done in loads.items():  # the layer-wise loads of the series: GPU time from their own events
        gpu = [d.start_event.elapsed_time(d.finish_event) for d, _ in done]
        row[f"layerwise_gpu_ms_{tag}"] = statistics.median(gpu)
        samples[f"layerwise_gpu_ms_{tag}"] = gpu
        # Host time from the call to the loader's thread taking the job (the hand-over).
        handover = [(d.submitted_at - called) * 1e6 for d, called in done]
        row[f"layerwise_handover_us_{tag}"] = statistics.median(handover)
        samples[f"layerwise_handover_us_{tag}"] = handover
    row["samples_ms"] = samples
    for tag, (host, hc_slots, dev) in hosts.items():
        # The mean over a load, and call by call: a verified run's first call moves its indices and its
        # last launches the check.
        us = host_call_us(host, dp, hc_slots, dev, io, layers)
        row[f"load_host_us_per_call_{tag}"] = sum(us) / layers
        row[f"load_host_us_first_middle_last_{tag}"] = [us[0], statistics.median(us[1:-1]), us[-1]]
        host.check_dropped()
        if tag != "plain":
            host.check_verified()  # every page clean: nothing may be reported
            row[f"checked_in_copy_{tag}"] = {name: not why for name, why in host.verification.in_copy.items()}
        if tag == "verified":
            row["implementations"] = dict(host.implementations)
        nbytes = host.get_size_per_token() * items
        host.destroy()
    row["bytes"] = nbytes
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dbuf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    row["ceiling_h2d_ms"] = _median_ms(lambda: dbuf.copy_(pinned, non_blocking=True), repeats)
    row["ceiling_d2h_ms"] = _median_ms(lambda: pinned.copy_(dbuf, non_blocking=True), repeats)
    row["load_overhead"] = row["load_ms_verified"] / row["load_ms_plain"] - 1
    row["layerwise_overhead"] = row["layerwise_ms_verified"] / row["layerwise_ms_plain"] - 1
    row["layerwise_gpu_overhead"] = row["layerwise_gpu_ms_verified"] / row["layerwise_gpu_ms_plain"] - 1
    row["backup_overhead"] = row["backup_ms_verified"] / row["backup_ms_plain"] - 1
    if apart:
        row["load_overhead_apart"] = row["load_ms_apart"] / row["load_ms_plain"] - 1
        row["layerwise_overhead_apart"] = row["layerwise_ms_apart"] / row["layerwise_ms_plain"] - 1
    row["load_of_ceiling_plain"] = row["ceiling_h2d_ms"] / row["load_ms_plain"]
    row["load_of_ceiling_verified"] = row["ceiling_h2d_ms"] / row["load_ms_verified"]
    row["backup_of_ceiling_verified"] = row["ceiling_d2h_ms"] / row["backup_ms_verified"]
    return row


def matrix_cases(spec: str) -> list[tuple[str, str]]:
    """``pool:layout`` pairs from ``spec``; ``all``: every registered kind in every layout it allows."""
    if spec != "all":
        return [tuple(c.split(":")) for c in spec.split(",")]  # type: ignore[misc]
    reg = get_registry()
    return [(name, layout) for name, kind in reg.pool_kinds.items()
            for layout in sorted(kind.layouts or reg.layouts)]  # fmt: skip


def load_bytes(kind: str, tokens: int, page: int) -> int:
    """Bytes one whole load of ``tokens`` moves, from the geometry alone (no pool made)."""
    g, decl = geometry(kind), get_registry().pool_kinds[kind]
    items, page = items_and_page(kind, tokens, page)
    per_item = sum(math.prod(g.rows[c.name]) for c in decl.components)
    if decl.items_are_pages:
        return items // page * g.layers * per_item
    return items * g.layers * per_item * g.dtype.itemsize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSON file to write (rewritten after every case)")
    ap.add_argument("--tokens", default="4096,32768", help="cached tokens, comma-separated")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--io", default="kernel,direct", help="io backends, comma-separated")
    ap.add_argument("--cases", default="mha:page_first,mha:layer_first,mla:page_first",
                    help="pool:layout pairs, comma-separated, or 'all' (every registered kind and layout)")  # fmt: skip
    ap.add_argument("--list", action="store_true", help="print the cases and the bytes each load moves; no GPU")
    ap.add_argument("--copy-engine-runs", type=int, default=None,
                    help="runs a copy-engine load's checks are launched in (default: the library's)")  # fmt: skip
    ap.add_argument("--row-pages", type=int, default=None,
                    help="pages a check program takes where a page is one narrow row (default: ROW_PAGES)")  # fmt: skip
    ap.add_argument("--apart", action="store_true",
                    help="also time verified loads checked apart (where the copy could check them)")  # fmt: skip
    args = ap.parse_args()
    cases = [(int(t), kind, layout, io) for t in args.tokens.split(",") for kind, layout in matrix_cases(args.cases)
             for io in args.io.split(",")]  # fmt: skip
    if args.list:
        for tokens, kind, layout, io in cases:
            print(f"{tokens:6} {kind:16} {layout:20} {io:7} {load_bytes(kind, tokens, args.page) / 2**20:9.1f} MiB")
        total = sum(load_bytes(kind, tokens, args.page) for tokens, kind, _, _ in cases)
        print(f"{len(cases)} cases, {total / 2**30:.1f} GiB a load each")
        return
    if not args.out:
        raise SystemExit("--out is required (or --list)")
    if args.copy_engine_runs is not None:
        hc_check_batch.CHECK_RUNS_COPY_ENGINE = args.copy_engine_runs
    if args.row_pages is not None:
        hc_page_checksum.ROW_PAGES = args.row_pages
    if not torch.cuda.is_available():
        raise SystemExit("verify_cost.py measures the GPU: run it on the GPU machine")
    what = (
        "host-tier verification cost: verified vs unverified, same run; goal <= 0.03 at 4096 and 32768 tokens; "
        f"copy-engine loads checked in {hc_check_batch.CHECK_RUNS_COPY_ENGINE} run(s); pages of one narrow row checked "
        f"{hc_page_checksum.ROW_PAGES} a program"
    )
    rows = []
    for tokens, kind, layout, io in cases:
        head = {"pool": kind, "layout": layout, "io_backend": io, "tokens": tokens}
        try:
            rows.append(_case(kind, layout, io, tokens, args.page, args.repeats, args.apart))
        except hc.UnsupportedCombinationError as exc:
            rows.append(head | {"refused": str(exc).splitlines()[0]})
        except Exception as exc:  # one case's failure is a row of the result, not the end of the run
            rows.append(head | {"error": f"{type(exc).__name__}: {exc}"})
        finally:
            torch.cuda.empty_cache()
        write_result(args.out, what, rows, quiet=True)  # a run cut short keeps the cases it finished
        r = rows[-1]
        if "refused" in r or "error" in r:
            print(f"{tokens:6} {kind:16} {layout:20} {io:7} {r.get('refused') or r['error']}")
            continue
        print(f"{tokens:6} {kind:16} {layout:20} {io:7} load {r['load_ms_plain']:.3f} -> {r['load_ms_verified']:.3f} "
              f"ms ({r['load_overhead']:+.1%}), layer-wise {r['layerwise_ms_plain']:.3f} -> "
              f"{r['layerwise_ms_verified']:.3f} ms ({r['layerwise_overhead']:+.1%}; on the GPU alone "
              f"{r['layerwise_gpu_overhead']:+.1%}; hand-over {r['layerwise_handover_us_plain']:.0f} / "
              f"{r['layerwise_handover_us_verified']:.0f} us), "
              f"backup {r['backup_ms_plain']:.3f} -> {r['backup_ms_verified']:.3f} "
              f"ms ({r['backup_overhead']:+.1%}); ceiling h2d {r['ceiling_h2d_ms']:.3f} ms; host us a per-layer call "
              f"(first/middle/last) {_calls(r, 'plain')} / {_calls(r, 'verified')}"
              + (f"; apart: load {r['load_ms_apart']:.3f} ({r['load_overhead_apart']:+.1%}), layer-wise "
                 f"{r['layerwise_ms_apart']:.3f} ({r['layerwise_overhead_apart']:+.1%}), host {_calls(r, 'apart')}"
                 if args.apart else ""))  # fmt: skip
    write_result(args.out, what, rows)


def _calls(row: dict, tag: str) -> str:
    return "-".join(f"{us:.0f}" for us in row[f"load_host_us_first_middle_last_{tag}"])


def write_result(path: str, what: str, rows: list[dict], quiet: bool = False) -> None:
    """Write ``rows`` as a GPU result JSON with the machine and versions of this run (also checksum_kernel.py's)."""
    import triton

    out = {
        "what": what,
        "machine": {
            "gpu": torch.cuda.get_device_name(),
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "loadavg": open("/proc/loadavg").read().split()[:3],
        },  # fmt: skip
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
        "rows": rows,
    }
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    if not quiet:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
