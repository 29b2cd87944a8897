"""The DSA stack (DeepSeek-V3.2, GLM-5) inside SGLang: the MLA anchor and the indexer are both hicache's.

SGLang's ``_DsaStrategy`` builds the host pool group from the device pool's own declarations
(``host_pool_decls()``), SGLang's ``HybridCacheController`` writes and loads it, the index
keys travelling as the sidecar ``PoolTransfer`` SGLang's radix tree sends. Device pools are
SGLang's ``DSATokenToKVPool`` and its context-parallel ``LayerSplitDSATokenToKVPool``.
"""

from __future__ import annotations

import pytest
import torch
from family_setup import (
    DSA_LAYERS,
    dsa_pool,
    dsa_stack,
    fill_dsa,
    host_index_rows,
    index_rows,
    owned_layers,
)
from sglang_setup import device_rows, host_rows, publish_settings, synchronize

PAIRS = [("layer_first", "kernel"), ("page_first", "kernel"), ("layer_first", "direct"),
         ("page_first_direct", "direct"), ("page_first_kv_split", "kernel")]  # fmt: skip
#: The indexer's page rows have one part: page_first_kv_split stores them as page_first.
INDEXER_LAYOUT = {"page_first_kv_split": "page_first"}
PAIR_IDS = [f"{layout}-{io}" for layout, io in PAIRS]


def sidecar(name: str = "indexer"):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    return [PoolTransfer(name=PoolName(name), indices_from_pool=PoolName.KV)]


def round_trip(pool, group, controller, allocator, *, pages: int = 2, drafts: tuple = ()):
    """Write ``pages`` pages through SGLang's controller, check the host bytes, scramble the device, load back."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    kv_host, index_host = group.get_pool(PoolName.KV), group.get_pool(PoolName.INDEXER)
    fill_dsa([pool, *drafts], seed=21)
    device_indices = allocator.alloc(pages * pool.page_size)
    layers = owned_layers(pool)
    live = [layer for layer in layers if not pool.skip_topk_layers[layer]]
    kv_written = {layer: device_rows(pool, "mla", layer, device_indices)[0] for layer in layers}
    index_written = {layer: index_rows(pool, layer, device_indices) for layer in live}
    index_written.update({("draft", d): index_rows(dp, 0, device_indices) for d, dp in enumerate(drafts)})

    host_indices = controller.write(device_indices, node_id=3, extra_pools=sidecar())
    controller.ack_write_queue.pop().finish_event.synchronize()
    synchronize()
    for host_layer, layer in enumerate(layers):  # the host keeps only the owned layers, compacted
        assert torch.equal(host_rows(kv_host, "mla", host_layer, host_indices)[0], kv_written[layer]), layer
    for host_layer, layer in enumerate(live):
        assert torch.equal(host_index_rows(index_host, host_layer, host_indices), index_written[layer]), layer
    for d in range(len(drafts)):
        got = host_index_rows(index_host, len(live) + d, host_indices)
        assert torch.equal(got, index_written[("draft", d)]), f"draft {d}"

    fill_dsa([pool, *drafts], seed=22)
    others = {layer: pool.kv_buffer[layer].clone() for layer in range(pool.layer_num) if layer not in layers}
    load_indices = controller.load(host_indices, node_id=4, extra_pools=sidecar())
    controller.start_loading()
    controller.ack_load_queue.pop().finish_event.synchronize()
    synchronize()
    for layer in layers:
        assert torch.equal(device_rows(pool, "mla", layer, load_indices)[0], kv_written[layer]), layer
    for layer in live:
        assert torch.equal(index_rows(pool, layer, load_indices), index_written[layer]), layer
    for layer, before in others.items():  # another rank's layers: nothing is written there
        assert torch.equal(pool.kv_buffer[layer], before)
    return kv_host, index_host, host_indices


@pytest.mark.parametrize("layout, io_backend", PAIRS, ids=PAIR_IDS)
def test_dsa_stack(layout, io_backend):
    import hicache_sglang
    from hicache_sglang.builders.dsa import SGLangDSAIndexerHostPool
    from sglang.srt.mem_cache.pool_host.base import HostKVCache

    publish_settings(layout=layout, io_backend=io_backend, page_size=64)
    pool = dsa_pool()
    group, controller, allocator = dsa_stack(pool)
    kv_host, index_host, _ = round_trip(pool, group, controller, allocator)
    assert isinstance(kv_host, hicache_sglang.SGLangMLAHostPool)
    assert isinstance(index_host, SGLangDSAIndexerHostPool) and isinstance(index_host, HostKVCache)
    assert index_host.layer_num == DSA_LAYERS and index_host.layout == INDEXER_LAYOUT.get(layout, layout)
    assert group.can_use_write_back_jit


def test_dsa_shared_topk_layers_keep_no_host_layer():
    """Layers that share another's top-k own a 0-row index buffer: SGLang gives them no host layer; so does hicache."""
    publish_settings(layout="page_first", io_backend="kernel", page_size=64)
    pool = dsa_pool(skip_topk=[False, True, False, True])
    group, controller, allocator = dsa_stack(pool)
    _, index_host, _ = round_trip(pool, group, controller, allocator)
    assert index_host.layer_num == 2 and index_host.index_k_with_scale_buffer.shape[1] == 2


