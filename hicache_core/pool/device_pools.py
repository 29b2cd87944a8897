"""Device pools with SGLang's constructor arguments and attribute names.

Servers normally pass their own pools (host pools read them by duck typing);
these exist for tests, demos, benchmarks and servers without one. Per-layer
tensors cover only the owned layers ``[start_layer, end_layer)`` and are indexed
``layer_id - start_layer``, as in SGLang's pipeline-parallel pools. Slot 0 (page 0)
is a padding slot, as in SGLang.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..declared.pool_kinds import PoolKind
from .validation import positive_int, strict_int


def _check_dtype(dtype: object) -> None:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")


class _LayeredPool:
    pool_kind: str

    def _layers(self, layer_num: int, start_layer: int, end_layer: int | None) -> range:
        layer_num = positive_int(layer_num, "layer_num")
        start_layer = strict_int(start_layer, "start_layer")
        end_layer = layer_num if end_layer is None else strict_int(end_layer, "end_layer")
        if not 0 <= start_layer < end_layer <= layer_num:
            raise ValueError(f"owned layers [{start_layer}, {end_layer}) must lie inside [0, {layer_num})")
        self.layer_num, self.start_layer, self.end_layer = layer_num, start_layer, end_layer
        self.layer_shard_enabled = (start_layer, end_layer) != (0, layer_num)
        return range(start_layer, end_layer)

    def owns_layer(self, layer_id: int) -> bool:
        return self.start_layer <= layer_id < self.end_layer


class MHADevicePool(_LayeredPool):
    """Multi-head attention KV: ``k_buffer[l]`` and ``v_buffer[l]`` of ``(size + page_size, head_num, dim)``.

    ``v_head_dim`` other than ``head_dim`` makes an asymmetric pool (``mha_asym``).
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str | torch.device,
        *,
        v_head_dim: int | None = None,
        start_layer: int = 0,
        end_layer: int | None = None,
    ) -> None:
        size, page_size = positive_int(size, "size (device token slots)"), positive_int(page_size, "page_size")
        head_num, head_dim = positive_int(head_num, "head_num"), positive_int(head_dim, "head_dim")
        v_head_dim = None if v_head_dim is None else positive_int(v_head_dim, "v_head_dim")
        _check_dtype(dtype)
        self.size, self.page_size, self.dtype, self.device = size, page_size, dtype, torch.device(device)
        self.head_num, self.head_dim = head_num, head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.pool_kind = "mha" if self.v_head_dim == head_dim else "mha_asym"
        layers = self._layers(layer_num, start_layer, end_layer)
        rows = size + page_size
        self.k_buffer = [torch.zeros(rows, head_num, head_dim, dtype=dtype, device=self.device) for _ in layers]
        self.v_buffer = [torch.zeros(rows, head_num, self.v_head_dim, dtype=dtype, device=self.device) for _ in layers]


class MLADevicePool(_LayeredPool):
    """Multi-head latent attention: ``kv_buffer[l]`` of ``(size + page_size, 1, kv_lora_rank + qk_rope_head_dim)``."""

    pool_kind = "mla"

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device: str | torch.device,
        *,
        start_layer: int = 0,
        end_layer: int | None = None,
    ) -> None:
        size, page_size = positive_int(size, "size (device token slots)"), positive_int(page_size, "page_size")
        kv_lora_rank = positive_int(kv_lora_rank, "kv_lora_rank")
        qk_rope_head_dim = positive_int(qk_rope_head_dim, "qk_rope_head_dim")
        _check_dtype(dtype)
        self.size, self.page_size, self.dtype, self.device = size, page_size, dtype, torch.device(device)
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        layers = self._layers(layer_num, start_layer, end_layer)
        rows = size + page_size
        self.kv_buffer = [torch.zeros(rows, 1, self.kv_cache_dim, dtype=dtype, device=self.device) for _ in layers]


class PageRowsDevicePool(_LayeredPool):
    """The DSA indexer's pool: one uint8 row per page per layer, ``(num_pages, row_bytes)``.

    Exposed as ``index_k_with_scale_buffer``; token slot ``t`` lives in row ``t // page_size``.
    """

    pool_kind = "page_rows"

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        row_bytes: int,
        layer_num: int,
        device: str | torch.device,
        *,
        start_layer: int = 0,
        end_layer: int | None = None,
    ) -> None:
        num_pages, page_size = positive_int(num_pages, "num_pages"), positive_int(page_size, "page_size")
        row_bytes = positive_int(row_bytes, "row_bytes")
        self.num_pages, self.page_size, self.row_bytes = num_pages, page_size, row_bytes
        self.size = num_pages * page_size
        self.dtype, self.device = torch.uint8, torch.device(device)
        layers = self._layers(layer_num, start_layer, end_layer)
        self.index_k_with_scale_buffer = [
            torch.zeros(num_pages, row_bytes, dtype=torch.uint8, device=self.device) for _ in layers
        ]


class DeclaredDevicePool(_LayeredPool):
    """A device pool of any registered pool kind, built from its declaration (tests, demos, benchmarks).

    Token kinds: each component's per-layer tensor is ``(size + page_size, heads, dim)`` (a padding
    page, as in SGLang); page kinds: ``(num_pages, row)`` uint8, ``size = num_pages * page_size``.
    Rows default to the declaration's examples; ``extras`` become attributes (e.g. ``kv_lora_rank``).
    """

    def __init__(
        self,
        kind: PoolKind,
        size: int,
        page_size: int,
        layer_num: int,
        device: str | torch.device,
        *,
        dtype: torch.dtype = torch.bfloat16,
        rows: Mapping[str, tuple[int, ...]] | None = None,
        extras: Mapping[str, int] | None = None,
        start_layer: int = 0,
        end_layer: int | None = None,
    ) -> None:
        if not isinstance(kind, PoolKind):
            # Names are resolved at the door (a registry's pool_kinds), not here.
            raise TypeError(f"kind must be a PoolKind (e.g. registry.pool_kinds[{kind!r}]), got {kind!r}")
        size, page_size = positive_int(size, "size (device token slots)"), positive_int(page_size, "page_size")
        _check_dtype(dtype)
        self.pool_kind = kind.name
        self.page_size, self.device = page_size, torch.device(device)
        layers = self._layers(layer_num, start_layer, end_layer)
        shapes = {c.name: tuple((rows or {}).get(c.name, c.example)) for c in kind.components}
        for name, value in (dict(kind.example_extras) | dict(extras or {})).items():
            setattr(self, name, value)
        if kind.items_are_pages:
            self.num_pages = -(-size // page_size)
            self.size, self.dtype = self.num_pages * page_size, torch.uint8
            count = self.num_pages
        else:
            self.size, self.dtype = size, dtype
            count = size + page_size
        for comp in kind.components:
            setattr(
                self,
                comp.device_attr,
                [torch.zeros(count, *shapes[comp.name], dtype=self.dtype, device=self.device) for _ in layers],
            )
