"""The copy engine's submission measurements on a GPU: one JSON, every figure beside a ceiling of the same run.

    python3 scripts/gpu/submission_check.py --out DIR

1. ``prefix``: a 32-layer per-layer load of 8192 tokens (llama-8b, page 64: 128 pages per layer,
   random pages) issued as SGLang does (every layer's call, then an event, on a load stream),
   for each submission setting of ``direct``: the host time until the last call returns, the
   GPU time to the last event, the bytes over that against the copy-engine ceiling, and a
   byte check of every layer against the reference.
2. ``graph``: the same load captured in a CUDA graph (one pattern): capture, instantiate and
   replay host times.
3. ``mla``: DeepSeek MLA per-layer loads of 4096 and 32768 tokens, queued back to back, for
   direct's batch settings, and the copy-engine ceiling at that size.
4. ``small``: a 64-token load's host time through the pool for kernel, jit and direct.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch

import hicache_core as hc
from hicache_core.tools.bench.ceilings import memcpy_seconds
from hicache_core.tools.bench.clock import host_us, queued_seconds
from hicache_core.tools.bench.machine import measure_ceiling
from hicache_core.tools.bench.records import environment
from hicache_core.tools.demo import random_pages
from hicache_core.tools.shapes import SHAPES

PAGE = 64
SETTINGS = {  # name: (thread, first_batch, max_batch)
    "caller-thread, batches of 32 (before the worker)": (False, 0, 32),
    "caller-thread, 32 then the rest": (False, 32, 0),
    "caller-thread, one batch per layer": (False, 0, 0),
    "worker, batches of 32": (True, 0, 32),
    "worker, 32 then the rest": (True, 32, 0),
    "worker, one batch per layer": (True, 0, 0),
}


def _set(impl, thread: bool, first: int, most: int) -> None:
    c = impl.copier
    c.thread, c.first_batch, c.max_batch = thread, first, most
    c.thread_max = 0  # every call of this check goes where the setting says


def _pools(shape_name: str, tokens: int, layout: str):
    shape = SHAPES[shape_name]
    dev = shape.device_pool(2 * tokens + 2 * PAGE, page_size=PAGE, device="cuda")
    host = hc.make_host_pool(dev, layout=layout, io_backend="direct", size=dev.size, operations=(hc.LOAD,))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for t in host.plan.host_buffers.values():
        flat = t.reshape(-1).view(torch.uint8)
        for s in range(0, flat.numel(), 256 << 20):
            part = flat[s : s + (256 << 20)]
            part.copy_(torch.randint(0, 256, part.shape, dtype=torch.uint8, device="cuda", generator=gen))
    g = torch.Generator().manual_seed(1)
    hp = random_pages(host.page_num + 1, tokens // PAGE, PAGE, g) - PAGE
    dp = random_pages(dev.size // PAGE, tokens // PAGE, PAGE, g)
    return shape, dev, host, hp, dp


def _device_rows(dev) -> list[torch.Tensor]:
    return [t for a in ("k_buffer", "v_buffer", "kv_buffer") for t in (getattr(dev, a, None) or [])]


def prefix(ceiling: dict) -> list[dict]:
    rows = []
    for layout in ("layer_first", "page_first_direct"):
        shape, dev, host, hp, dp = _pools("llama-8b", 8192, layout)
        layers = host.layer_num
        impl = host.implementation_for(hc.LOAD)
        ref = hc.make_host_pool(dev, layout=layout, io_backend="reference", size=dev.size, operations=(hc.LOAD,))
        for name, t in host.plan.host_buffers.items():
            ref.plan.host_buffers[name].copy_(t)
        # The expected rows of every layer (reference), then the pool poisoned before each setting.
        for layer in range(layers):
            ref.load_to_device_per_layer(dev, hp, dp, layer, "reference")
        rows_idx = dp.cuda()
        want = [t[rows_idx].view(torch.int16).clone() for t in _device_rows(dev)]  # bf16 NaNs never compare
        nbytes = 8192 * shape.item_bytes() * layers
        load = torch.cuda.Stream()
        for setting, (thread, first, most) in SETTINGS.items():
            _set(impl, thread, first, most)
            hosts, gpus = [], []
            for rep in range(6):
                for t in _device_rows(dev):
                    t.fill_(0x5A)
                events = [torch.cuda.Event(enable_timing=True) for _ in range(layers + 1)]
                torch.cuda.synchronize()
                with torch.cuda.stream(load):
                    events[0].record(load)
                    t0 = time.perf_counter()
                    for layer in range(layers):
                        impl.load_to_device_per_layer(hp, dp, layer)
                        events[layer + 1].record(load)
                    t1 = time.perf_counter()
                torch.cuda.synchronize()
                impl.flush()
                ok = all(torch.equal(t[rows_idx].view(torch.int16), w) for t, w in zip(_device_rows(dev), want))
                if not ok:
                    raise SystemExit(f"prefix {layout} {setting}: the loaded rows differ from the reference")
                if rep:  # the first is a warm-up (runs found, worker started)
                    hosts.append(t1 - t0)
                    gpus.append(events[0].elapsed_time(events[-1]) / 1e3)
            gpu = statistics.median(gpus)
            rows.append({"metric": "prefix_submission", "layout": layout, "setting": setting, "layers": layers,
                         "tokens": 8192, "pages_per_layer": 8192 // PAGE,
                         "host_submit_s": statistics.median(hosts), "host_submit_max_s": max(hosts),
                         "gpu_s": gpu, "bytes": nbytes, "fraction_of_ceiling": nbytes / gpu / 1e9 / ceiling["h2d_gbps"],
                         "byte_exact": True, "path": impl.path})  # fmt: skip
            r = rows[-1]
            print(f"prefix {layout:18} {setting:42} host {r['host_submit_s'] * 1e3:6.2f} ms  gpu {gpu * 1e3:6.2f} ms "
                  f"({r['fraction_of_ceiling']:.2f} of the ceiling)", flush=True)  # fmt: skip
        if layout == "layer_first":
            rows += graph(impl, hp, dp, layers)
        host.destroy()
        ref.destroy()
        del dev
        torch.cuda.empty_cache()
    return rows


def graph(impl, hp, dp, layers: int) -> list[dict]:
    """One index pattern captured once (the copies go one cudaMemcpyAsync per run under capture)."""
    _set(impl, False, 0, 32)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.graph(g, stream=s):
        for layer in range(layers):
            impl.load_to_device_per_layer(hp, dp, layer)
    t1 = time.perf_counter()  # torch instantiates at the end of capture
    replay = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        g.replay()
        replay.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    row = {"metric": "prefix_graph", "layout": "layer_first", "capture_and_instantiate_s": t1 - t0,
           "replay_host_s": statistics.median(replay), "layers": layers}  # fmt: skip
    print(f"graph: capture+instantiate {row['capture_and_instantiate_s'] * 1e3:.1f} ms, replay host "
          f"{row['replay_host_s'] * 1e3:.3f} ms", flush=True)  # fmt: skip
    del g
    return [row]


def mla() -> list[dict]:
    rows = []
    shape, dev, host, hp_all, dp_all = _pools("deepseek-mla", 32768, "page_first_direct")
    impl = host.implementation_for(hc.LOAD)
    for tokens in (4096, 32768):
        hp, dp = hp_all[:tokens], dp_all[:tokens]
        nbytes = tokens * shape.item_bytes()
        ce = nbytes / memcpy_seconds(nbytes, True) / 1e9
        load = torch.cuda.Stream()
        for setting, (thread, first, most) in SETTINGS.items():
            _set(impl, thread, first, most)
            calls = [partial(impl.load_to_device_per_layer, hp, dp, layer) for layer in range(16)]
            with torch.cuda.stream(load):  # a stream of its own, as a server's load stream (the worker needs one)
                per_call = queued_seconds(calls)
            impl.flush()
            rows.append({"metric": "mla_load_queued", "tokens": tokens, "setting": setting, "bytes": nbytes,
                         "seconds": per_call, "gbps": nbytes / per_call / 1e9, "copy_engine_gbps_at_size": ce,
                         "fraction_of_ceiling": nbytes / per_call / 1e9 / ce})  # fmt: skip
            print(f"mla {tokens:6} {setting:42} {rows[-1]['fraction_of_ceiling']:.2f} of the copy engine at this size "
                  f"({ce:.1f} GB/s)", flush=True)  # fmt: skip
    host.destroy()
    del dev
    torch.cuda.empty_cache()
    return rows


def small() -> list[dict]:
    rows = []
    shape = SHAPES["llama-8b"]
    dev = shape.device_pool(4096, page_size=PAGE, device="cuda")
    g = torch.Generator().manual_seed(2)
    hp = random_pages(dev.size // PAGE, 1, PAGE, g)
    dp = random_pages(dev.size // PAGE, 1, PAGE, g)
    for backend, name in (("direct", "direct.copy_engine"), ("kernel", "kernel.triton_uva"), ("jit", "jit.one_layer")):
        try:
            host = hc.make_host_pool(dev, layout="layer_first", io_backend=backend, size=dev.size,
                                     operations=(hc.LOAD,), validate=False)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a plugin missing here is one row
            rows.append({"metric": "small_host_us", "implementation": name, "error": str(exc)})
            continue
        impl = host.implementation_for(hc.LOAD)
        if hasattr(impl, "max_ctas"):
            impl.max_ctas = 8
        h, d = (hp.cuda(), dp.cuda()) if impl.index_device == "device" else (hp, dp)
        us = host_us(partial(host.load_to_device_per_layer, dev, h, d, 1, backend))
        rows.append({"metric": "small_host_us", "implementation": name, "tokens": PAGE, "host_us": us})
        print(f"64-token load through the pool: {name:22} {us:6.2f} us", flush=True)
        host.destroy()
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp")
    p.add_argument("--only", default="prefix,mla,small")
    args = p.parse_args()
    ceiling = measure_ceiling(1 << 30)
    print(f"ceiling: H2D {ceiling['h2d_gbps']:.1f} GB/s, D2H {ceiling['d2h_gbps']:.1f} GB/s", flush=True)
    records: list[dict] = []
    out = Path(args.out) / "submission-check.json"
    for part in args.only.split(","):
        records += {"prefix": prefix, "mla": mla, "small": small}[part](*((ceiling,) if part == "prefix" else ()))
        out.write_text(json.dumps({"environment": environment(), "ceiling": ceiling, "records": records}, indent=1))
    from hicache_core.tools.bench.plots import plot_submission

    plot_submission(out.with_suffix(".png"), records)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
