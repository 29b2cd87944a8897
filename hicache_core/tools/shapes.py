"""Model-like pool shapes (the models the benchmarks use) for ``explain``, ``matrix``, ``demo`` and ``bench``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..declared.pool_kinds import PoolKind
from ..plugins.registry import get_registry
from ..pool.device_pools import DeclaredDevicePool
from ..pool.geometry import PoolGeometry, example_geometry


@dataclass(frozen=True)
class ModelShape:
    """A named, model-like pool shape: a pool kind, its per-component rows, layers and dtype.

    ``rows`` gives each component's row: ``(heads, dim)`` for token kinds, ``(row_bytes,)`` for
    page kinds; components it leaves out keep the declaration's example.
    """

    name: str
    kind: str
    layers: int
    rows: tuple[tuple[str, tuple[int, ...]], ...] = ()
    extras: tuple[tuple[str, int], ...] = ()
    dtype: torch.dtype = torch.bfloat16

    def declaration(self) -> PoolKind:
        return get_registry().pool_kinds[self.kind]  # the hicache command is a door: it resolves names

    def item_bytes(self) -> int:
        """Bytes of one item (all parts of one token, or one page row) in one layer."""
        return sum(self.geometry(page_size=1, device_type="cpu").item_bytes)

    def geometry(
        self,
        *,
        page_size: int = 64,
        device_type: str = "cuda",
        sharded: bool = False,
        draft: bool = False,
        layers: int | None = None,
    ) -> PoolGeometry:
        """The pool's geometry, without allocating it (sharded: this rank owns the second half)."""
        layer_num = layers or self.layers
        return example_geometry(
            self.declaration(),
            page_size=page_size,
            layer_num=layer_num,
            start_layer=layer_num // 2 if sharded else 0,
            draft_layers=1 if draft else 0,
            device_type=device_type,
            rows=dict(self.rows),
            extras=dict(self.extras),
            dtype=self.dtype,
        )

    def device_pool(
        self,
        tokens: int,
        *,
        page_size: int,
        device: str | torch.device,
        layers: int | None = None,
        start_layer: int = 0,
        end_layer: int | None = None,
    ) -> DeclaredDevicePool:
        """Allocate a device pool of this shape holding ``tokens`` slots (plus SGLang's padding page)."""
        kind = self.declaration()
        # Page kinds keep one more page than the tokens need, as SGLang's padding page.
        size = tokens + page_size if kind.items_are_pages else tokens
        return DeclaredDevicePool(
            kind, size, page_size, layers or self.layers, device, dtype=self.dtype, rows=dict(self.rows),
            extras=dict(self.extras), start_layer=start_layer, end_layer=end_layer,
        )  # fmt: skip


def _mla(name: str, latent: int, rope: int, dtype: torch.dtype = torch.bfloat16) -> ModelShape:
    return ModelShape(
        name, "mla", 61, (("kv", (1, latent + rope)),), (("kv_lora_rank", latent), ("qk_rope_head_dim", rope)), dtype
    )


SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape("llama-8b", "mha", 32, (("k", (8, 128)), ("v", (8, 128)))),
        ModelShape("mimo-asym", "mha_asym", 48, (("k", (8, 192)), ("v", (8, 128)))),
        ModelShape("minimax-index-k", "mha_k_only", 62, (("k", (1, 128)),)),
        _mla("deepseek-mla", 512, 64),
        _mla("deepseek-mla-fp8", 528, 128, torch.uint8),
        ModelShape("dsa-indexer", "page_rows", 61, (("row", (64 * 132,)),)),
        # DeepSeek-V4 sub-pools; the page-row sizes are illustrative (64 tokens of 656-byte fp8 rows, an 8 KiB ring).
        ModelShape("dsv4-paged", "dsv4_paged", 61, (("row", (64 * 656,)),)),
        ModelShape("dsv4-state", "dsv4_state", 61, (("state", (8 * 1024,)),)),
    )
}


def shape_for_kind(kind: str) -> ModelShape:
    """The model shape ``explain`` and ``matrix`` use for a pool kind (the declaration's example if none)."""
    for shape in SHAPES.values():
        if shape.kind == kind:
            return shape
    return ModelShape(f"{kind}-example", kind, 4)