SPLIT_PAIRS = [("layer_first", "kernel"), ("page_first", "kernel"), ("layer_first", "direct"),
               ("page_first_kv_split", "kernel")]  # fmt: skip


@pytest.mark.parametrize("layout, io_backend", SPLIT_PAIRS, ids=[f"{layout}-{io}" for layout, io in SPLIT_PAIRS])
@pytest.mark.parametrize("shard_rank", [0, 1])
def test_layer_split_stack(layout, io_backend, shard_rank):
    """Context-parallel LayerSplit (--enable-dsa-cache-layer-split): each rank's host keeps its own layers only.

    ``page_first_kv_split`` is seed 001's layout: the MLA anchor splits its rows, and the indexer (one part,
    nothing to split) is stored as ``page_first``, read back through SGLang's page_first indexer shape.
    """
    publish_settings(layout=layout, io_backend=io_backend, page_size=64)
    pool = dsa_pool(shard_rank=shard_rank)
    group, controller, allocator = dsa_stack(pool)
    kv_host, index_host, _ = round_trip(pool, group, controller, allocator)
    owned = owned_layers(pool)
    assert len(owned) == DSA_LAYERS // 2 and kv_host.layer_num == index_host.layer_num == len(owned)
    assert kv_host.layer_shard_enabled and index_host.layer_shard_enabled
    assert kv_host.implementations["backup_from_device_per_layer"]
    assert (kv_host.layout, index_host.layout) == (layout, INDEXER_LAYOUT.get(layout, layout))


@pytest.mark.parametrize("layout", ["page_first", "page_first_kv_split"])
def test_members_match_sglangs_indexer_pool(layout):
    """Shapes, sizes, flat pages and page pointers agree with SGLang's own DSAIndexerPoolHost over the same anchor.

    Under ``page_first_kv_split`` SGLang's indexer raises "Unsupported layout" mid-construction; hicache stores
    it as ``page_first``, so SGLang's page_first indexer pool is the one it must equal.
    """
    from hicache_sglang import builders
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    theirs_cls = next(original for module, attr, original in builders._patched if attr == "DSAIndexerPoolHost")
    publish_settings(layout=layout, io_backend="kernel", page_size=64)
    pool = dsa_pool()
    group, _, _ = dsa_stack(pool)
    ours, anchor = group.get_pool(PoolName.INDEXER), group.get_pool(PoolName.KV)
    their_anchor = MLATokenToKVPoolHost(pool.get_device_pool_infos()[0].buffer_info, 2.0, 0, 64, "page_first",
                                        pin_memory=False, device_capacity_tokens=pool.size, start_layer=0,
                                        end_layer=pool.end_layer, target_layer_num=pool.layer_num,
                                        override_kv_cache_dim=pool.kv_cache_dim)  # fmt: skip
    decl = next(d for d in pool.host_pool_decls() if d.pool_name == PoolName.INDEXER)
    theirs = theirs_cls(decl=decl, anchor_host=their_anchor, pin_memory=False)
    assert (anchor.size, anchor.page_num) == (their_anchor.size, their_anchor.page_num)
    for name in ["layout", "page_size", "page_num", "size", "layer_num", "target_layer_num", "start_layer",
                 "end_layer", "indexer_dtype", "indexer_page_stride_size", "indexer_layout_dim", "indexer_page_num",
                 "size_per_token"]:  # fmt: skip
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.index_k_with_scale_buffer.shape == theirs.index_k_with_scale_buffer.shape
    assert ours.get_size_per_token() == theirs.get_size_per_token()
    assert ours.get_ksize_per_token() == theirs.get_ksize_per_token()
    raw = ours.index_k_with_scale_buffer
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(5)))
    theirs.index_k_with_scale_buffer.copy_(raw)
    for page in (0, 3, ours.page_num - 1):
        assert torch.equal(ours.get_data_page(page * 64).flatten(), theirs.get_data_page(page * 64)), page
    assert ours.get_dummy_flat_data_page().shape == theirs.get_dummy_flat_data_page().shape
    page = theirs.get_data_page(2 * 64).clone()
    ours.set_from_flat_data_page(5 * 64, page)
    theirs.set_from_flat_data_page(5 * 64, page)
    assert torch.equal(ours.index_k_with_scale_buffer, theirs.index_k_with_scale_buffer)
    slots = torch.cat([torch.arange(64) + 64 * p for p in (1, 4)])
    ptrs, sizes = ours.get_page_buffer_meta(slots)
    their_ptrs, their_sizes = theirs.get_page_buffer_meta(slots)
    assert [p - raw.data_ptr() for p in ptrs] == [p - theirs.index_k_with_scale_buffer.data_ptr() for p in their_ptrs]
    assert list(sizes) == list(their_sizes)
    assert [t.data_ptr() for t in ours.get_hybrid_pool_buffer()] == [raw.data_ptr()]
