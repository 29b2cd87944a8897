"""L3 at the disk's speed: hicache's ``file://`` reads and writes beside the drive's own direct-I/O bandwidth.

    python benchmarks/l3_disk.py --dir /var/tmp/hicache-l3-disk --out benchmarks/results/l3-disk-cpu.json

In one run, on one directory, rounds alternate:

* the drive's ceiling: O_DIRECT reads and writes with no hicache in the way, each the best of several ways
  of keeping the drive busy (``fio`` where installed; else Python threads issuing ``os.preadv`` /
  ``os.pwritev`` at several depths and request sizes, one file per page as the tier keeps them and one big
  file as ``dd`` would read it, and a thread pool fed one request per task as the tier's engine is; NIXL's
  POSIX backend where it is installed);
* the tier: ``make_storage("file://DIR")`` on a host pool shaped like Llama-3-8B with 64-token pages
  (32 layers, 8 KV heads, head dim 128, bf16: 8 MiB a page), ``write_pages`` then ``read_pages`` of every
  page (header, checksums and all), the bytes read back compared with the ones written.

The page cache is out of the way: every transfer is O_DIRECT where the tier's pages go direct, and every
file is synced and dropped from the cache (``posix_fadvise(DONTNEED)``) before any read. A fraction is the
tier's GB/s over the ceiling's in the same round (paired; every other round measures the tier first,
since the drive drifts); the JSON has every round, the machine and
the versions. The bars (issue 56): reads >= 0.9, writes >= 0.8 of the ceiling.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

PAGE_TOKENS = 64
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
BARS = {"read": 0.9, "write": 0.8}


def _llama_pool(pages: int, layout: str) -> Any:
    import hicache_core as hc

    dev = hc.MHADevicePool(PAGE_TOKENS * 2, PAGE_TOKENS, torch.bfloat16, KV_HEADS, HEAD_DIM, LAYERS, "cpu")
    host = hc.make_host_pool(dev, layout=layout, io_backend="reference", operations=[],
                             size=PAGE_TOKENS * (2 * pages + 1))  # fmt: skip
    gen = torch.Generator().manual_seed(56)
    block = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, generator=gen)
    for t in host.plan.host_buffers.values():
        flat = t.reshape(-1).view(torch.uint8)
        for start in range(0, flat.numel(), block.numel()):
            n = min(block.numel(), flat.numel() - start)
            flat[start : start + n].copy_(block[:n])
            block = block.roll(4099)  # pages must differ
    return host


def _drop_cache(directory: Path) -> None:
    """Every file under ``directory`` written back and dropped from the page cache."""
    os.sync()
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# ---- the ceiling: the drive with no hicache in the way -------------------------------------------------


def _aligned(n: int) -> mmap.mmap:
    return mmap.mmap(-1, n)


def _threads(files: list[Path], size: int, depth: int, request: int, write: bool) -> float:
    """GB/s of O_DIRECT writes or reads of ``files`` (``size`` bytes each), ``depth`` requests of ``request`` in
    flight, each thread taking every ``depth``-th request."""
    bufs = [_aligned(request) for _ in range(depth)]
    if write:
        for b in bufs:
            b.write(os.urandom(min(request, 1 << 16)) * (request // min(request, 1 << 16)))
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
    fds = [os.open(f, flags | os.O_DIRECT, 0o644) for f in files]
    work = [(fd, off) for fd in fds for off in range(0, size, request)]
    move = os.pwritev if write else os.preadv

    def run(i: int) -> int:
        done = 0
        for fd, off in work[i::depth]:
            done += move(fd, [memoryview(bufs[i])[: min(request, size - off)]], off)
        return done

    t0 = time.perf_counter()
    with ThreadPoolExecutor(depth) as pool:
        total = sum(pool.map(run, range(depth)))
    elapsed = time.perf_counter() - t0
    for fd in fds:
        os.close(fd)
    if write:  # a write's time includes its files' close
        return total / (time.perf_counter() - t0) / 1e9
    if total != size * len(files):
        raise RuntimeError(f"ceiling read {total} of {size * len(files)} bytes")
    return total / elapsed / 1e9


def _queue(files: list[Path], size: int, depth: int, request: int, write: bool) -> float:
    """GB/s of one O_DIRECT request per task on a pool of ``depth`` threads: the tier's engine, without hicache."""
    bufs = [_aligned(request) for _ in range(depth)]
    local = threading.local()
    counter = itertools.count()
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
    fds = [os.open(f, flags | os.O_DIRECT, 0o644) for f in files]

    def one(fd: int, off: int) -> int:
        if not hasattr(local, "buf"):
            local.buf = bufs[next(counter)]
        view = memoryview(local.buf)[: min(request, size - off)]
        return os.pwritev(fd, [view], off) if write else os.preadv(fd, [view], off)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(depth) as pool:
        total = sum(f.result() for f in [pool.submit(one, fd, off) for fd in fds for off in range(0, size, request)])
    elapsed = time.perf_counter() - t0
    for fd in fds:
        os.close(fd)
    return total / elapsed / 1e9


