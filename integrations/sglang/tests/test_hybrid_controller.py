"""SGLang's HybridCacheController over a HostPoolGroup of hicache pools, packed MTP drafts included.

``build_kv_only_stack`` (SGLang's, what the radix tree uses for a plain MHA/MLA model)
builds the group and the controller; its layer mappers send each draft's layer as
``is_draft=True`` with the draft's own device pool and a layer id after the target's.
"""

from __future__ import annotations

import threading

import pytest
import torch
from sglang_setup import (
    KIND_PAIR_IDS,
    KIND_PAIRS,
    LAYERS,
    PP_START,
    allocator_for,
    device_layers,
    device_pool,
    device_rows,
    fill_random,
    host_rows,
    publish_settings,
)

DRAFTS = 2
CASES, CASE_IDS = KIND_PAIRS, KIND_PAIR_IDS


@pytest.mark.parametrize("start_layer", [0, PP_START], ids=["rank0", "pp-start20"])
@pytest.mark.parametrize("page_size", [1, 16], ids=["page1", "page16"])
@pytest.mark.parametrize("kind, layout, io_backend", CASES, ids=CASE_IDS)
def test_group_with_packed_drafts(kind, layout, io_backend, page_size, start_layer):
    import hicache_sglang
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_only_stack
    from sglang.srt.mem_cache.pool_host import HostPoolGroup

    publish_settings(layout=layout, io_backend=io_backend, page_size=page_size)
    dev = device_pool(kind, page_size, start_layer=start_layer)
    drafts = tuple(device_pool(kind, page_size, layers=1, start_layer=start_layer + LAYERS) for _ in range(DRAFTS))
    allocator = allocator_for(dev)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator,
                             page_size=page_size, mtp_draft_device_pools=drafts)  # fmt: skip
    group, controller = build_kv_only_stack(
        params=params,
        kv_pool=dev,
        full_layer_mapping={layer: layer for layer in range(LAYERS)},
        load_cache_event=threading.Event(),
        storage_backend=None,
        use_mla=kind == "mla",
    )
    assert isinstance(group, HostPoolGroup)
    host = group.get_pool(PoolName.KV)
    assert isinstance(host, hicache_sglang.SGLangHostPool)
    assert (host.layer_num, host.target_layer_num) == (LAYERS + DRAFTS, LAYERS)
    assert group.layout == layout and group.size == host.size and group.size_per_token == host.size_per_token
    assert group.can_use_write_back_jit  # AND over the group's pools: hicache's never needs indices moved

    pools = [dev, *drafts]
    fill_random([t for p in pools for t in device_layers(p)], seed=11)
    device_indices = allocator.alloc(3 * page_size)
    written = [device_rows(dev, kind, layer, device_indices) for layer in range(LAYERS)]
    written += [device_rows(d, kind, 0, device_indices) for d in drafts]

    host_indices = controller.write(device_indices, node_id=7)
    controller.ack_write_queue.pop().finish_event.synchronize()
    for host_layer, expect in enumerate(written):  # drafts sit after the target layers on the host
        assert all(torch.equal(h, d) for h, d in zip(host_rows(host, kind, host_layer, host_indices), expect))

    load_indices = controller.load(host_indices, node_id=8)
    fill_random([t for p in pools for t in device_layers(p)], seed=12)
    controller.start_loading()
    controller.ack_load_queue.pop().finish_event.synchronize()
    got = [device_rows(dev, kind, layer, load_indices) for layer in range(LAYERS)]
    got += [device_rows(d, kind, 0, load_indices) for d in drafts]
    for layer, (a, b) in enumerate(zip(got, written)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"host layer {layer}"

    assert group.available_size() == host.size - len(host_indices)
    assert controller.evict_host(host_indices) == len(host_indices)
    assert group.available_size() == host.size
