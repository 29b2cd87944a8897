"""Host pools of the sizes servers ask for: bytes asked, bytes actually held and pinned, time to build, copy speed.

Run on the GPU machine (each case in a fresh process, so one case's memory never shows in the next)::

    python benchmarks/host_memory.py --out $OUT/host-memory-h200.json            # 20.4 and 60 GiB
    python benchmarks/host_memory.py --gib 0.5 --out /tmp/host-memory-cpu.json  # anywhere (no pinning on a CPU)

Per size, behind a model-shaped device pool (Llama-3-8B, MHA, ``page_first``, 64-token pages, 1 GiB on the
device), three ways to get the host memory:

* ``torch``: the host buffers as ``torch.empty(..., pin_memory=True)`` (torch's caching host allocator: what
  hicache-core 0.3 did);
* ``sglang_mmap``: the anchor, SGLang's own way since #36562: one page-aligned ``mmap`` registered with
  ``cudaHostRegister`` (no prior touch, one thread);
* ``hicache``: ``make_host_pool`` (:mod:`hicache_core.host_memory`).

Each reports bytes asked; bytes held (the process's resident set, and the system's ``MemAvailable``, before
and after); bytes pinned (torch's host-allocator statistics for ``torch``, the registration for the other
two); seconds to build and GB/s; the contiguous H2D and D2H copy speed of 2 GiB through that memory, with
torch's pinned memory measured in the same rounds (``beside``: the bar's reference) and the ceiling; and, after
the pool is closed, what is still held. A last case asks for a pool larger than the machine can give and records
that it was refused before anything was taken.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time

import torch

GIB = 1 << 30
TOKEN_BYTES = 2 * 32 * 8 * 128 * 2  # Llama-3-8B: K and V, 32 layers, 8 KV heads x 128, bf16


def _status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _available() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _torch_pinned() -> int:
    if not torch.cuda.is_available():
        return 0
    stats = torch.cuda.host_memory_stats()
    return int(stats.get("reserved_bytes.current", stats.get("allocated_bytes.current", 0)))


def _copy_speed(host: torch.Tensor) -> dict:
    """GB/s of one contiguous 2 GiB copy each way between ``host`` (its first bytes) and the GPU, and (``beside``)
    of the same copy through torch's pinned memory in the same rounds: the two alternate, best of 7 each.

    The bar compares the pool's memory with torch's: measured side by side in one process they differ by what the
    memory does, not by what the machine did between two processes (0.3 % apart there on an H100)."""
    if not torch.cuda.is_available():
        return {}
    n = min(2 * GIB, host.numel() * host.element_size())
    src = host.view(torch.uint8).reshape(-1)[:n]
    ref = torch.empty(n, dtype=torch.uint8, pin_memory=True)  # the ceiling's block, from torch's cache
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out: dict = {"beside": {"what": "torch's pinned memory, the same copies alternating with these"}}
    for name, h2d in (("h2d_gbps", True), ("d2h_gbps", False)):
        times: dict[str, list[float]] = {"pool": [], "torch": []}
        for _ in range(8):  # the first round warms both up
            for which, mem in (("pool", src), ("torch", ref)):
                start = time.perf_counter()
                (dev.copy_(mem, non_blocking=True) if h2d else mem.copy_(dev, non_blocking=True))
                torch.cuda.synchronize()
                times[which].append(time.perf_counter() - start)
        out[name] = n / min(times["pool"][1:]) / 1e9
        out["beside"][name] = n / min(times["torch"][1:]) / 1e9
    return out


def _ceiling() -> dict[str, float]:
    if not torch.cuda.is_available():
        return {}
    from hicache_core.tools.bench.machine import measure_ceiling

    return measure_ceiling()


def run_case(method: str, gib: float) -> dict:
    """One way to build a host pool of ``gib`` GiB, in this process; its figures."""
    import hicache_core as hc

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    tokens = int(gib * GIB) // TOKEN_BYTES // 64 * 64
    asked = tokens * TOKEN_BYTES
    dev = hc.MHADevicePool(size=min(GIB, asked) // TOKEN_BYTES, page_size=64, dtype=torch.bfloat16, head_num=8,
                           head_dim=128, layer_num=32, device=device)  # fmt: skip
    ceiling = _ceiling()
    hc.get_registry()  # plugins loaded first: their import is not the build's cost
    gc.collect()
    rss0, avail0, torch0 = _status("VmRSS"), _available(), _torch_pinned()
    row: dict = {"method": method, "gib_asked": gib, "asked_bytes": asked, "tokens": tokens, "device": device}
    start = time.perf_counter()
    if method == "hicache":
        pool = hc.make_host_pool(dev, layout="page_first", io_backend="auto", size=tokens, verify=False)
        host = pool.kv_buffer
        row["pinned_bytes"] = pool.host_memory.pinned_bytes
        row["mapped_bytes"] = pool.host_memory.mapped
        row["numa"] = pool.host_memory.node_reason
    elif method == "torch":
        host = torch.empty(asked, dtype=torch.uint8, pin_memory=cuda)
        pool = None
    elif method == "sglang_mmap":
        import mmap as _mmap

        size = -(-asked // _mmap.PAGESIZE) * _mmap.PAGESIZE
        region = _mmap.mmap(-1, size, flags=_mmap.MAP_PRIVATE | _mmap.MAP_ANONYMOUS)
        host = torch.frombuffer(region, dtype=torch.uint8)
        if cuda:
            err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), size, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister failed: {err}")
        row["pinned_bytes"] = size if cuda else 0
        pool = region
    else:
        raise ValueError(method)
    row["build_s"] = time.perf_counter() - start
    row["build_gbps"] = asked / row["build_s"] / 1e9
    if method == "torch":
        row["pinned_bytes"] = _torch_pinned() - torch0
    row["rss_delta_bytes"] = _status("VmRSS") - rss0
    row["available_drop_bytes"] = avail0 - _available()
    row["pinned_per_asked"] = row["pinned_bytes"] / asked if row["pinned_bytes"] else None
    row.update(_copy_speed(host))
    row["ceiling"] = ceiling
    # close: what each way gives back
    if method == "hicache":
        del host
        pool.destroy()
    elif method == "torch":
        del host
        gc.collect()
        if cuda:  # the CPU build has no host allocator to empty
            torch._C._host_emptyCache()
    else:
        if cuda:
            torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
        del host
        gc.collect()
        pool.close()
    gc.collect()
    row["rss_after_close_delta_bytes"] = _status("VmRSS") - rss0
    row["torch_pinned_after_close"] = _torch_pinned() - torch0
    return row


def refusal_case() -> dict:
    """A pool larger than the machine: refused before anything is mapped or pinned."""
    import hicache_core as hc
    from hicache_core.host_memory import HostMemoryError, read_limits

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = hc.MHADevicePool(size=1024, page_size=64, dtype=torch.bfloat16, head_num=8, head_dim=128, layer_num=32,
                           device=device)  # fmt: skip
    tokens = (read_limits().available // TOKEN_BYTES + 4096) // 64 * 64
    hc.get_registry()  # plugins loaded first: their import is not the refusal's cost
    rss0 = _status("VmRSS")
    start = time.perf_counter()
    try:
        hc.make_host_pool(dev, layout="page_first", io_backend="auto", size=tokens)
        refused = None
    except HostMemoryError as exc:
        refused = str(exc)
    return {"method": "hicache_refusal", "asked_bytes": tokens * TOKEN_BYTES, "refused": refused,
            "seconds": time.perf_counter() - start, "rss_delta_bytes": _status("VmRSS") - rss0}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", default="20.4,60", help="host pool sizes, GiB, comma-separated")
    parser.add_argument("--methods", default="torch,sglang_mmap,hicache")
    parser.add_argument("--out", required=True)
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless hicache's rows meet the bars: pinned <= asked + 0.5 %%, H2D and D2H within "
                             "1 %% of torch's pinned memory (in the same rounds), nothing left after close, the "
                             "oversized pool refused")  # fmt: skip
    parser.add_argument("--case", help=argparse.SUPPRESS)  # method:gib, run in this process (the driver's child)
    args = parser.parse_args()
    if args.case:
        method, gib = args.case.split(":")
        print(json.dumps(refusal_case() if method == "hicache_refusal" else run_case(method, float(gib))))
        return
    rows = []
    cases = [(m, g) for g in args.gib.split(",") for m in args.methods.split(",")] + [("hicache_refusal", "0")]
    for method, gib in cases:
        proc = subprocess.run([sys.executable, __file__, "--out", args.out, "--case", f"{method}:{gib}"],
                              capture_output=True, text=True)  # fmt: skip
        if proc.returncode:
            rows.append({"method": method, "gib_asked": float(gib), "error": proc.stderr.strip()[-2000:]})
        else:
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]))
        _write(args.out, rows)
    if args.check:
        failures = check_bars(rows)
        for line in failures:
            print(f"BAR NOT MET: {line}")
        sys.exit(1 if failures else 0)


def check_bars(rows: list[dict]) -> list[str]:
    """What of the issue's bars hicache's rows miss (an error row is a miss)."""
    out = []
    torch_rows = {r["gib_asked"]: r for r in rows if r.get("method") == "torch"}
    for r in rows:
        if "error" in r:
            out.append(f"{r['method']} {r.get('gib_asked')} GiB failed: {r['error'][-300:]}")
            continue
        if r["method"] == "hicache_refusal":
            if not r["refused"]:
                out.append("a pool larger than the machine was not refused")
            continue
        if r["method"] != "hicache":
            continue
        gib = r["gib_asked"]
        if r["device"] == "cuda" and r["pinned_bytes"] > r["asked_bytes"] * 1.005:
            out.append(f"{gib} GiB: pinned {r['pinned_bytes']} > asked {r['asked_bytes']} + 0.5 %")
        if r["rss_after_close_delta_bytes"] > 64 << 20:
            out.append(f"{gib} GiB: {r['rss_after_close_delta_bytes']} bytes still held after close")
        # torch's pinned memory in the same rounds of the same process; an older row has only the torch row's
        theirs, whose = r.get("beside") or torch_rows.get(gib, {}), "beside it" if "beside" in r else "row"
        for key in ("h2d_gbps", "d2h_gbps"):
            if key in r and key in theirs and r[key] < 0.99 * theirs[key]:
                out.append(f"{gib} GiB: {key} {r[key]:.2f} < 0.99 x torch's pinned memory ({whose}) {theirs[key]:.2f}")
    return out


def _write(path: str, rows: list[dict]) -> None:
    machine = {"host": platform.node(), "cpus": os.cpu_count(), "loadavg": open("/proc/loadavg").read().split()[:3],
               "mem_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}  # fmt: skip
    if torch.cuda.is_available():
        machine["gpu"] = torch.cuda.get_device_name()
    with open(path, "w") as f:
        json.dump({"what": "host pool memory: asked, held, pinned, build time, copy speed (benchmarks/host_memory.py)",
                   "machine": machine, "versions": {"torch": torch.__version__, "python": platform.python_version()},
                   "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
