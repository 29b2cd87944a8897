"""A compact table of a ``hicache bench`` JSON: per-layer loads and backups beside SGLang's kernel.

    python scripts/gpu/kernel_table.py benchmarks/results/kernel-bench-h200.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

IMPLS = ("kernel.triton_uva", "jit.one_layer", "direct.copy_engine", "sglang")


def _impl_of(name: str) -> str:
    return "sglang" if name.startswith("sglang.") else name


def main(path: str) -> int:
    data = json.load(open(path))
    records = data["records"]
    c = data["ceiling"]
    print(f"ceiling: H2D {c['h2d_gbps']:.1f} GB/s, D2H {c['d2h_gbps']:.1f} GB/s; anchor: {data.get('anchor')}")
    print("\nceilings at each per-layer load's size (fractions of the 2 GiB memcpy):")
    for r in records:
        if r.get("metric") == "ceiling_at_size":
            print(f"  {r['direction']} {r['bytes'] / 1e6:7.1f} MB  copy engine {r['memcpy_fraction']:.3f}  SM copy "
                  f"<=8 CTAs {r['sm_8ctas_fraction']:.3f} {r['sm_8ctas_shape']}  any {r['sm_any_fraction']:.3f} "
                  f"{r['sm_any_shape']}")  # fmt: skip
    sm = [r for r in records if r.get("metric") == "sm_copy"]
    for direction in ("h2d", "d2h"):
        rows = sorted((r for r in sm if r["direction"] == direction), key=lambda r: -r["gbps"])
        if rows:
            top = rows[0]
            print(f"  SM copy 256 MiB {direction}: best {top['fraction_of_ceiling']:.3f} "
                  f"({top['ctas']} CTAs x {top['num_warps']} warps, {top['block_words']} words)")
    cells: dict = defaultdict(dict)
    for r in records:
        if "fraction_of_ceiling" not in r or r.get("variant", "default") != "default" or r.get("tokens", 0) < 4096:
            continue
        key = (r["shape"], r["layout"], r["operation"][:28], r["tokens"])
        budget = r.get("max_ctas")
        impl = _impl_of(r["implementation"])
        label = f"{impl}@{budget or 'all'}" if impl != "direct.copy_engine" else impl
        cells[key][label] = (r.get("fraction_queued", float("nan")), r["fraction_of_ceiling"])
    cols = ["kernel.triton_uva@8", "kernel.triton_uva@all", "jit.one_layer@8", "jit.one_layer@all",
            "direct.copy_engine", "sglang@2", "sglang@8", "sglang@all"]  # fmt: skip
    print("\nqueued clock (isolated in brackets), fractions of the ceiling")
    print(f"{'shape layout op tokens':58}" + "".join(f"{c[:18]:>19}" for c in cols))
    for key in sorted(cells):
        row = cells[key]
        text = "".join(f"{row[c][0]:>10.3f} [{row[c][1]:.2f}]" if c in row else f"{'-':>19}" for c in cols)
        print(f"{' '.join(map(str, key)):58}{text}")
    print("\nhost time per 64-token load (us): implementation / through the pool / fresh indices")
    for r in records:
        if r.get("metric") == "host_time_us":
            print(f"  {r['implementation']:38} {r['shape']:14} {r['layout']:12} {r['host_time_us']:6.2f} "
                  f"{r.get('through_pool_us', float('nan')):6.2f} {r.get('host_time_fresh_us', float('nan')):6.2f}")
    for r in records:
        if r.get("metric") == "gemm_interference":
            print(f"  GEMM slowdown {r['implementation']:22} {r['layout']:12} ctas={r['max_ctas']}: "
                  f"{r['gemm_slowdown']:+.3f}")
        if r.get("metric") == "anchor_refused":
            print(f"  ANCHOR REFUSED: {r['why']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
