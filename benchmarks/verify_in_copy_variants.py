"""The load that checks in its copy, tiled and pipelined several ways, beside the plain copy: which to ship.

Run on the GPU machine::

    python benchmarks/verify_in_copy_variants.py --out $OUT/verify-in-copy-variants-h100.json

Per case (``verify_cost.py``'s pools and geometries, ``--tokens`` cached tokens, io backend ``kernel``): the
GPU time of a whole load of per-layer calls (CUDA events, median of ``--repeats``, every variant's runs
interleaved with the plain copy's), plain and checked in the copy under each variant of
:meth:`hicache_core.gpu.checked_load.CheckedLoads.tune` (items a unit, words a step, pipeline stages,
programs). Each verified run ends with ``check_verified()``: nothing may be reported.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from verify_cost import _interleaved_ms, pool_pair, write_result  # noqa: E402

import hicache_core as hc  # noqa: E402

#: (items a unit, words a step, stages, programs, sums per row): the shipped defaults first, then the kernel as it
#: was. Every variant leaves programs at the implementation's budget unless it names them.
VARIANTS = {
    "default": (None, None, None, None, False),
    "unpipelined-16": (16, 2048, 0, None, False),
    "pipelined-16": (16, 2048, None, None, False),
    "stages-2": (None, None, 2, None, False),
    "stages-6": (None, None, 6, None, False),
    "words-4096": (None, 4096, None, None, False),
    "row-sums": (None, None, None, None, True),
    "row-sums-words-4096": (None, 4096, None, None, True),
    "row-sums-words-8192-stages-3": (None, 8192, 3, None, True),
    "programs-16": (None, None, None, 16, False),
    "programs-16-words-4096": (None, 4096, None, 16, False),
    "programs-16-row-sums-words-4096": (None, 4096, None, 16, True),
}
CASES = ("mha:page_first,mla:page_first,mha_k_only:page_first,page_rows:page_first,kv_scale_pages:page_first,"
         "nvfp4_page_rows:page_first,dsv4_paged:page_first,mamba:page_first")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    os.environ["HICACHE_VERIFY_IN_COPY"] = "1"
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for kind, layout in (c.split(":") for c in args.cases.split(",")):
            try:
                rows.append(_case(kind, layout, tokens, args.variants.split(","), args.repeats))
            except Exception as exc:  # one case's failure is a row of the result, not the end of the run
                rows.append({"pool": kind, "layout": layout, "tokens": tokens, "error": f"{type(exc).__name__}: {exc}"})
            torch.cuda.empty_cache()
            r = rows[-1]
            print(f"{tokens:6} {kind:16} " + (r.get("error") or "  ".join(
                f"{v} {r['overhead'][v]:+.1%}" for v in r["overhead"])), flush=True)  # fmt: skip
            write_result(args.out, "a whole per-layer load's GPU time, checked in the copy under each variant, "
                         "against the plain copy (overhead: variant / plain - 1)", rows, quiet=True)  # fmt: skip
    write_result(args.out, "done", rows)


def _case(kind: str, layout: str, tokens: int, variants: list[str], repeats: int) -> dict:
    dp, pools = pool_pair(kind, layout, "kernel", tokens, 64)
    (plain, ph, pd), (checked, ch, cd) = pools[False], pools[True]
    check = checked.implementation_for(hc.LOAD).load_check
    if check is None:
        raise RuntimeError(f"not checked in the copy: {checked.verification.in_copy}")
    layers = dp.layer_num

    def load(host, h, d) -> None:
        for layer in range(layers):
            host.load_to_device_per_layer(dp, h, d, layer, "kernel")

    row: dict = {"pool": kind, "layout": layout, "tokens": tokens, "layers": layers, "ms": {}, "overhead": {}}
    budget = check.programs
    for name in variants:
        items, words, stages, programs, row_sums = VARIANTS[name]
        check.tune(tile_items=items, tile_words=words, stages=stages, programs=programs or budget, row_sums=row_sums)
        row.setdefault("tiles", {})[name] = {"tile": check._tile, "one_step": check._one_step,
                                              "stages": check._stages, "programs": check.programs}  # fmt: skip
        load(checked, ch, cd)  # builds this variant
        torch.cuda.synchronize()
        ms = _interleaved_ms({"plain": lambda: load(plain, ph, pd), name: lambda: load(checked, ch, cd)}, repeats)
        checked.check_verified()  # every page clean: nothing may be reported
        row["ms"][name] = ms[name]
        row["ms"].setdefault("plain", []).append(ms["plain"])
        row["overhead"][name] = ms[name] / ms["plain"] - 1
    for host in (plain, checked):
        host.destroy()
    return row


if __name__ == "__main__":
    main()
