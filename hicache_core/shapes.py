"""Model-like pool shapes (../shared/benchmarks.md) for ``explain``, ``matrix``, ``demo`` and ``bench``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .device_pools import MHADevicePool, MLADevicePool, PageRowsDevicePool
from .geometry import Component, PoolGeometry


@dataclass(frozen=True)
class ModelShape:
    """A named, model-like pool shape."""

    name: str
    kind: str
    layers: int
    heads: int = 0
    head_dim: int = 0
    v_head_dim: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0
    row_bytes: int = 0
    dtype: torch.dtype = torch.bfloat16

    def item_bytes(self) -> int:
        """Bytes of one item (all parts of one token, or one page row) in one layer."""
        it = torch.empty((), dtype=self.dtype).element_size()
        if self.kind in ("mha", "mha_asym"):
            return self.heads * (self.head_dim + self.v_head_dim) * it
        if self.kind == "mla":
            return (self.kv_lora_rank + self.rope_dim) * it
        return self.row_bytes

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
        start = layer_num // 2 if sharded else 0
        if self.kind in ("mha", "mha_asym"):
            comps = (
                Component("k", "k_buffer", self.heads, self.head_dim),
                Component("v", "v_buffer", self.heads, self.v_head_dim),
            )
            extras: tuple = ()
        elif self.kind == "mla":
            comps = (Component("kv", "kv_buffer", 1, self.kv_lora_rank + self.rope_dim),)
            extras = (("kv_lora_rank", self.kv_lora_rank), ("qk_rope_head_dim", self.rope_dim))
        else:
            comps = (Component("row", "index_k_with_scale_buffer", None, self.row_bytes),)
            extras = ()
        return PoolGeometry(
            kind=self.kind,
            dtype=torch.uint8 if self.kind == "page_rows" else self.dtype,
            page_size=page_size,
            layer_num=layer_num,
            start_layer=start,
            end_layer=layer_num,
            draft_layers=1 if draft else 0,
            device_type=device_type,
            components=comps,
            extras=extras,
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
    ):
        """Allocate a device pool of this shape holding ``tokens`` slots (plus SGLang's padding page)."""
        layer_num = layers or self.layers
        kw = dict(start_layer=start_layer, end_layer=end_layer)
        if self.kind in ("mha", "mha_asym"):
            return MHADevicePool(
                tokens, page_size, self.dtype, self.heads, self.head_dim, layer_num, device,
                v_head_dim=self.v_head_dim, **kw,
            )  # fmt: skip
        if self.kind == "mla":
            return MLADevicePool(
                tokens, page_size, self.dtype, self.kv_lora_rank, self.rope_dim, layer_num, device, **kw
            )
        return PageRowsDevicePool(tokens // page_size + 1, page_size, self.row_bytes, layer_num, device, **kw)


SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape("llama-8b", "mha", 32, heads=8, head_dim=128, v_head_dim=128),
        ModelShape("mimo-asym", "mha_asym", 48, heads=8, head_dim=192, v_head_dim=128),
        ModelShape("deepseek-mla", "mla", 61, kv_lora_rank=512, rope_dim=64),
        ModelShape("deepseek-mla-fp8", "mla", 61, kv_lora_rank=528, rope_dim=128, dtype=torch.uint8),
        ModelShape("dsa-indexer", "page_rows", 61, row_bytes=64 * 132),
    )
}

#: The shape ``explain`` and ``matrix`` use for each pool kind.
SHAPE_FOR_KIND: dict[str, ModelShape] = {
    "mha": SHAPES["llama-8b"],
    "mha_asym": SHAPES["mimo-asym"],
    "mla": SHAPES["deepseek-mla"],
    "page_rows": SHAPES["dsa-indexer"],
}
