"""Store and load of vLLM-shaped KV blocks through hicache-vllm's block mover, against cudaMemcpyAsync.

Run on a GPU machine (no vLLM needed)::

    python3 integrations/vllm/bench_cuda.py --out benchmarks/results/vllm-bench-h200.json [--quick]

For each model shape (vLLM's per-layer pages ``[num_blocks, page_bytes]``), io backend and host layout,
a job of N random device blocks is stored into host chunks and loaded back into other blocks, the way
vLLM's OffloadingConnector drives it (one ``submit_*`` and ``wait`` per job, copies on the mover's
own streams). Reported: GPU time of the job (CUDA events on the mover's stream), wall time from submit
to ``wait`` returning, GB/s as bytes over the link / GPU time, and that as a fraction of the ceiling: one
contiguous pinned ``cudaMemcpyAsync`` (``Tensor.copy_(non_blocking=True)``) of the same bytes, measured in
the same run. Every loaded block is compared byte for byte once (not timed).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from hicache_vllm.mover import BlockMover  # noqa: E402

# name: (layers, bytes per layer page)
SHAPES = {
    # Llama-3-8B, fp16, 8 KV heads x 128, vLLM's default 16-token block: 64 KiB per layer page
    "llama-8b-b16": (32, 8 * 2 * 16 * 128 * 2),
    # the same with 64-token blocks: 256 KiB
    "llama-8b-b64": (32, 8 * 2 * 64 * 128 * 2),
    # DeepSeek-V3 MLA, bf16, 576-wide latent+rope rows, 64-token blocks: 72 KiB
    "deepseek-mla-b64": (61, 64 * 576 * 2),
}


def ceiling(nbytes: int, reps: int) -> dict:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times = []
        for _ in range(reps + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3)
        t = statistics.median(times[1:])
        out[name] = {"seconds": t, "gbps": nbytes / t / 1e9}
    del host, dev
    return out


def run_case(shape: str, blocks: int, io_backend: str, layout: str, reps: int) -> dict:
    layers, page = SHAPES[shape]
    num_blocks = max(2 * blocks + 16, 256)
    g = torch.Generator(device="cuda").manual_seed(0)
    pages = [torch.randint(-128, 127, (num_blocks, page), dtype=torch.int8, device="cuda", generator=g)
             for _ in range(layers)]  # fmt: skip
    mover = BlockMover(pages, block_size=16, num_chunks=blocks, layout=layout, io_backend=io_backend)
    rng = np.random.default_rng(0)
    perm = rng.permutation(num_blocks)
    src_blocks, dst_blocks = perm[:blocks], perm[blocks : 2 * blocks]
    chunks = rng.permutation(blocks)
    nbytes = blocks * layers * page
    rows = {"shape": shape, "layers": layers, "page_bytes": page, "blocks": blocks, "bytes": nbytes,
            "io_backend": io_backend, "layout": layout,
            "implementations": dict(mover.host.implementations)}  # fmt: skip
    job = [0]

    def timed(submit) -> tuple[float, float]:
        job[0] += 1
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        submit(job[0])
        mover.wait({job[0]})
        wall = time.perf_counter() - t0
        (done,) = mover.get_finished()
        return done.seconds, wall

    for op in ("store", "load"):
        if op == "store":
            fn = lambda j: mover.submit_store(j, src_blocks, chunks)  # noqa: E731
        else:
            fn = lambda j: mover.submit_load(j, chunks, dst_blocks)  # noqa: E731
        fn_times = [timed(fn) for _ in range(reps + 1)][1:]
        gpu = statistics.median(t for t, _ in fn_times)
        wall = statistics.median(w for _, w in fn_times)
        rows[op] = {"gpu_seconds": gpu, "wall_seconds": wall, "gbps": nbytes / gpu / 1e9,
                    "wall_gbps": nbytes / wall / 1e9}  # fmt: skip
    torch.cuda.synchronize()
    rows["byte_exact"] = all(torch.equal(p[torch.as_tensor(dst_blocks, device="cuda")],
                                         p[torch.as_tensor(src_blocks, device="cuda")]) for p in pages)  # fmt: skip
    ceil = ceiling(nbytes, reps)
    rows["ceiling"] = ceil
    rows["store"]["of_ceiling"] = rows["store"]["gbps"] / ceil["d2h"]["gbps"]
    rows["load"]["of_ceiling"] = rows["load"]["gbps"] / ceil["h2d"]["gbps"]
    mover.shutdown()
    del pages
    torch.cuda.empty_cache()
    return rows


def machine() -> dict:
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "host": platform.node(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,pcie.link.gen.current,"
                                         "pcie.link.width.current", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=30).stdout.strip()  # fmt: skip
    except OSError:
        info["driver"] = "unknown"
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        info["git"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE,
                                     timeout=30).stdout.strip()  # fmt: skip
    except OSError:
        info["git"] = "unknown"
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/vllm-bench-cuda.json")
    ap.add_argument("--quick", action="store_true", help="one shape, one job size, 3 repetitions")
    ap.add_argument("--io-backends", default="auto,direct,kernel")
    ap.add_argument("--layouts", default="page_first,layer_first")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark measures the GPU path", file=sys.stderr)
        return 2
    shapes = ["llama-8b-b16"] if args.quick else list(SHAPES)
    sizes = [256] if args.quick else [64, 512]
    reps = 3 if args.quick else 7
    record = {"what": "hicache-vllm block mover: store/load of vLLM-shaped blocks vs one cudaMemcpyAsync",
              "machine": machine(), "rows": []}  # fmt: skip
    for shape in shapes:
        for blocks in sizes:
            for io_backend in args.io_backends.split(","):
                for layout in args.layouts.split(","):
                    try:
                        row = run_case(shape, blocks, io_backend, layout, reps)
                    except Exception as exc:  # noqa: BLE001 - a refused combination is a row that says why
                        row = {"shape": shape, "blocks": blocks, "io_backend": io_backend, "layout": layout,
                               "error": f"{type(exc).__name__}: {str(exc)[:500]}"}  # fmt: skip
                    record["rows"].append(row)
                    case = f"{shape:18} {blocks:4} {io_backend:7} {layout:12}"
                    if "error" in row:
                        print(f"{case} refused: {row['error'][:120]}")
                    else:
                        print(f"{case} store {row['store']['gbps']:6.1f} GB/s "
                              f"({row['store']['of_ceiling']:.2f})  load {row['load']['gbps']:6.1f} GB/s "
                              f"({row['load']['of_ceiling']:.2f})  ceiling h2d {row['ceiling']['h2d']['gbps']:.1f} "
                              f"d2h {row['ceiling']['d2h']['gbps']:.1f}  exact={row['byte_exact']}")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")
    bad = [r for r in record["rows"] if r.get("byte_exact") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
