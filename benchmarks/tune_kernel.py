"""Launch-configuration sweep for a Triton io backend (GPU machine; informational, not a test).

For MLA rows (1152 B) and llama K/V rows (2048 B), page_first, random 64-token pages, it
times one-layer load and backup at 4096 and 32768 tokens for every (tile words, warps,
CTA budget) the implementation exposes, as fractions of the memcpy ceiling measured in the
same run, and writes JSON:

    python benchmarks/tune_kernel.py --impl kernel.triton_uva --out benchmarks/results/tune-kernel.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from hicache_core.plugins.implementation import BACKUP_LAYER, LOAD
from hicache_core.plugins.registry import get_registry
from hicache_core.tools.bench.machine import measure_ceiling
from hicache_core.tools.bench.records import environment
from hicache_core.tools.bench.sweep import Case, Timer, run_op
from hicache_core.tools.shapes import SHAPES


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--impl", default="kernel.triton_uva")
    p.add_argument("--out", default="benchmarks/results/tune.json")
    p.add_argument("--shapes", default="deepseek-mla,llama-8b")
    args = p.parse_args()
    registry = get_registry()
    cls = registry.implementations[args.impl]
    ceiling = measure_ceiling()
    timer = Timer(budget_s=0.1)
    rows = []
    for shape_name in args.shapes.split(","):
        case = Case(registry, SHAPES[shape_name], "page_first", 64, 32768, [cls])
        impl = case.impls[args.impl]
        knobs = {
            "tile_words": (1024, 2048, 4096) if hasattr(impl, "tile_words") else (None,),
            "num_warps": (4, 8, 16) if hasattr(impl, "num_warps") else (None,),
            "max_ctas": (8, 0),
        }
        for tile, warps, ctas in itertools.product(*knobs.values()):
            for name, value in (("tile_words", tile), ("num_warps", warps), ("max_ctas", ctas)):
                if value is not None:
                    setattr(impl, name, value)
            for tokens in (4096, 32768):
                h, d = case.indices(tokens, impl)
                for op in (LOAD, BACKUP_LAYER):
                    seconds = timer(run_op(impl, op, h, d))
                    gbps = case.bytes_moved(tokens, op) / seconds / 1e9
                    link = ceiling["h2d_gbps"] if op == LOAD else ceiling["d2h_gbps"]
                    rows.append({"shape": shape_name, "tile_words": tile, "num_warps": warps, "max_ctas": ctas,
                                 "tokens": tokens, "operation": op, "gbps": gbps,
                                 "fraction_of_ceiling": gbps / link})  # fmt: skip
                    print(f"{shape_name:13} tile={tile} warps={warps} ctas={ctas or 'all':>3} {tokens:>6} "
                          f"{op[:6]:6} {gbps:6.1f} GB/s {gbps / link:.3f}")  # fmt: skip
        del case
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"environment": environment(), "ceiling": ceiling, "implementation": args.impl, "rows": rows}, f,
                  indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
