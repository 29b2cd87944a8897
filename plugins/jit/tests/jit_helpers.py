"""Small pools, random bytes and a byte-exact comparison against the core's reference, for the jit tests."""

from __future__ import annotations

import torch

import hicache_core as hc


def small_pool(kind: str, device: str, *, page_size: int = 4, pages: int = 8, layers: int = 3, **kw):
    """A tiny device pool of ``kind`` (``mha``, ``mha_asym``, ``mla``, ``page_rows``, ``wide_rows``)."""
    size = pages * page_size
    if kind == "mha":
        return hc.MHADevicePool(size, page_size, torch.bfloat16, 2, 8, layers, device, **kw)
    if kind == "mha_asym":
        return hc.MHADevicePool(size, page_size, torch.bfloat16, 2, 8, layers, device, v_head_dim=4, **kw)
    if kind == "mla":
        return hc.MLADevicePool(size, page_size, torch.bfloat16, 16, 8, layers, device, **kw)
    if kind == "mla_odd":  # 2 x 36 B items: 4-byte words, a tail block
        return hc.MLADevicePool(size, page_size, torch.bfloat16, 12, 6, layers, device, **kw)
    if kind == "wide_rows":  # 16400-byte page rows: wider than the row kernel's limit, so the flat kernel
        return hc.PageRowsDevicePool(pages + 1, page_size, 16400, layers, device, **kw)
    return hc.PageRowsDevicePool(pages + 1, page_size, 24, layers, device, **kw)


def device_tensors(pool) -> list[torch.Tensor]:
    attrs = ("k_buffer", "v_buffer", "kv_buffer", "index_k_with_scale_buffer")
    return [t for a in attrs for t in (getattr(pool, a, None) or [])]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def fill_random(tensors, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in tensors:
        flat = as_bytes(t)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen).to(t.device))


def snapshot(tensors) -> list[torch.Tensor]:
    return [as_bytes(t).cpu().clone() for t in tensors]


def restore(tensors, images) -> None:
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
    if device.type == "cuda":
        torch.cuda.synchronize()
    got = snapshot(tensors)
    restore(tensors, start)
    hc.reference_copy(plan, h, d, [layer], to_device=op == hc.LOAD)
    want = snapshot(tensors)
    for i, (a, b) in enumerate(zip(got, want)):
        if not torch.equal(a, b):
            diff = int((a != b).sum())
            raise AssertionError(f"{op} layer {layer}: tensor {i} differs from the reference in {diff} bytes")
    assert any(not torch.equal(a, s) for a, s in zip(got, start)), f"{op} moved nothing"
