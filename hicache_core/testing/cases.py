"""The cases the conformance kit generates, and the small pools it runs them on.

Shapes are deliberately tiny (two heads of eight bf16 elements, an MLA row of
16 + 8, page rows of 24 bytes, three layers) so the whole matrix runs in seconds
on a CPU; the bytes are random, so a transfer that moves the wrong bytes, or
moves them through a float conversion, cannot pass by accident.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch

from ..device_pools import MHADevicePool, MLADevicePool, PageRowsDevicePool
from ..geometry import COMPONENT_ATTRS, pool_kind_of
from ..implementation import BACKUP_ALL, BACKUP_LAYER, LOAD

#: Ways a pool can be built: whole model, a layer shard (context/pipeline parallelism), or with an MTP draft layer.
VARIANTS: tuple[str, ...] = ("plain", "sharded", "draft")
PAGE_SIZES: tuple[int, ...] = (1, 64)
INDEX_DTYPES: tuple[str, ...] = ("int32", "int64")
OPERATION_ORDER: tuple[str, ...] = (LOAD, BACKUP_ALL, BACKUP_LAYER)

HEADS, HEAD_DIM, V_HEAD_DIM = 2, 8, 4
KV_LORA_RANK, QK_ROPE_HEAD_DIM = 16, 8
ROW_BYTES = 24
LAYERS = 3
#: A sharded pool owns layers [1, 3) of 4.
SHARD = (4, 1, 3)
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Case:
    """One generated conformance case; :attr:`id` is its readable pytest id."""

    pool_kind: str
    layout: str
    operation: str
    variant: str = "plain"
    page_size: int = 64
    index_dtype: str = "int64"
    extra: str = ""

    @property
    def id(self) -> str:
        parts = [self.pool_kind, self.layout, self.operation, self.variant, f"p{self.page_size}", self.index_dtype]
        if self.extra:
            parts.append(self.extra)
        return "-".join(parts)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.index_dtype)

    @property
    def seed(self) -> int:
        """A stable seed per case, so a failure reproduces with the same bytes and indices."""
        return zlib.crc32(self.id.encode())


def device_size(pool_kind: str, page_size: int) -> int:
    """Device pool size in tokens; for pages > 1 token its last page is partial (rows = size + page_size)."""
    if pool_kind == "page_rows":
        return 5 * page_size
    return 40 if page_size == 1 else 4 * page_size - page_size // 2


def host_size(pool_kind: str, page_size: int) -> int:
    """Host pool size in tokens (always whole pages)."""
    return 48 if page_size == 1 and pool_kind != "page_rows" else 6 * page_size


def _one_pool(pool_kind: str, page_size: int, device: torch.device, layer_range: tuple[int, int, int]) -> Any:
    layer_num, start, end = layer_range
    size = device_size(pool_kind, page_size)
    if pool_kind in ("mha", "mha_asym"):
        v_dim = HEAD_DIM if pool_kind == "mha" else V_HEAD_DIM
        return MHADevicePool(
            size, page_size, DTYPE, HEADS, HEAD_DIM, layer_num, device,
            v_head_dim=v_dim, start_layer=start, end_layer=end,
        )  # fmt: skip
    if pool_kind == "mla":
        return MLADevicePool(
            size, page_size, DTYPE, KV_LORA_RANK, QK_ROPE_HEAD_DIM, layer_num, device, start_layer=start, end_layer=end
        )
    if pool_kind == "page_rows":
        return PageRowsDevicePool(
            size // page_size, page_size, ROW_BYTES, layer_num, device, start_layer=start, end_layer=end
        )
    raise ValueError(f"the conformance kit has no shape for pool kind {pool_kind!r}")


def build_device_pools(
    pool_kind: str, variant: str, page_size: int, device: str | torch.device
) -> tuple[Any, tuple[Any, ...]]:
    """A small device pool of ``pool_kind`` and its draft pools (one for the ``draft`` variant), zeroed."""
    device = torch.device(device)
    if variant == "sharded":
        return _one_pool(pool_kind, page_size, device, SHARD), ()
    pool = _one_pool(pool_kind, page_size, device, (LAYERS, 0, LAYERS))
    if variant == "draft":
        return pool, (_one_pool(pool_kind, page_size, device, (1, 0, 1)),)
    if variant != "plain":
        raise ValueError(f"unknown variant {variant!r}; variants: {', '.join(VARIANTS)}")
    return pool, ()


def device_tensors(pool: Any, drafts: tuple[Any, ...]) -> dict[str, torch.Tensor]:
    """Every per-layer device tensor of a pool and its drafts, by a readable name."""
    out = {}
    for attr in COMPONENT_ATTRS[pool_kind_of(pool)]:
        for i, t in enumerate(getattr(pool, attr)):
            out[f"device {attr}[{i}]"] = t
        for j, d in enumerate(drafts):
            out[f"draft pool {j} {attr}[0]"] = getattr(d, attr)[0]
    return out


def host_tensors(host_pool: Any) -> dict[str, torch.Tensor]:
    """Every host buffer of a host pool, by a readable name."""
    return {f"host {attr}": t for attr, t in host_pool.plan.host_buffers.items()}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor."""
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def fill_random(tensors: list[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
    """Fill each tensor with random bytes; returns the CPU byte images written (to copy into a twin)."""
    images = []
    for t in tensors:
        image = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=generator)
        as_bytes(t).copy_(image)
        images.append(image)
    return images


def pages_of(slot_pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Token slots of whole pages, page after page, slots in order inside each page."""
    return (slot_pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def pick(count: int, population: int, generator: torch.Generator, *, include: int | None = None) -> torch.Tensor:
    """``count`` distinct values of ``range(population)`` in random order, always holding ``include``."""
    chosen = torch.randperm(population, generator=generator)[:count]
    if include is not None and include not in chosen.tolist():
        chosen[int(torch.randint(0, count, (1,), generator=generator))] = include
    return chosen
