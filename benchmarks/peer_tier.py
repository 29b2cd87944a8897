"""The peer tier, authenticated, against NIXL's own transfer of the same bytes between the same two processes.

    .venv/bin/python benchmarks/peer_tier.py [--pages 48] [--reps 7] [--out benchmarks/results/peer-tier-cpu.json]

Starts a redis-server (the directory) and an owner process that publishes ``--pages`` pages of
2 MiB (MHA, page_first, 8 layers x 8 heads x 128 dims, bf16, 64 tokens a page) into its publication
area. Both processes hold the same random cluster key (``HICACHE_L3_KEY``) and the directory has a
password, as in production. In this process:

* **nixl**: one NIXL READ of exactly the published pages' bytes in the owner's publication area into
  a registered buffer (an agent of its own: no directory, no generation check, no copy, no MAC), the
  ceiling;
* **tier**: ``store.read_pages(keys, slots)`` of the same pages: directory lookup with every owner
  record and entry's MAC checked (and the owner's sealed metadata opened once), reads through the
  staging buffer, generation words, copy into the host pool, header and keyed BLAKE3 MAC of every byte.

Each is timed ``--reps`` times, alternating; the JSON holds every time, the medians and their ratio.
UCX runs over TCP on loopback (``UCX_TLS=tcp,self``) unless the caller set ``UCX_TLS``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hicache_core.settings.variables import L3_KEY, L3_KEY_FILE

os.environ.setdefault("UCX_TLS", "tcp,self")

PAGE = 64


def make_host(pages: int):
    import torch

    from hicache_core.pool.device_pools import MHADevicePool
    from hicache_core.pool.host_pool import make_host_pool

    device = MHADevicePool(PAGE, PAGE, torch.bfloat16, 8, 128, 8, "cpu")
    host = make_host_pool(device, layout="page_first", io_backend="reference", operations=[], size=pages * PAGE,
                          verify=False)  # fmt: skip
    for t in host.plan.host_buffers.values():  # the same bytes in every process, before any page is read
        flat = t.view(-1).view(torch.uint8)
        flat.copy_(((torch.arange(flat.numel(), dtype=torch.int64) * 2654435761) >> 11).to(torch.uint8))
    return host


def keys_for(n: int) -> list[str]:
    from hicache_core.storage.keys import page_hashes

    return page_hashes(list(range(n * PAGE)), PAGE)


def owner(url: str, pages: int, workdir: Path) -> None:
    from hicache_core.storage import make_storage

    host = make_host(pages + 2)
    store = make_storage(url, host, model_id="bench")
    assert store.authenticated == (L3_KEY.read() is not None)
    slots = host.alloc(pages * PAGE)
    assert all(r.ok for r in store.write_pages(keys_for(pages), slots))
    (workdir / "ready").write_text("1")
    while not (workdir / "stop").exists():
        time.sleep(0.05)
    store.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=48)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results/peer-tier-cpu.json")
    ap.add_argument("--unkeyed", action="store_true", help="no cluster key (to attribute the MAC's share)")
    args = ap.parse_args()
    import torch
    from hicache_storage_peer.agent import PeerAgent

    from hicache_core.storage import make_storage
    from hicache_core.testing.servers import start_redis

    load_before = _loadavg()
    work = Path(tempfile.mkdtemp(prefix="peer-bench-"))
    password = os.urandom(12).hex()
    os.environ.pop(L3_KEY_FILE.name, None)
    os.environ.pop(L3_KEY.name, None)
    if not args.unkeyed:
        os.environ[L3_KEY.name] = os.urandom(32).hex()  # the owner process inherits it
    redis = start_redis(work, "--requirepass", password)
    url = f"peer://:{password}@127.0.0.1:{redis.port}/0?timeout=30&publish_bytes={(args.pages + 2) * 2}MiB"
    url += "&insecure=1" if args.unkeyed else ""  # peer:// refuses to bind without the key unless told
    proc = subprocess.Popen([sys.executable, __file__, "--owner", url, str(args.pages), str(work)])
    try:
        deadline = time.monotonic() + 120
        while not (work / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the owner did not start"
            time.sleep(0.05)
        keys = keys_for(args.pages)
        host = make_host(args.pages + 2)
        store = make_storage(url, host, model_id="bench", serve=0)
        assert store.authenticated != args.unkeyed
        backend = store.backend
        slots = host.alloc(args.pages * PAGE)
        full = backend.namespace.keys(keys)
        holders = backend.directory.holders(full)
        owner_id = next(iter(holders[0]))
        meta = backend.directory.owners([owner_id])[0][owner_id]  # opened with the cluster key
        entries = [backend.directory.read_entry(k, owner_id, h[owner_id]) for k, h in zip(full, holders)]
        runs = [(meta.slot_addr(e.slot), e.payload_bytes) for e in entries]
        nbytes = sum(n for _, n in runs)
        raw = PeerAgent(f"raw-{os.getpid()}")
        target = torch.empty(nbytes, dtype=torch.uint8)
        raw.register([(target.data_ptr(), nbytes)])
        raw.connect(owner_id, meta.metadata)
        local, at = [], target.data_ptr()
        for _, n in runs:
            local.append((at, n))
            at += n

        def nixl_once() -> float:
            t0 = time.perf_counter()
            raw.read(owner_id, local, runs, time.monotonic() + 60)
            return time.perf_counter() - t0

        def tier_once() -> float:
            t0 = time.perf_counter()
            results = store.read_pages(keys, slots)
            took = time.perf_counter() - t0
            assert all(r.ok for r in results), results[:2]
            return took

        nixl_once(), tier_once()  # connect, allocate staging
        times: dict[str, list[float]] = {"nixl": [], "tier": []}
        for _ in range(args.reps):
            times["nixl"].append(nixl_once())
            times["tier"].append(tier_once())
        # The tier's bytes equal the owner's (compared as bytes: random bf16 bit patterns include NaNs).
        same = all(torch.equal(host.get_data_page(int(s), flat=True).view(torch.uint8),
                               make_ref(int(s), args.pages).view(torch.uint8)) for s in slots[::PAGE])  # fmt: skip
        med = {k: statistics.median(v) for k, v in times.items()}
        stats = store.get_stats()
        assert stats.read_auth_failed == 0 and stats.read_corrupt == 0
        result = {
            "what": "peer tier read, authenticated unless authenticated=false (cluster key: entry and page MACs, "
            "sealed owner metadata; directory with a password), vs NIXL's own READ of the same bytes from the "
            "owner's publication area, same two processes",
            "authenticated": not args.unkeyed,
            "transport": f"UCX over {os.environ['UCX_TLS']} on 127.0.0.1 (loopback), no RDMA",
            "machine": {
                "cpu": platform.processor() or platform.machine(),
                "cores": os.cpu_count(),
                "note": "shared CPU machine, no GPU; other jobs ran at the same time",
                "loadavg_before": load_before,
                "loadavg_after": _loadavg(),
            },  # fmt: skip
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "nixl": _version("nixl-cu13"),
                "redis-server": _redis_version(),
                "blake3": _version("blake3"),
                "cryptography": _version("cryptography"),
            },  # fmt: skip
            "pages": args.pages,
            "page_bytes": nbytes // args.pages,
            "bytes": nbytes,
            "reps": args.reps,
            "seconds": times,
            "median_s": med,
            "gbps": {k: nbytes / v / 1e9 for k, v in med.items()},
            "ratio_tier_over_nixl": med["nixl"] / med["tier"],
            "bytes_equal": same,
        }
        print(json.dumps({k: result[k] for k in ("gbps", "ratio_tier_over_nixl", "bytes_equal")}, indent=1))
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        raw.close()
        store.close()
    finally:
        (work / "stop").write_text("1")
        try:
            proc.wait(30)
        finally:
            proc.kill()
            redis.stop()


_REF = {}


def make_ref(slot: int, pages: int):
    if "host" not in _REF:
        _REF["host"] = make_host(pages + 2)  # same seed as the owner's pool, same slots (first alloc)
    return _REF["host"].get_data_page(slot, flat=True)


def _loadavg() -> list[float]:
    return [float(x) for x in open("/proc/loadavg").read().split()[:3]]


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def _redis_version() -> str:
    from hicache_core.testing.servers import redis_binary

    out = subprocess.run([redis_binary(), "--version"], capture_output=True, text=True).stdout
    return out.split("v=")[1].split()[0] if "v=" in out else out.strip()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--owner":
        owner(sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
    else:
        main()
