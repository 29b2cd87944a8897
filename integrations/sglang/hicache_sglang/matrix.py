"""Which SGLang 0.5.23 host-pool families hicache serves, in which layouts and io backends (from the code).

``python -m hicache_sglang.matrix`` prints the table the README carries (between its
``sglang-matrix`` markers: ``--write README.md`` puts it there, ``--check README.md`` fails
when that copy is stale). Each cell
asks hicache's registry, for a CUDA pool of the family's pool kind with pinned host memory,
which io backends serve every operation the adapter resolves for it; ``direct`` is kept only
with the layouts SGLang's controller can prepare indices for. Families that stay SGLang's
come from :data:`hicache_sglang.builders.REFUSALS`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass

import torch

import hicache_core as hc

from . import builders
from .build import DIRECT_LAYOUTS

BEGIN, END = "<!-- sglang-matrix:begin -->", "<!-- sglang-matrix:end -->"
IO_BACKENDS = ("kernel", "direct")


@dataclass(frozen=True)
class Family:
    """A SGLang host-pool family hicache serves: its SGLang class, hicache kind, and the layouts SGLang allows."""

    name: str
    sglang: str
    kind: str
    layouts: tuple[str, ...]
    sharded: bool = False
    #: kinds of the pools that ride beside it in the same calls (MXFP8's scales beside the K/V): they must serve too
    with_kinds: tuple[str, ...] = ()
    #: The io backends SGLang can ask of it (HiSparse's coordinator always passes ``kernel``).
    io_backends: tuple[str, ...] = IO_BACKENDS


FAMILIES: tuple[Family, ...] = (
    Family("KV, MHA", "MHATokenToKVPoolHost", "mha", ("layer_first", "page_first", "page_first_direct", "page_head")),
    Family("KV, MHA head_dim != v_head_dim", "AsymmetricMHATokenToKVPoolHost", "mha_asym",
           ("page_first", "page_first_direct")),
    Family("KV, MLA", "MLATokenToKVPoolHost", "mla",
           ("layer_first", "page_first", "page_first_direct", "page_first_kv_split")),
    Family("KV, MLA, layer-split (--enable-dsa-cache-layer-split)", "MLATokenToKVPoolHost", "mla",
           ("layer_first", "page_first", "page_first_direct", "page_first_kv_split"), sharded=True),
    Family("MTP draft KV (non-packed), MHA", "MHATokenToKVPoolHost", "mha",
           ("layer_first", "page_first", "page_first_direct", "page_head")),
    Family("MTP draft KV (non-packed), MLA", "MLATokenToKVPoolHost", "mla",
           ("layer_first", "page_first", "page_first_direct", "page_first_kv_split")),
    Family("DSA indexer", "DSAIndexerPoolHost", "page_rows",
           ("layer_first", "page_first", "page_first_direct", "page_first_kv_split")),
    Family("DSA indexer, layer-split", "DSAIndexerPoolHost", "page_rows",
           ("layer_first", "page_first", "page_first_direct", "page_first_kv_split"), sharded=True),
    Family("DeepSeek-V4 paged (SWA, C4, C128, C4 indexer, draft SWA)", "DeepSeekV4PagedHostPool", "dsv4_paged",
           ("layer_first", "page_first", "page_first_direct")),
    Family("QSA indexer (compressed keys)", "QSAIndexerPoolHost", "dsv4_paged",
           ("layer_first", "page_first", "page_first_direct")),
    Family("Mamba / linear-attention state", "MambaPoolHost", "mamba", ("page_first", "page_first_direct")),
    Family("DeepSeek-V4 compress state", "DeepSeekV4StateHostPool", "dsv4_state",
           ("layer_first", "page_first", "page_first_direct")),
    Family("KV, MHA MXFP8 (FP8 K/V + interleaved E8M0 scales, page size 128)", "MHATokenToKVPoolMXFP8Host", "mha",
           ("page_first",), with_kinds=("kv_scale_pages",)),
    Family("MiniMax-M3 NVFP4 main K/V (block scales inside the rows)", "MiniMaxM3Nvfp4MainKVPoolHost",
           "nvfp4_page_rows", ("layer_first", "page_first", "page_first_direct")),
    Family("MiniMax-M3 NVFP4 index K (block scales inside the rows)", "MiniMaxM3Nvfp4IndexKPoolHost",
           "nvfp4_page_rows", ("layer_first", "page_first", "page_first_direct")),
    Family("MiniMax sparse index K (K only)", "MHATokenToKOnlyPoolHost", "mha_k_only",
           ("layer_first", "page_first", "page_first_direct")),
    Family("HiSparse, MLA (--enable-hisparse; swap-in by SGLang's kernels, opt-in)", "MLATokenToKVPoolHost", "mla",
           ("layer_first",), io_backends=("kernel",)),
    Family("HiSparse, MiniMax-M3 MHA (--enable-hisparse; swap-in by SGLang's kernels, opt-in)",
           "HiSparseMHATokenToKVPoolHost", "mha", ("layer_first",), io_backends=("kernel",)),
    Family("HiSparse, DeepSeek-V4 C4 (--enable-hisparse; 8-byte words of the page rows; swap-in by SGLang's "
           "kernels, opt-in)", "DeepSeekV4PagedHostPool", "dsv4_paged", ("layer_first",), io_backends=("kernel",)),
)  # fmt: skip


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


def served(family: Family, layout: str) -> list[str]:
    """The io backends serving every operation the adapter resolves for ``family`` in ``layout``."""
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
    """The markdown table: served families (layout: io backends), then the families that stay SGLang's."""
    lines = ["| SGLang host pool family | SGLang class | hicache pool kind | layout: io backends |",
             "|---|---|---|---|"]  # fmt: skip
    for f in FAMILIES:
        cells = [f"{layout}: {', '.join(served(f, layout)) or 'none'}" for layout in f.layouts]
        kinds = " + ".join(f"`{k}`" for k in (f.kind, *f.with_kinds))
        lines.append(f"| {f.name} | `{f.sglang}` | {kinds} | {'<br>'.join(cells)} |")
    lines.append("| DeepSeek-V4 FULL anchor | `LogicalHostPool` | (slots only, no bytes) | every layout: no transfer |")
    lines.append("| KV with per-slot scales: refused when the pool is built (SGLang's host pools refuse it too) | "
                 "`MHATokenToKVPoolFP4`, `MLATokenToKVPoolFP4`, `MHATokenToKVPoolMXFP8` below page size 128 | "
                 "SGLang's | an FP4 KV cache; MXFP8 with --page-size other than 128 |")  # fmt: skip
    for r in builders.REFUSALS:
        lines.append(f"| {r.family}: refused at start-up | `{r.pools}` | SGLang's | {r.how} |")
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
