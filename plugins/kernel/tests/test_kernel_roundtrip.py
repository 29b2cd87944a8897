"""Every layout x pool kind x operation round-trips byte-exact against the core reference.

Both host pools start from the same random bytes (never zeros); after each operation the
kernel's pool and the reference's pool are compared whole, so bytes outside the given
indices must be untouched too.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import hicache_core as hc
from hicache_core.testing.guarded import fill_random, synchronize, tiny_pool

LAYOUTS = {
    "mha": ("layer_first", "page_first", "page_first_direct", "page_head"),
    "mha_asym": ("layer_first", "page_first", "page_first_direct", "page_head"),
    "mla": ("layer_first", "page_first", "page_first_direct", "page_first_kv_split"),
    "page_rows": ("layer_first", "page_first", "page_first_direct"),
}
LAYERS = 3
DEVICE_PAGES = 4  # page 0 is SGLang's padding page; the others are moved
HOST_PAGES = 4
MOVED_PAGES = 2


def make_device_pool(kind: str, page_size: int, device: str, *, layers: int = LAYERS, sharded: bool = False):
    """A tiny pool; ``sharded`` owns layers [1, layers). Item sizes pick 16-byte and 8-byte words."""
    kw = dict(start_layer=1, end_layer=layers) if sharded else {}
    return tiny_pool(kind, device, page_size=page_size, pages=DEVICE_PAGES - 1, layers=layers, **kw)


def device_tensors(pool) -> list[torch.Tensor]:
    attrs = ("k_buffer", "v_buffer", "kv_buffer", "index_k_with_scale_buffer")
    return [t for a in attrs for t in (getattr(pool, a, None) or [])]


def same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    synchronize()  # the kernel writes pinned host memory asynchronously: wait before reading it
    return len(a) == len(b) and all(
        torch.equal(x.reshape(-1).view(torch.uint8).cpu(), y.reshape(-1).view(torch.uint8).cpu()) for x, y in zip(a, b)
    )


def page_slots(num_pages: int, count: int, page_size: int, seed: int, first: int = 0) -> torch.Tensor:
    """Token slots of ``count`` distinct random pages in ``[first, num_pages)``, pages in random order."""
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(num_pages - first, generator=gen)[:count] + first
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def host_tensors(host) -> list[torch.Tensor]:
    return list(host.plan.host_buffers.values())


def make_pair(dev, layout: str, page_size: int, drafts, **tuning):
    """The kernel's host pool and the reference's, both holding the same random bytes."""
    kw = dict(layout=layout, size=HOST_PAGES * page_size, draft_pools=drafts, operations=hc.OPERATIONS)
    host = hc.make_host_pool(dev, io_backend="kernel", **kw)
    ref = hc.make_host_pool(dev, io_backend="reference", **kw)
    assert set(host.implementations.values()) == {"kernel.triton_uva"}
    for op in hc.OPERATIONS:
        impl = host.implementation_for(op)
        for name, value in tuning.items():
            setattr(impl, name, value)
    fill_random(host_tensors(host), seed=11)
    for name, buf in host.plan.host_buffers.items():
        ref.plan.host_buffers[name].copy_(buf)
    return host, ref


def run_all_operations(dev, drafts, host, ref, page_size: int, idx_dtype: torch.dtype) -> None:
    """All-layer backup, per-layer backup (owned and draft layers), per-layer load; compare after each."""
    everything = device_tensors(dev) + [t for d in drafts for t in device_tensors(d)]
    where = everything[0].device
    fill_random(everything, seed=12)
    h = page_slots(HOST_PAGES, MOVED_PAGES, page_size, seed=13).to(idx_dtype)
    d = page_slots(DEVICE_PAGES, MOVED_PAGES, page_size, seed=14, first=1).to(idx_dtype)
    hd, dd = h.to(where), d.to(where)

    host.backup_from_device_all_layer(dev, h, d, "kernel")
    ref.backup_from_device_all_layer(dev, h, d, "reference")
    assert same_bytes(host_tensors(host), host_tensors(ref)), "backup_from_device_all_layer"

    # Per-layer backup from other device pages into other host pages; indices already on the device.
    h2 = page_slots(HOST_PAGES, 1, page_size, seed=15).to(idx_dtype)
    d2 = page_slots(DEVICE_PAGES, 1, page_size, seed=16, first=1).to(idx_dtype)
    fill_random(everything, seed=17)
    for layer in range(dev.layer_num):
        host.backup_from_device_per_layer(dev, h2.to(where), d2.to(where), layer, "kernel")
        ref.backup_from_device_per_layer(dev, h2, d2, layer, "reference")
    for i, draft in enumerate(drafts):
        host.backup_from_device_per_layer(draft, h2, d2, dev.layer_num + i, "kernel", is_draft=True)
        ref.backup_from_device_per_layer(draft, h2, d2, dev.layer_num + i, "reference", is_draft=True)
    assert same_bytes(host_tensors(host), host_tensors(ref)), "backup_from_device_per_layer"

    # Per-layer load into random device pages: run the kernel, keep its result, redo with the reference.
    fill_random(everything, seed=18)
    synchronize()
    before = [t.clone() for t in everything]
    for layer in range(dev.layer_num):
        host.load_to_device_per_layer(dev, hd, dd, layer, "kernel")
    for i, draft in enumerate(drafts):
        host.load_to_device_per_layer(draft, h, d, dev.layer_num + i, "kernel", is_draft=True)
    synchronize()
    got = [t.clone() for t in everything]
    for t, b in zip(everything, before):
        t.copy_(b)
    for layer in range(dev.layer_num):
        ref.load_to_device_per_layer(dev, h, d, layer, "reference")
    for i, draft in enumerate(drafts):
        ref.load_to_device_per_layer(draft, h, d, dev.layer_num + i, "reference", is_draft=True)
    assert same_bytes(got, everything), "load_to_device_per_layer"
    assert not same_bytes(got, before), "the load moved nothing"


CASES = [
    (kind, layout, page_size, variant)
    for kind, layouts in LAYOUTS.items()
    for layout, page_size, variant in itertools.product(layouts, (1, 64), ("plain", "sharded", "draft"))
]


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_round_trip(case, kernel_device):
    kind, layout, page_size, variant = case
    dev = make_device_pool(kind, page_size, kernel_device, sharded=variant == "sharded")
    drafts = [make_device_pool(kind, page_size, kernel_device, layers=1)] if variant == "draft" else []
    host, ref = make_pair(dev, layout, page_size, drafts)
    # Alternate index dtypes across cases so both run on every pool kind and layout.
    idx_dtype = torch.int32 if (page_size == 1) == (variant != "sharded") else torch.int64
    run_all_operations(dev, drafts, host, ref, page_size, idx_dtype)


@pytest.mark.parametrize(
    "max_ctas, tile_words",
    [(1, 4), (2, 8), (0, 16), (None, 2048)],
    ids=["one-cta", "two-ctas", "unlimited", "default-tile"],
)
@pytest.mark.parametrize(
    "kind, layout", [("mha", "page_head"), ("mla", "page_first_kv_split"), ("mha_asym", "page_first")]
)
def test_grid_stride_and_tiles(kind, layout, max_ctas, tile_words, kernel_device):
    """Small tiles and few CTAs: each CTA walks many tiles across layers and both parts."""
    page_size = 4
    dev = make_device_pool(kind, page_size, kernel_device, sharded=True)
    drafts = [make_device_pool(kind, page_size, kernel_device, layers=1)]
    host, ref = make_pair(dev, layout, page_size, drafts, max_ctas=max_ctas, tile_words=tile_words)
    run_all_operations(dev, drafts, host, ref, page_size, torch.int64)


ODD = {
    # (pool, word the kernel must pick)
    "fp16-head-dim-3": (lambda dev: hc.MHADevicePool(12, 4, torch.float16, 3, 3, 2, dev), 2),
    "fp32-head-dim-1": (lambda dev: hc.MHADevicePool(12, 4, torch.float32, 1, 1, 2, dev, v_head_dim=3), 4),
    "rows-of-13-bytes": (lambda dev: hc.PageRowsDevicePool(4, 4, 13, 2, dev), 1),
    "fp8-mla-656-bytes": (lambda dev: hc.MLADevicePool(12, 4, torch.float8_e4m3fn, 592, 64, 2, dev), 16),
}


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("name", list(ODD))
def test_any_item_size(name, layout, kernel_device):
    """Item sizes no wide word divides still move byte-exact, in the widest word that fits."""
    build, word = ODD[name]
    dev = build(kernel_device)
    host, ref = make_pair(dev, layout, 4, [])
    assert host.implementation_for(hc.LOAD).word_bytes == word
    run_all_operations(dev, [], host, ref, 4, torch.int64)
