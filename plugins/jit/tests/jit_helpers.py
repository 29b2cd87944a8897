"""Small pools, random bytes and a byte-exact comparison against the core's reference, for the jit tests."""

from __future__ import annotations

import torch

import hicache_core as hc
from hicache_core.testing.guarded import byte_images, fill_random, synchronize, tiny_pool

__all__ = ["fill_random", "snapshot", "restore", "small_pool", "pages", "check_against_reference"]


#: A tiny device pool of a kind (``mha``, ``mha_asym``, ``mla``, ``mla_odd``, ``page_rows``, ``wide_rows``).
small_pool = tiny_pool


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def snapshot(tensors) -> list[torch.Tensor]:
    """Byte images, taken once every stream is done (a kernel may still be writing pinned host memory)."""
    return byte_images(tensors)


def restore(tensors, images) -> None:
    synchronize()
    for t, image in zip(tensors, images):
        as_bytes(t).copy_(image.to(t.device))


def pages(page_list, page_size: int) -> torch.Tensor:
    """Token slots of whole pages, page after page."""
    p = torch.tensor(page_list, dtype=torch.int64)
    return (p[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def check_against_reference(host, impl, op: str, h: torch.Tensor, d: torch.Tensor, layer: int, seed: int = 0) -> None:
    """Run ``op`` through ``impl`` and through the reference from the same random bytes; every byte must match.

    ``h``/``d`` are item indices as the implementation receives them (page rows for page-row pools).
    """
    plan = host.plan
    tensors = list(plan.host_buffers.values()) + [t for p in plan.parts for t in p.device_layers]
    tensors = list({id(t): t for t in tensors}.values())
    fill_random(tensors, seed)
    start = snapshot(tensors)
    device = plan.device
    getattr(impl, op)(h.to(device), d.to(device), layer)
    got = snapshot(tensors)
    restore(tensors, start)
    hc.reference_copy(plan, h, d, [layer], to_device=op == hc.LOAD)
    want = snapshot(tensors)
    for i, (a, b) in enumerate(zip(got, want)):
        if not torch.equal(a, b):
            diff = int((a != b).sum())
            raise AssertionError(f"{op} layer {layer}: tensor {i} differs from the reference in {diff} bytes")
    assert any(not torch.equal(a, s) for a, s in zip(got, start)), f"{op} moved nothing"
