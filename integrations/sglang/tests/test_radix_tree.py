"""SGLang's radix tree (UnifiedRadixCache.init_hicache) on hicache pools, through SGLang's shipped test kit.

Insert a sequence, back it up to host (the kit's ``_backup_node``: SGLang's backup walk,
write and ack), evict it from the device (``UnifiedRadixCache.evict``), load it back
(``_load_back_node``: ``load_back``, ``ready_to_load_host_cache``, ``loading_check``), and
compare bytes at every step.
"""

from __future__ import annotations

import pytest
import torch
from radix_kit import kit_pointed_at, make_case
from sglang_setup import (
    KIND_PAIR_IDS,
    KIND_PAIRS,
    LAYERS,
    PP_START,
    device_layers,
    device_rows,
    fill_random,
    host_rows,
)

CASES, CASE_IDS = KIND_PAIRS, KIND_PAIR_IDS


@pytest.mark.parametrize("start_layer", [0, PP_START], ids=["rank0", "pp-start20"])
@pytest.mark.parametrize("page_size", [1, 16], ids=["page1", "page16"])
@pytest.mark.parametrize("kind, layout, io_backend", CASES, ids=CASE_IDS)
def test_insert_backup_evict_load_back(kind, layout, io_backend, page_size, start_layer):
    import hicache_sglang
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.test.kits.unified_radix_cache.fixtures import build_fixture, match_prefix, node_host_value

    case = make_case(page_size)
    try:
        with kit_pointed_at(kind, layout, io_backend, start_layer):
            cache, allocator, req_to_token_pool = build_fixture(case.cfg)
            case._init_hicache(cache)
        host = cache.cache_controller.mem_pool_host.anchor_entry.host_pool
        assert isinstance(host, hicache_sglang.SGLangHostPool)
        assert (host.layout, host.io_backend, host.start_layer) == (layout, io_backend, start_layer)
        dev = allocator.get_kvcache()

        seq = case._make_seq(1, max(3, 24 // page_size))
        case._insert(cache, allocator, req_to_token_pool, seq)
        node = match_prefix(cache, seq).last_device_node
        slots = cache.path_device_indices(node)
        assert len(slots) == len(seq)
        fill_random(device_layers(dev), seed=21)
        written = [device_rows(dev, kind, layer, slots) for layer in range(LAYERS)]

        case._backup_node(cache, node)  # asserts the node is backed up after SGLang's ack
        host_slots = torch.cat([node_host_value(cache, n, ComponentType.FULL) for n in case._path_chain(cache, node)])
        for layer in range(LAYERS):
            assert all(torch.equal(h, d) for h, d in zip(host_rows(host, kind, layer, host_slots), written[layer]))

        evicted = cache.evict(EvictParams(num_tokens=len(seq)))
        assert evicted.num_tokens_evicted == len(seq)
        match = match_prefix(cache, seq)
        assert (match.device_prefix_len, match.host_hit_length) == (0, len(seq))
        fill_random(device_layers(dev), seed=22)  # freed rows get reused: the load must bring the bytes back

        loaded = case._load_back_node(cache, match.last_host_node)
        assert len(loaded) == len(seq)
        for layer in range(LAYERS):
            assert all(torch.equal(a, b) for a, b in zip(device_rows(dev, kind, layer, loaded), written[layer]))
        assert match_prefix(cache, seq).device_prefix_len == len(seq)
    finally:
        case.doCleanups()