def _nixl_read(files: list[Path], size: int, per_xfer: int = 16) -> float | None:
    """GB/s of NIXL's POSIX backend reading ``files`` into one registered buffer (``None``: NIXL absent)."""
    try:
        from nixl_cu13._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found]
    except ImportError:
        try:
            from nixl_cu12._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found]
        except ImportError:
            return None
    agent = nixl_agent(f"l3-disk-{os.getpid()}", nixl_agent_config(backends=[]))
    agent.create_backend("POSIX")
    buf = _aligned(size * per_xfer)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    agent.register_memory(agent.get_reg_descs([(addr, size * per_xfer, 0, "")], "DRAM"))
    fds = [os.open(f, os.O_RDONLY | os.O_DIRECT) for f in files]
    agent.register_memory(agent.get_reg_descs([(0, size, fd, str(f)) for fd, f in zip(fds, files)], "FILE"))
    t0 = time.perf_counter()
    for start in range(0, len(fds), per_xfer):
        batch = fds[start : start + per_xfer]
        dram = agent.get_xfer_descs([(addr + i * size, size, 0) for i in range(len(batch))], "DRAM")
        disk = agent.get_xfer_descs([(0, size, fd) for fd in batch], "FILE")
        handle = agent.initialize_xfer("READ", dram, disk, agent.name)
        agent.transfer(handle)
        while (state := agent.check_xfer_state(handle)) not in ("DONE", "ERR"):
            pass
        agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError("NIXL POSIX read failed")
    elapsed = time.perf_counter() - t0
    for fd in fds:
        os.close(fd)
    return len(files) * size / elapsed / 1e9


