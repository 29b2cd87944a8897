"""Which SGLang 0.5.23 host-pool families hicache serves, in which layouts and io backends (from the code).

``python -m hicache_sglang.matrix`` prints the table the README carries (between its
``sglang-matrix`` markers: ``--write README.md`` puts it there, ``--check README.md`` fails
when that copy is stale). Each cell
asks hicache's registry, for a CUDA pool of the family's pool kind with pinned host memory,
which io backends serve every operation the adapter resolves for it; ``direct`` is kept only
with the layouts SGLang's controller can prepare indices for. The rows are the pools of
:mod:`hicache_sglang.families`, the one table of SGLang's host-pool families.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

import hicache_core as hc

from .build import DIRECT_LAYOUTS
from .families import FAMILIES, Pool

BEGIN, END = "<!-- sglang-matrix:begin -->", "<!-- sglang-matrix:end -->"


def _geometry(kind: hc.PoolKind, sharded: bool) -> hc.PoolGeometry:
    """A small CUDA pool of ``kind`` (rows from the declaration's examples), without allocating device memory."""
    layers = 4
    pool = type("Pool", (), {})()
    for comp in kind.components:
        shape = (16, *comp.example) if comp.example else (16, 8)
        setattr(pool, comp.device_attr, [torch.empty(shape, dtype=torch.bfloat16, device="meta")] * layers)
    for name, value in kind.example_extras:
        setattr(pool, name, value)
    pool.pool_kind, pool.page_size, pool.size = kind.name, 16, 16 * 16
    pool.start_layer, pool.end_layer, pool.layer_num = (2, 4, 4) if sharded else (0, 4, 4)
    if sharded:
        for comp in kind.components:
            setattr(pool, comp.device_attr, getattr(pool, comp.device_attr)[:2])
    return dataclasses.replace(hc.geometry_of(pool), device_type="cuda")


def served(family: Pool, layout: str) -> list[str]:
    """The io backends serving every operation the adapter resolves for the pool ``family`` in ``layout``."""
    registry = hc.get_registry()
    geometries = [_geometry(registry.pool_kinds[k], family.sharded) for k in (family.kind, *family.with_kinds)]
    ops = (hc.LOAD, hc.BACKUP_LAYER) if family.sharded else (hc.LOAD, hc.BACKUP_ALL)
    out = []
    for io in family.io_backends:
        if io == "direct" and layout not in DIRECT_LAYOUTS:
            continue
        try:
            for geometry in geometries:
                for op in ops:
                    hc.resolve(registry, hc.TransferRequest(io, op, geometry, registry.layouts[layout], True))
        except (hc.UnsupportedCombinationError, ValueError):
            continue
        out.append(io)
    return out


def table() -> str:
    """The markdown table: every family's pools (layout: io backends), in the order they are declared."""
    lines = ["| SGLang host pool family | SGLang class | hicache pool kind | layout: io backends |",
             "|---|---|---|---|"]  # fmt: skip
    for family in FAMILIES:
        if not family.pools:
            lines.append(f"| {family.how} | `{family.attr}` | (slots only, no bytes) | every layout: no transfer |")
        for f in family.pools:
            cells = [f"{layout}: {', '.join(served(f, layout)) or 'none'}" for layout in f.layouts]
            kinds = " + ".join(f"`{k}`" for k in (f.kind, *f.with_kinds))
            lines.append(f"| {f.name} | `{f.sglang}` | {kinds} | {'<br>'.join(cells)} |")
    lines.append("| KV with per-slot scales: refused when the pool is built (SGLang's host pools refuse it too) | "
                 "`MHATokenToKVPoolFP4`, `MLATokenToKVPoolFP4`, `MHATokenToKVPoolMXFP8` below page size 128 | "
                 "SGLang's | an FP4 KV cache; MXFP8 with --page-size other than 128 |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hicache_sglang.matrix", description=__doc__.splitlines()[0])
    parser.add_argument("--check", metavar="README", help="fail if README's table between the markers is not current")
    parser.add_argument("--write", metavar="README", help="put the table between README's markers")
    args = parser.parse_args(argv)
    text = table()
    path = args.check or args.write
    if path is None:
        sys.stdout.write(text)
        return 0
    readme = open(path, encoding="utf-8").read()
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < 0:
        print(f"{path}: no {BEGIN} ... {END} markers", file=sys.stderr)
        return 1
    if args.write:
        with open(path, "w", encoding="utf-8") as f:
            f.write(readme[: start + len(BEGIN)] + "\n" + text + readme[end:])
        return 0
    if readme[start + len(BEGIN) : end].strip() != text.strip():
        print(f"{path}: the SGLang matrix is not current; regenerate it with python -m hicache_sglang.matrix",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
