"""Which keyed MAC authenticates L3 pages: candidates from maintained libraries, timed on this CPU.

    python benchmarks/mac_choice.py --out benchmarks/results/l3-mac-choice-cpu.json

Each candidate tags pages of 64 KiB, 256 KiB, 1 MiB and 4 MiB (random bytes, 64 MiB of them, so the
data comes from memory, not cache) with a 32-byte key, on one thread and on two (the page store tags a
batch's pages on several threads: a MAC that holds the GIL does not scale). Reported: GB/s, median of
5 rounds after a warm-up. XXH3-64 (unkeyed, today's page checksum) is the reference line.

The AEADs (AES-256-GCM, ChaCha20-Poly1305) tag the page as associated data, with a fresh 96-bit
nonce per page that the page would have to carry: they are MACs only with a unique nonce per key, a
rule a cluster of writers cannot easily keep (a repeated GCM nonce gives away the authentication key).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20)
TOTAL = 64 << 20
KEY = os.urandom(32)


def _candidates() -> dict[str, tuple[Callable[[memoryview], bytes], str]]:
    out: dict[str, tuple[Callable[[memoryview], bytes], str]] = {
        "hmac-sha256": (lambda v: hmac.new(KEY, v, "sha256").digest(), "stdlib hmac + hashlib (OpenSSL)"),
        "hmac-sha512": (lambda v: hmac.new(KEY, v, "sha512").digest(), "stdlib hmac + hashlib (OpenSSL)"),
        "blake2b-keyed": (lambda v: hashlib.blake2b(v, key=KEY, digest_size=32).digest(), "stdlib hashlib"),
        "blake2s-keyed": (lambda v: hashlib.blake2s(v, key=KEY, digest_size=32).digest(), "stdlib hashlib"),
    }
    try:
        import blake3

        out["blake3-keyed"] = (lambda v: blake3.blake3(v, key=KEY).digest(), "blake3 (Rust crate bindings)")
        out["blake3-keyed-mt"] = (
            lambda v: blake3.blake3(v, key=KEY, max_threads=blake3.blake3.AUTO).digest(),
            "blake3, max_threads=AUTO (one page on every core)",
        )
    except ImportError:
        pass
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

        gcm, chacha = AESGCM(KEY), ChaCha20Poly1305(KEY)
        out["aes256-gmac"] = (lambda v: gcm.encrypt(os.urandom(12), b"", bytes(v)), "cryptography AESGCM (AD only)")
        out["chacha20-poly1305"] = (
            lambda v: chacha.encrypt(os.urandom(12), b"", bytes(v)),
            "cryptography ChaCha20Poly1305 (AD only)",
        )
    except ImportError:
        pass
    try:
        import xxhash

        out["xxh3-64 (unkeyed reference)"] = (lambda v: xxhash.xxh3_64_digest(v), "xxhash")
    except ImportError:
        pass
    return out


def _rate(fn: Callable[[memoryview], bytes], pages: list[memoryview], threads: int, rounds: int = 5) -> float:
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    times = []
    try:
        for r in range(rounds + 1):
            t0 = time.perf_counter()
            if pool is None:
                for p in pages:
                    fn(p)
            else:
                list(pool.map(fn, pages))
            if r:
                times.append(time.perf_counter() - t0)
    finally:
        if pool is not None:
            pool.shutdown()
    return sum(len(p) for p in pages) / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    data = memoryview(bytearray(os.urandom(TOTAL)))
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "")
    flags = next((x.split(":", 1)[1].split() for x in open("/proc/cpuinfo") if x.startswith("flags")), [])
    rows = []
    loads = [open("/proc/loadavg").read().split()[:3]]
    candidates = _candidates()
    for name, (fn, source) in candidates.items():
        for size in SIZES:
            # An AEAD here copies the page (its AD must be bytes): timed with it, as it would run.
            pages = [data[i : i + size] for i in range(0, TOTAL, size)]
            row = {"mac": name, "source": source, "page_bytes": size, "gbps_1_thread": round(_rate(fn, pages, 1), 3),
                   "gbps_2_threads": round(_rate(fn, pages, 2), 3)}  # fmt: skip
            rows.append(row)
            print(f"{name:30} {size >> 10:5d} KiB  {row['gbps_1_thread']:7.2f} GB/s  2 threads "
                  f"{row['gbps_2_threads']:7.2f} GB/s")  # fmt: skip
        loads.append(open("/proc/loadavg").read().split()[:3])
    used = [f for f in ("sha_ni", "avx2", "avx512f", "aes", "vaes", "pclmulqdq", "vpclmulqdq") if f in flags]
    versions = {"python": platform.python_version(), "openssl": __import__("ssl").OPENSSL_VERSION}
    for dist in ("blake3", "cryptography", "xxhash"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    record = {
        "benchmark": "l3-mac-choice",
        "what": __doc__.splitlines()[0],
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "flags": used},
        "loadavg_during": loads,
        "versions": versions,
        "rounds": "median of 5 after one warm-up, 64 MiB of random bytes per round",
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