def _fio(directory: Path, rw: str, size: int, jobs: int) -> float | None:
    if shutil.which("fio") is None:
        return None
    out = subprocess.run(["fio", "--name=ceiling", f"--directory={directory}", f"--rw={rw}", "--direct=1",
                          "--bs=1M", "--ioengine=libaio", "--iodepth=16", f"--numjobs={jobs}",
                          f"--size={size // jobs}", "--group_reporting", "--output-format=json"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    job = json.loads(out)["jobs"][0]["read" if rw == "read" else "write"]
    return job["bw_bytes"] / 1e9


def ceiling(directory: Path, pages: int, size: int) -> dict[str, Any]:
    """The drive's direct-I/O GB/s, each way measured several ways; ``best`` of each is the ceiling."""
    files = [directory / f"ceiling-{i:05d}" for i in range(pages)]
    big = [directory / "ceiling-big"]
    out: dict[str, dict[str, float]] = {"write": {}, "read": {}}
    for depth, request in ((16, 1 << 20), (4, 4 << 20)):
        name = f"threads depth {depth} x {request >> 20} MiB, file per page"
        out["write"][name] = _threads(files, size, depth, request, write=True)
        _drop_cache(directory)
        out["read"][name] = _threads(files, size, depth, request, write=False)
    for depth in (16, 32):
        name = f"thread pool queue depth {depth} x 1 MiB, file per page"
        out["write"][name] = _queue(files, size, depth, 1 << 20, write=True)
        _drop_cache(directory)
        out["read"][name] = _queue(files, size, depth, 1 << 20, write=False)
    out["write"]["threads depth 16 x 1 MiB, one big file"] = _threads(big, size * pages, 16, 1 << 20, write=True)
    _drop_cache(directory)
    out["read"]["threads depth 16 x 1 MiB, one big file"] = _threads(big, size * pages, 16, 1 << 20, write=False)
    out["read"]["one stream x 8 MiB, one big file (dd iflag=direct)"] = _threads(big, size * pages, 1, 8 << 20,
                                                                                  write=False)  # fmt: skip
    nixl = _nixl_read(files, size)
    if nixl is not None:
        out["read"]["NIXL POSIX, 16 files of a page per transfer"] = nixl
    for rw in ("write", "read"):
        fio = _fio(directory, rw, size * pages, 4)
        if fio is not None:
            out[rw]["fio libaio iodepth 16 x 4 jobs, 1 MiB"] = fio
    for f in [*files, *big]:
        f.unlink(missing_ok=True)
    for path in directory.glob("ceiling.*"):  # fio's files
        path.unlink()
    return {rw: {"ways": ways, "best": max(ways.values()), "best_way": max(ways, key=ways.get)}
            for rw, ways in out.items()}  # fmt: skip


# ---- the tier --------------------------------------------------------------------------------------------


def tier(store: Any, directory: Path, pages: int) -> dict[str, Any]:
    from hicache_core.storage.keys import page_hashes

    p = store.pages.page_size
    keys = page_hashes(list(range(pages * p)), p)
    src = torch.arange(p, (pages + 1) * p)  # pages 1..N
    dst = torch.arange((pages + 1) * p, (2 * pages + 1) * p)  # pages N+1..2N
    store.clear()
    before = store.get_stats().backend
    t0 = time.perf_counter()
    written = store.write_pages(keys, src)
    write_s = time.perf_counter() - t0
    if not all(r.ok for r in written):
        raise RuntimeError(f"tier write: {[r for r in written if not r.ok][:2]}")
    _drop_cache(directory)
    host = store.host_pool
    for page in range(pages + 1, 2 * pages + 1):  # zeroed targets: a read that does nothing cannot pass
        for span in store.pages.page_spans(page):
            ctypes.memset(span.ptr, 0, span.nbytes)
    t0 = time.perf_counter()
    read = store.read_pages(keys, dst)
    read_s = time.perf_counter() - t0
    if not all(r.ok for r in read):
        raise RuntimeError(f"tier read: {[r for r in read if not r.ok][:2]}")
    def page(slot: Any) -> torch.Tensor:  # bytes, not bf16 values: random bytes hold NaNs, never equal
        return host.get_data_page(int(slot), flat=True).reshape(-1).view(torch.uint8)

    same = all(torch.equal(page(src[i * p]), page(dst[i * p])) for i in range(pages))
    if not same:
        raise RuntimeError("tier read back other bytes than it wrote")
    after = store.get_stats().backend
    nbytes = pages * (store.pages.page_bytes + 4096)  # what crossed to the drive: header block and payload
    fallbacks = {k: v - before["direct_fallbacks"].get(k, 0) for k, v in after["direct_fallbacks"].items()}
    return {"write_gbps": nbytes / write_s / 1e9, "read_gbps": nbytes / read_s / 1e9, "byte_exact": same,
            "direct_pages": {k: after["direct_pages"][k] - before["direct_pages"][k] for k in ("read", "write")},
            "buffered_pages": {k: after["buffered_pages"][k] - before["buffered_pages"][k] for k in ("read", "write")},
            "direct_fallbacks": {k: v for k, v in fallbacks.items() if v}}  # fmt: skip


# ---- the machine -----------------------------------------------------------------------------------------


def machine(directory: Path) -> dict[str, Any]:
    from hicache_storage_file.backend import filesystem_of

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())  # fmt: skip
    fs = filesystem_of(directory)
    dev = Path(fs["device"]).name
    block: dict[str, Any] = {}
    queue = Path(f"/sys/class/block/{dev}/queue")
    if not queue.exists() and Path(f"/sys/class/block/{dev}/partition").exists():
        queue = Path(f"/sys/class/block/{dev}").resolve().parent / "queue"
    for name in ("rotational", "logical_block_size", "max_sectors_kb", "nr_requests", "scheduler"):
        try:
            block[name] = (queue / name).read_text().strip()
        except OSError:
            pass
    try:
        lsblk = subprocess.run(["lsblk", "-d", "-o", "NAME,SIZE,MODEL,ROTA,TYPE"], capture_output=True, text=True)
        block["lsblk"] = lsblk.stdout.strip().splitlines()
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
            "directory": str(directory), "filesystem": fs, "block_device": block,
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}  # fmt: skip


