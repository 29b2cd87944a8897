"""``hicache stats [SNAPSHOT.json ...] [--json]``: hicache's metrics (:mod:`hicache_core.metrics`) as text or JSON.

Metrics live in the process that recorded them. A server writes them with
``hicache_core.metrics.write_snapshot()`` (``$HICACHE_METRICS_DIR/hicache-<pid>.json``); this
command sums the snapshots it is given (files, or every ``hicache-*.json`` in a folder, default
``$HICACHE_METRICS_DIR``). With none, it prints this process's own metrics (all zero).
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import metrics


def run_stats(paths: list[str], as_json: bool = False) -> int:
    files: list[Path] = []
    folder = metrics.metrics_dir()
    sources = paths or ([folder] if folder else [])
    for p in sources:
        path = Path(p)
        if path.is_dir():
            files += sorted(path.glob("hicache-*.json"))
        elif path.is_file():
            files.append(path)
        else:
            print(f"hicache stats: {p} is neither a snapshot file nor a folder of them")
            return 2
    snaps = []
    for f in files:
        try:
            snaps.append(json.loads(f.read_text()))
        except (OSError, ValueError) as exc:
            print(f"hicache stats: {f} is not a metrics snapshot ({exc})")
            return 2
    snap = metrics.merge_snapshots(snaps) if snaps else metrics.snapshot()
    print(json.dumps(snap, indent=2) if as_json else metrics.format_text(snap))
    return 0
