"""Helpers for the core's tests: small pools of every kind, random bytes, random whole pages.

(A module of its own, not conftest.py: plugin test folders have conftests too, and
``from conftest import`` would pick whichever was imported first.)
"""

from __future__ import annotations

import os

import torch

import hicache_core as hc
from hicache_core.pool.device_pools import DeclaredDevicePool
from hicache_core.pool.host_pool import pool_kind_of
from hicache_core.testing import guarded

KINDS = ("mha", "mha_asym", "mla", "page_rows")
LAYERS = 3
#: Device pools live here; the GPU machine runs the same tests with HICACHE_TEST_DEVICE=cuda.
DEVICE = os.environ.get("HICACHE_TEST_DEVICE", "cpu")


def device_pool(kind: str, page_size: int = 4, *, pages: int = 6, sharded: bool = False, layers: int = LAYERS):
    """A small device pool; sharded pools own layers [1, layers)."""
    kw = dict(start_layer=1, end_layer=layers) if sharded else {}
    size = pages * page_size
    if kind == "mha":
        return hc.MHADevicePool(size, page_size, torch.bfloat16, 2, 8, layers, DEVICE, **kw)
    if kind == "mha_asym":
        return hc.MHADevicePool(size, page_size, torch.bfloat16, 2, 8, layers, DEVICE, v_head_dim=4, **kw)
    if kind == "mla":
        return hc.MLADevicePool(size, page_size, torch.bfloat16, 16, 8, layers, DEVICE, **kw)
    if kind == "page_rows":
        return hc.PageRowsDevicePool(pages, page_size, 24, layers, DEVICE, **kw)
    # Any other registered kind, built from its declaration's example rows.
    return DeclaredDevicePool(hc.get_registry().pool_kinds[kind], size, page_size, layers, DEVICE, **kw)


def draft_pool(kind: str, page_size: int = 4, pages: int = 6):
    return device_pool(kind, page_size, pages=pages, layers=1)


def device_tensors(pool) -> list[torch.Tensor]:
    kind = pool_kind_of(pool)
    return [t for c in kind.components for t in getattr(pool, c.device_attr)]


# Shared with the plugins' tests; snapshots wait for the device first (kernels write pinned memory late).
fill_random = guarded.fill_random
snapshot = guarded.byte_images


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8).cpu(), b.reshape(-1).view(torch.uint8).cpu())


def random_page_slots(num_pages: int, count: int, page_size: int, seed: int, first: int = 0) -> torch.Tensor:
    """Token slots of ``count`` distinct random pages from ``first .. num_pages-1``, in random order."""
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(num_pages - first, generator=gen)[:count] + first
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def host_tensors(host) -> list[torch.Tensor]:
    return list(host.plan.host_buffers.values())
