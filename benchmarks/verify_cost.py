"""What host-tier verification costs: verified against unverified loads and backups, beside the copy ceiling.

Run on the GPU machine (one process, every figure from the same run)::

    pip install --no-deps --no-build-isolation --no-index -e . -e plugins/*
    python benchmarks/verify_cost.py --out $OUT/verify-cost-h200.json [--tokens 4096] [--repeats 30]

Pools: llama-8b-like MHA (32 layers, 8 KV heads, head_dim 128, bf16, page 64, ``page_first`` and
``layer_first``) and an MLA pool (61 layers, 576 x bf16, page 64, ``page_first``), at ``--tokens``
cached tokens. Per pool, io backend and verify setting: a 32-layer (61 for MLA) per-layer load of
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
import os
import platform
import statistics
import time

import torch

import hicache_core as hc
import hicache_core.verify as hc_verify


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


def _pools(kind: str, tokens: int, page: int):
    """The device pool of ``kind`` for ``tokens`` cached tokens, filled with random bytes."""
    size = tokens + 4 * page
    if kind == "mha":
        dp = hc.MHADevicePool(size, page, torch.bfloat16, 8, 128, 32, "cuda")
    else:
        dp = hc.MLADevicePool(size, page, torch.bfloat16, 512, 64, 61, "cuda")
    for t in (dp.k_buffer + dp.v_buffer) if kind == "mha" else dp.kv_buffer:
        t.copy_(torch.randint(-(2**15), 2**15, t.shape, dtype=torch.int16, device="cuda").view(t.dtype))
    return dp


def pool_pair(kind: str, layout: str, io: str, tokens: int, page: int):
    """The device pool of ``kind`` and, per verify setting (False, True), a host pool holding ``tokens`` of it,
    backed up: ``(host, host indices as ``io`` takes them, device indices)``."""
    dp = _pools(kind, tokens, page)
    pools = {}
    for verify in (False, True):
        host = hc.make_host_pool(dp, layout=layout, io_backend=io, verify=verify, size=2 * (tokens + 4 * page))
        slots = host.alloc(tokens)
        dev = torch.arange(page, page + tokens, device="cuda")
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


def _case(kind: str, layout: str, io: str, tokens: int, page: int, repeats: int) -> dict:
    dp = _pools(kind, tokens, page)
    layers = dp.layer_num
    row = {"pool": kind, "layout": layout, "io_backend": io, "tokens": tokens, "layers": layers}
    fns, hosts = {}, {}
    loads: dict[str, list] = {"plain": [], "verified": []}
    for verify in (False, True):
        host = hc.make_host_pool(dp, layout=layout, io_backend=io, verify=verify, size=2 * (tokens + 4 * page))
        slots = host.alloc(tokens)
        dev = torch.arange(page, page + tokens, device="cuda")
        hc_slots = slots.cuda() if io != "direct" else slots

        def backup(host=host, hc_slots=hc_slots, dev=dev):
            host.backup_from_device_all_layer(dp, hc_slots, dev, io)

        def load(host=host, hc_slots=hc_slots, dev=dev):
            for layer in range(layers):
                host.load_to_device_per_layer(dp, hc_slots, dev, layer, io)

        def layerwise(host=host, hc_slots=hc_slots, dev=dev, tag="verified" if verify else "plain"):
            # The serving path: the layer loader's thread submits every layer; a verifying pool checks
            # them in one launch after the last; the finish event follows the checks. Its own events also
            # time it on the GPU alone, from the loader's first copy to the finish (read after the repeat).
            called = time.perf_counter()
            load = host.submit_load(dp, hc_slots, dev, io, timing=True)
            load.finish_event.wait()
            loads[tag].append((load, called))

        tag = "verified" if verify else "plain"
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
        if tag == "verified":
            host.check_verified()  # every page clean: nothing may be reported
            row["implementations"] = dict(host.implementations)
        nbytes = host.get_size_per_token() * tokens
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
    row["load_of_ceiling_plain"] = row["ceiling_h2d_ms"] / row["load_ms_plain"]
    row["load_of_ceiling_verified"] = row["ceiling_h2d_ms"] / row["load_ms_verified"]
    row["backup_of_ceiling_verified"] = row["ceiling_d2h_ms"] / row["backup_ms_verified"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--tokens", default="4096,32768", help="cached tokens, comma-separated")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--io", default="kernel,direct", help="io backends, comma-separated")
    ap.add_argument("--cases", default="mha:page_first,mha:layer_first,mla:page_first",
                    help="pool:layout pairs, comma-separated")  # fmt: skip
    ap.add_argument("--copy-engine-runs", type=int, default=None,
                    help="runs a copy-engine load's checks are launched in (default: the library's)")  # fmt: skip
    args = ap.parse_args()
    if args.copy_engine_runs is not None:
        hc_verify.CHECK_RUNS_COPY_ENGINE = args.copy_engine_runs
    if not torch.cuda.is_available():
        raise SystemExit("verify_cost.py measures the GPU: run it on the GPU machine")
    rows = []
    cases = [tuple(c.split(":")) for c in args.cases.split(",")]
    for tokens, (kind, layout), io in [(int(t), c, io) for t in args.tokens.split(",") for c in cases
                                       for io in args.io.split(",")]:  # fmt: skip
        try:
            rows.append(_case(kind, layout, io, tokens, args.page, args.repeats))
        except hc.UnsupportedCombinationError as exc:
            rows.append({"pool": kind, "layout": layout, "io_backend": io, "refused": str(exc).splitlines()[0]})
        r = rows[-1]
        if "refused" in r:
            print(f"{tokens:6} {kind:4} {layout:12} {io:7} refused")
            continue
        print(f"{tokens:6} {kind:4} {layout:12} {io:7} load {r['load_ms_plain']:.3f} -> {r['load_ms_verified']:.3f} ms "
              f"({r['load_overhead']:+.1%}), layer-wise {r['layerwise_ms_plain']:.3f} -> "
              f"{r['layerwise_ms_verified']:.3f} ms ({r['layerwise_overhead']:+.1%}; on the GPU alone "
              f"{r['layerwise_gpu_overhead']:+.1%}; hand-over {r['layerwise_handover_us_plain']:.0f} / "
              f"{r['layerwise_handover_us_verified']:.0f} us), "
              f"backup {r['backup_ms_plain']:.3f} -> {r['backup_ms_verified']:.3f} "
              f"ms ({r['backup_overhead']:+.1%}); ceiling h2d {r['ceiling_h2d_ms']:.3f} ms; host us a per-layer call "
              f"(first/middle/last) {_calls(r, 'plain')} / {_calls(r, 'verified')}")  # fmt: skip
    what = (
        "host-tier verification cost: verified vs unverified, same run; goal <= 0.03 at 4096 and 32768 tokens; "
        f"copy-engine loads checked in {hc_verify.CHECK_RUNS_COPY_ENGINE} run(s)"
    )
    write_result(args.out, what, rows)


def _calls(row: dict, tag: str) -> str:
    return "-".join(f"{us:.0f}" for us in row[f"load_host_us_first_middle_last_{tag}"])


def write_result(path: str, what: str, rows: list[dict]) -> None:
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
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
