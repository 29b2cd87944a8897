"""The cases the conformance kit generates, and the small pools it runs them on.

Pools are built from each registered pool kind's declaration (its example rows:
two heads of eight bf16 elements, an MLA row of 16 + 8, page rows of a few dozen
bytes; three layers), so a kind a plugin registers is covered with no change here.
Shapes are deliberately tiny so the whole matrix runs in seconds on a CPU; the bytes
are random, so a transfer that moves the wrong bytes, or moves them through a float
conversion, cannot pass by accident.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch

from ..declared.pool_kinds import PoolKind
from ..plugins.implementation import BACKUP_ALL, BACKUP_LAYER, LOAD
from ..plugins.registry import get_registry
from ..pool.device_pools import DeclaredDevicePool
from ..pool.host_pool import pool_kind_of

#: Ways a pool can be built: whole model, a layer shard (context/pipeline parallelism), or with an MTP draft layer.
VARIANTS: tuple[str, ...] = ("plain", "sharded", "draft")
PAGE_SIZES: tuple[int, ...] = (1, 64)
INDEX_DTYPES: tuple[str, ...] = ("int32", "int64")
OPERATION_ORDER: tuple[str, ...] = (LOAD, BACKUP_ALL, BACKUP_LAYER)

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


def device_size(kind: PoolKind, page_size: int) -> int:
    """Device pool size in tokens; for pages > 1 token its last page is partial (rows = size + page_size)."""
    if kind.items_are_pages:
        return 5 * page_size
    return 40 if page_size == 1 else 4 * page_size - page_size // 2


def host_size(kind: PoolKind, page_size: int) -> int:
    """Host pool size in tokens (always whole pages)."""
    return 48 if page_size == 1 and not kind.items_are_pages else 6 * page_size


def device_pages(kind: PoolKind, page_size: int) -> int:
    """Device pages a transfer may address (rows for page kinds; the padding page included for token kinds)."""
    if kind.items_are_pages:
        return device_size(kind, page_size) // page_size
    return (device_size(kind, page_size) + page_size) // page_size


def _one_pool(kind: PoolKind, page_size: int, device: torch.device, layer_range: tuple[int, int, int]) -> Any:
    layer_num, start, end = layer_range
    return DeclaredDevicePool(
        kind, device_size(kind, page_size), page_size, layer_num, device, dtype=DTYPE, start_layer=start, end_layer=end
    )


def build_device_pools(
    pool_kind: PoolKind | str, variant: str, page_size: int, device: str | torch.device
) -> tuple[Any, tuple[Any, ...]]:
    """A small device pool of ``pool_kind`` and its draft pools (one for the ``draft`` variant), zeroed."""
    kind = _declaration(pool_kind)
    device = torch.device(device)
    if variant == "sharded":
        return _one_pool(kind, page_size, device, SHARD), ()
    pool = _one_pool(kind, page_size, device, (LAYERS, 0, LAYERS))
    if variant == "draft":
        return pool, (_one_pool(kind, page_size, device, (1, 0, 1)),)
    if variant != "plain":
        raise ValueError(f"unknown variant {variant!r}; variants: {', '.join(VARIANTS)}")
    return pool, ()


def _declaration(pool_kind: PoolKind | str) -> PoolKind:
    if isinstance(pool_kind, PoolKind):
        return pool_kind
    return get_registry().pool_kinds[pool_kind]  # the kit is a door: names are resolved here


def device_tensors(pool: Any, drafts: tuple[Any, ...], kind: PoolKind | None = None) -> dict[str, torch.Tensor]:
    """Every per-layer device tensor of a pool and its drafts, by a readable name."""
    kind = kind or pool_kind_of(pool)
    out = {}
    for comp in kind.components:
        for i, t in enumerate(getattr(pool, comp.device_attr)):
            out[f"device {comp.device_attr}[{i}]"] = t
        for j, d in enumerate(drafts):
            out[f"draft pool {j} {comp.device_attr}[0]"] = getattr(d, comp.device_attr)[0]
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
