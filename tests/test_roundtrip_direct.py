"""Every combination the direct plugin claims round-trips byte-exact against the reference."""

from __future__ import annotations

import itertools

import pytest
import torch
from core_helpers import (
    DEVICE,
    KINDS,
    device_pool,
    device_tensors,
    draft_pool,
    fill_random,
    host_tensors,
    random_page_slots,
    same_bytes,
)

import hicache_core as hc
from hicache_core.dispatch import reasons_for

CASES = [
    (kind, layout, page_size, variant)
    for kind, layout, page_size, variant in itertools.product(
        KINDS,
        ("layer_first", "page_first", "page_first_direct", "page_head", "page_first_kv_split"),
        (1, 64),
        ("plain", "sharded", "draft"),
    )
]


def _ids(case):
    kind, layout, page_size, variant = case
    return f"{kind}-{layout}-p{page_size}-{variant}"


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_direct_round_trip(case, direct_only):
    kind, layout, page_size, variant = case
    pages = 5
    dev = device_pool(kind, page_size, pages=pages, sharded=variant == "sharded")
    drafts = [draft_pool(kind, page_size, pages)] if variant == "draft" else []
    impl = direct_only.implementations["direct.copy_engine"]
    geometry = hc.geometry_of(dev, draft_pools=tuple(drafts))
    pinned = DEVICE == "cuda"
    requests = [hc.TransferRequest("direct", op, geometry, direct_only.layouts[layout], pinned) for op in hc.OPERATIONS]
    if any(reasons_for(impl, r) for r in requests):
        with pytest.raises(hc.UnsupportedCombinationError):
            hc.make_host_pool(dev, layout=layout, io_backend="direct", draft_pools=drafts, registry=direct_only)
        return
    kw = dict(layout=layout, size=4 * page_size, draft_pools=drafts, registry=direct_only)
    host = hc.make_host_pool(dev, io_backend="direct", operations=hc.OPERATIONS, **kw)
    ref = hc.make_host_pool(dev, io_backend="reference", operations=hc.OPERATIONS, **kw)
    fill_random(device_tensors(dev) + [t for d in drafts for t in device_tensors(d)], seed=1)
    fill_random(host_tensors(host), seed=2)
    for name, buf in host.plan.host_buffers.items():
        ref.plan.host_buffers[name].copy_(buf)

    host_slots = random_page_slots(4, 3, page_size, seed=3)
    dev_slots = random_page_slots(pages, 3, page_size, seed=4, first=1)
    for idx_dtype in (torch.int64, torch.int32):
        h, d = host_slots.to(idx_dtype), dev_slots.to(idx_dtype)
        host.backup_from_device_all_layer(dev, h, d, "direct")
        ref.backup_from_device_all_layer(dev, h, d, "reference")
        assert all(same_bytes(a, b) for a, b in zip(host_tensors(host), host_tensors(ref)))

        # per-layer backup of the owned layers and the drafts into fresh host pages
        h2 = random_page_slots(4, 2, page_size, seed=5).to(idx_dtype)
        d2 = dev_slots[: 2 * page_size].to(idx_dtype)
        for layer in range(dev.layer_num):
            host.backup_from_device_per_layer(dev, h2, d2, layer, "direct")
            ref.backup_from_device_per_layer(dev, h2, d2, layer, "reference")
        for i, draft in enumerate(drafts):
            host.backup_from_device_per_layer(draft, h2, d2, dev.layer_num + i, "direct", is_draft=True)
            ref.backup_from_device_per_layer(draft, h2, d2, dev.layer_num + i, "reference", is_draft=True)
        assert all(same_bytes(a, b) for a, b in zip(host_tensors(host), host_tensors(ref)))

    # load every layer back into other device slots and compare with the reference doing the same
    before = [t.clone() for t in device_tensors(dev)]
    new_slots = random_page_slots(pages, 3, page_size, seed=6, first=1)
    for layer in range(dev.layer_num):
        host.load_to_device_per_layer(dev, host_slots, new_slots, layer, "direct")
    ours = [t.clone() for t in device_tensors(dev)]
    for t, b in zip(device_tensors(dev), before):
        t.copy_(b)
    for layer in range(dev.layer_num):
        ref.load_to_device_per_layer(dev, host_slots, new_slots, layer, "reference")
    assert all(same_bytes(a, b) for a, b in zip(ours, device_tensors(dev)))
    for i, draft in enumerate(drafts):
        snap = [t.clone() for t in device_tensors(draft)]
        host.load_to_device_per_layer(draft, host_slots, new_slots, dev.layer_num + i, "direct", is_draft=True)
        ours = [t.clone() for t in device_tensors(draft)]
        for t, b in zip(device_tensors(draft), snap):
            t.copy_(b)
        ref.load_to_device_per_layer(draft, host_slots, new_slots, dev.layer_num + i, "reference", is_draft=True)
        assert all(same_bytes(a, b) for a, b in zip(ours, device_tensors(draft)))