def versions() -> dict[str, str]:
    out = {}
    for dist in ("hicache-core", "hicache-storage-file", "torch", "xxhash", "nixl-cu13", "nixl-cu12"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    out["fio"] = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip() \
        if shutil.which("fio") else "not installed"  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/var/tmp/hicache-l3-disk", help="a directory on the drive to measure")
    ap.add_argument("--out", default="benchmarks/results/l3-disk-cpu.json")
    ap.add_argument("--pages", type=int, default=128, help="8 MiB pages a round moves each way")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layout", default="page_first")
    ap.add_argument("--options", default="", help="file:// options for the tier, as a URL query (a=1&b=2)")
    args = ap.parse_args()

    from hicache_core.storage import make_storage

    directory = Path(args.dir)
    shutil.rmtree(directory, ignore_errors=True)
    (directory / "ceiling").mkdir(parents=True)
    host = _llama_pool(args.pages, args.layout)
    url = f"file://{directory}/tier" + (f"?{args.options}" if args.options else "")
    store = make_storage(url, host, model_id="l3-disk-llama-3-8b", cluster_key=None)
    # The tier as it was before direct I/O (buffered through the page cache, dropped before reads): context.
    buffered = make_storage(f"file://{directory}/buffered?o_direct=0", host, model_id="l3-disk-llama-3-8b",
                            cluster_key=None)  # fmt: skip
    size = store.pages.page_bytes + 4096  # one page's file
    record: dict[str, Any] = {
        "what": __doc__.splitlines()[0], "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(directory), "versions": versions(), "url": url, "layout": args.layout,
        "shape": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16",
                  "page_tokens": PAGE_TOKENS, "page_bytes": store.pages.page_bytes, "file_bytes": size},
        "pages_per_round": args.pages, "bars": BARS, "rounds": [],
    }  # fmt: skip
    print(f"{args.pages} pages of {size / 2**20:.2f} MiB each way, {args.rounds} rounds, in {directory} "
          f"({record['machine']['filesystem']['fstype']} on {record['machine']['filesystem']['device']})")
    for r in range(args.rounds):
        load = open("/proc/loadavg").read().split()[:3]
        if r % 2:  # the drive drifts within a run: every other round measures the tier first
            got = tier(store, directory / "tier", args.pages)
            top = ceiling(directory / "ceiling", args.pages, size)
        else:
            top = ceiling(directory / "ceiling", args.pages, size)
            got = tier(store, directory / "tier", args.pages)
        store.clear()
        old = tier(buffered, directory / "buffered", args.pages)
        buffered.clear()
        row = {"round": r, "loadavg_before": load, "ceiling": top, "tier": got,
               "fraction": {rw: got[f"{rw}_gbps"] / top[rw]["best"] for rw in ("read", "write")},
               "tier_o_direct_0": old,
               "fraction_o_direct_0": {rw: old[f"{rw}_gbps"] / top[rw]["best"] for rw in ("read", "write")},
               }  # fmt: skip
        record["rounds"].append(row)
        print(f"round {r}: ceiling read {top['read']['best']:.2f} GB/s ({top['read']['best_way']}), write "
              f"{top['write']['best']:.2f} ({top['write']['best_way']}); tier read {got['read_gbps']:.2f} "
              f"({row['fraction']['read']:.2f}), write {got['write_gbps']:.2f} ({row['fraction']['write']:.2f}); "
              f"fall backs {got['direct_fallbacks'] or 'none'}; o_direct=0 read {old['read_gbps']:.2f}, write "
              f"{old['write_gbps']:.2f}", flush=True)  # fmt: skip
    record["backend_stats"] = store.get_stats().backend
    store.close()
    buffered.close()
    summary = {}
    for rw in ("read", "write"):
        fractions = [row["fraction"][rw] for row in record["rounds"]]
        summary[rw] = {
            "ceiling_gbps_median": statistics.median(row["ceiling"][rw]["best"] for row in record["rounds"]),
            "tier_gbps_median": statistics.median(row["tier"][f"{rw}_gbps"] for row in record["rounds"]),
            "fraction_per_round": [round(f, 3) for f in fractions],
            "fraction_median": statistics.median(fractions),
            "o_direct_0_fraction_median": statistics.median(row["fraction_o_direct_0"][rw] for row in record["rounds"]),
            "bar": BARS[rw], "meets_bar": statistics.median(fractions) >= BARS[rw],
        }  # fmt: skip
    summary["fall_backs_in_rows"] = sum(sum(row["tier"]["direct_fallbacks"].values()) for row in record["rounds"])
    lsblk = record["machine"]["block_device"].get("lsblk", [])[1:]
    disks = [line for line in lsblk if " disk" in line and not line.startswith("zram")]
    summary["striping"] = ("unmeasured: this machine has one drive" if len(disks) < 2
                           else "not run here: pass --options dirs=... with a directory on a second drive")  # fmt: skip
    record["summary"] = summary
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(directory, ignore_errors=True)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
