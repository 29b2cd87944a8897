"""``hicache stats [SNAPSHOT.json ...] [--json]``: hicache's metrics (:mod:`hicache_core.metrics`) as text or JSON.

Metrics live in the process that recorded them. A server writes them with
``hicache_core.metrics.write_snapshot()`` (``$HICACHE_METRICS_DIR/hicache-<pid>.json``); this
command sums the snapshots it is given (files, or every ``hicache-*.json`` in a folder, default
``$HICACHE_METRICS_DIR``, but the ``hicache-outcomes-*.json`` files ``explain-miss`` reads there).
With none, it prints this process's own metrics (all zero).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from .. import metrics

WHO = "hicache stats"


def run_stats(paths: list[str], as_json: bool = False) -> int:
    files: list[Path] = []
    folder = metrics.metrics_dir()
    sources = paths or ([folder] if folder else [])
    for p in sources:
        path = Path(p)
        if path.is_dir():
            files += sorted(f for f in path.glob("hicache-*.json") if not f.name.startswith("hicache-outcomes-"))
        elif path.is_file():
            files.append(path)
        else:
            given = "" if paths else f" ({metrics.METRICS_DIR.name})"
            print(f"{WHO}: error: {str(p)!r}{given} is neither a snapshot file nor a folder of them", file=sys.stderr)
            return 2
    snaps = []
    for f in files:
        try:
            snap = json.loads(f.read_bytes())
            problem = _not_a_snapshot(snap)
        except (OSError, ValueError) as exc:
            problem = " ".join(str(exc).split())
        if problem:
            print(f"{WHO}: error: {f} is not a metrics snapshot ({problem})", file=sys.stderr)
            return 2
        snaps.append(snap)
    try:
        snap = metrics.merge_snapshots(snaps) if snaps else metrics.snapshot()
    except (TypeError, KeyError) as exc:  # one file's histogram where another has a number, under the same labels
        print(f"{WHO}: error: the snapshots disagree on a metric's kind and cannot be summed ({exc!r})",
              file=sys.stderr)  # fmt: skip
        return 2
    print(json.dumps(snap, indent=2) if as_json else metrics.format_text(snap))
    return 0


def _not_a_snapshot(snap: Any) -> str | None:
    """What in ``snap`` is not what :func:`hicache_core.metrics.snapshot` writes, or ``None``."""
    if not isinstance(snap, dict):
        return f"a snapshot is a JSON object of metrics, got {type(snap).__name__}"
    for name, metric in snap.items():
        if not isinstance(metric, dict) or not isinstance(metric.get("values"), list):
            return f"metric {name!r} has no list of values"
        for row in metric["values"]:
            if not isinstance(row, dict) or not isinstance(row.get("labels"), dict):
                return f"a value of {name!r} has no labels"
            if not _is_value(row.get("value")):
                return f"a value of {name!r} is {json.dumps(row.get('value'))[:40]}, not a number or a histogram"
    return None


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


def _is_value(value: Any) -> bool:
    if isinstance(value, dict):
        buckets = value.get("buckets")
        return (_is_number(value.get("count")) and _is_number(value.get("sum")) and isinstance(buckets, list)
                and all(isinstance(b, list) and len(b) == 2 and _is_number(b[1]) for b in buckets))  # fmt: skip
    return _is_number(value)
