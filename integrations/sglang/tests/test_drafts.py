"""Non-packed MTP drafts inside SGLang: ``build_full_draft_pools`` builds the draft's host pool with hicache.

The target is SGLang's KV-only stack (``build_kv_only_stack``); the draft model keeps its own
device pool (SGLang's ``MHATokenToKVPool`` / ``MLATokenToKVPool``); SGLang's
``build_full_draft_pools`` makes the DRAFT sidecar entry, whose indices follow the target's KV,
and SGLang's ``HybridCacheController`` moves it as the sidecar ``PoolTransfer`` its radix tree sends.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from sglang_setup import (
    LAYERS,
    allocator_for,
    device_layers,
    device_pool,
    device_rows,
    fill_random,
    host_rows,
    publish_settings,
    synchronize,
)

DRAFT_LAYERS = 2
#: One pair per kind and io backend (the sizing and layer map are what is new here; test_controller covers the rest).
PAIRS = [("mha", "page_first", "kernel"), ("mha", "page_first_direct", "direct"),
         ("mla", "page_first_kv_split", "kernel"), ("mla", "layer_first", "direct")]  # fmt: skip


@pytest.mark.parametrize("kind, layout, io_backend", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_full_draft_pool(kind, layout, io_backend):
    import hicache_sglang
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_full_draft_pools, build_kv_only_stack

    page = 16
    publish_settings(layout=layout, io_backend=io_backend, page_size=page)
    target = device_pool(kind, page)
    draft = device_pool(kind, page, layers=DRAFT_LAYERS)
    allocator = allocator_for(target)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator,
                             page_size=page)  # fmt: skip
    group, controller = build_kv_only_stack(params=params, kv_pool=target,
                                            full_layer_mapping={i: i for i in range(LAYERS)},
                                            load_cache_event=threading.Event(), storage_backend=None,
                                            use_mla=kind == "mla")  # fmt: skip
    tree = SimpleNamespace(cache_controller=controller)  # what build_full_draft_pools reads of the radix tree
    specs, entries = build_full_draft_pools(draft_kv_pool=draft, tree_cache=tree)
    for entry in entries:
        group.add_entry(entry)
    host = group.get_pool(PoolName.DRAFT)
    assert isinstance(host, hicache_sglang.SGLangHostPool) and host.pool_label == "draft"
    assert (host.layer_num, host.size, host.layout) == (DRAFT_LAYERS, group.logical_size, layout)  # the anchor's slots
    assert [s.indices_from_pool for s in specs] == [PoolName.KV]

    fill_random(device_layers(target) + device_layers(draft), seed=61)
    device_indices = allocator.alloc(2 * page)
    written = [device_rows(draft, kind, layer, device_indices) for layer in range(DRAFT_LAYERS)]
    sidecar = [PoolTransfer(name=PoolName.DRAFT, indices_from_pool=PoolName.KV)]
    host_indices = controller.write(device_indices, node_id=1, extra_pools=sidecar)
    controller.ack_write_queue.pop().finish_event.synchronize()
    synchronize()
    for layer in range(DRAFT_LAYERS):
        assert all(torch.equal(h, d) for h, d in zip(host_rows(host, kind, layer, host_indices), written[layer]))
    load_indices = controller.load(host_indices, node_id=2,
                                   extra_pools=[PoolTransfer(name=PoolName.DRAFT, indices_from_pool=PoolName.KV)])
    fill_random(device_layers(draft), seed=62)
    controller.start_loading()
    controller.ack_load_queue.pop().finish_event.synchronize()
    synchronize()
    for layer in range(DRAFT_LAYERS):
        assert all(torch.equal(a, b) for a, b in zip(device_rows(draft, kind, layer, load_indices), written[layer]))
