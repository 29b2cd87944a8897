"""Repeated ``hicache bench --storage`` runs, plain and verifying host pools, into one JSON.

    python benchmarks/storage_runs.py --out benchmarks/results/storage-l3-cpu.json --runs 3 \\
        file:///tmp/hbench mooncake://127.0.0.1:PORT?segment=1GiB&local_buffer=64MiB

Each run is one ``run_storage_bench`` (raw client and tier alternating on the same bytes, 5 rounds,
median), so every fraction compares the tier with its own client measured in the same run. The
machine's load average is recorded before each run (a shared machine reads lower and noisier).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from urllib.parse import urlparse

from hicache_core.tools.bench.storage import run_storage_bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("urls", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--modes", default="plain,verify")
    args = ap.parse_args()
    record: dict = {"what": __doc__.splitlines()[0], "runs": []}
    for url in args.urls:
        for mode in args.modes.split(","):
            for run in range(args.runs):
                loadavg = open("/proc/loadavg").read().split()[:3]
                with tempfile.TemporaryDirectory() as tmp:
                    if url.startswith("file://"):
                        shutil.rmtree(urlparse(url).path, ignore_errors=True)
                    run_storage_bench(url, out=tmp, tokens=[int(t) for t in args.tokens.split(",")],
                                      verify=mode == "verify")  # fmt: skip
                    (result,) = [json.loads(p.read_text()) for p in Path(tmp).glob("*.json")]
                if url.startswith("file://"):
                    shutil.rmtree(urlparse(url).path, ignore_errors=True)
                result["loadavg_before"] = loadavg
                result["run"] = run
                result["mode"] = mode
                record["runs"].append(result)
    summary = {}
    for r in record["runs"]:
        for row in r["rows"]:
            key = f"{r['scheme']} {r['mode']} {row['operation']} {row['tokens']}"
            summary.setdefault(key, []).append(round(row["fraction_of_raw"], 3))
    record["fraction_of_raw_per_run"] = summary
    record["machine"] = record["runs"][0]["machine"] if record["runs"] else {}
    record["versions"] = record["runs"][0]["versions"] if record["runs"] else {}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    for key, fractions in summary.items():
        print(f"{key:40} {fractions}")


if __name__ == "__main__":
    main()
