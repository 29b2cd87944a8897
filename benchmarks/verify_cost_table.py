"""The markdown table of verification's cost (docs/verification-cost.md) from ``verify_cost.py`` results.

    python benchmarks/verify_cost_table.py benchmarks/results/verify-cost-all-4096-h200.json [more.json ...]

Rows are (pool, layout, io, tokens); where several files hold a row (runs in separate processes), its
cells read *first / second / ...* in the files' order. Overheads over the bar (3 %) are bold.
"""

from __future__ import annotations

import json
import sys

BAR = 0.03
COLUMNS = (("load_overhead", "per-layer load"), ("layerwise_overhead", "layer-wise load"),
           ("layerwise_gpu_overhead", "layer-wise, GPU"), ("backup_overhead", "backup"))  # fmt: skip


def table(paths: list[str]) -> str:
    rows: dict[tuple, list[dict]] = {}
    for path in paths:
        for r in json.load(open(path))["rows"]:
            rows.setdefault((r["pool"], r["layout"], r["io_backend"], r["tokens"]), []).append(r)
    head = "| pool | layout | io | tokens | load (ms) | " + " | ".join(name for _, name in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (5 + len(COLUMNS))]
    for (pool, layout, io, tokens), runs in rows.items():
        done = [r for r in runs if "load_overhead" in r]
        if not done:
            why = runs[0].get("refused") or runs[0].get("error", "")
            lines.append(f"| {pool} | {layout} | {io} | {tokens} | {why} |" + " |" * len(COLUMNS))
            continue
        cells = []
        for key, _ in COLUMNS:
            values = [r[key] for r in done]
            text = " / ".join(f"{100 * v:+.1f}" for v in values) + " %"
            cells.append(f"**{text}**" if max(values) > BAR else text)
        lines.append(f"| {pool} | {layout} | {io} | {tokens} | {done[0]['load_ms_plain']:.2f} | " + " | ".join(cells)
                     + " |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1:]))
