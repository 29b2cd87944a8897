"""MiniMax-M3's sparse stack inside SGLang: the KV anchor and the index-K sidecar are both hicache's.

SGLang's own ``MiniMaxM3Nvfp4KVPool`` (NVFP4: main K/V rows ``[K, K scale, V, V scale]`` and
index rows ``[index K, index K scale]``, one row per (layer, page)) and ``MiniMaxSparseKVPool``
(plain MHA main K/V and a K-only index) on ``DEVICE``; SGLang's
``build_minimax_sparse_hicache_stack`` builds the group and its ``HybridCacheController``, which
writes and loads both pools, the index travelling as the sidecar ``PoolTransfer`` SGLang's radix
tree sends. Host bytes are read through SGLang's host shapes (``pool_host/minimax_m3_nvfp4.py``,
``MHATokenToKOnlyPoolHost``), and the members are compared with SGLang's own classes over the
same device pools.
"""

from __future__ import annotations

import threading

import pytest
import torch
from sglang_setup import DEVICE, allocator_for, fill_random, publish_settings, synchronize

PAIRS = [("layer_first", "kernel"), ("page_first", "kernel"), ("page_first_direct", "kernel"),
         ("layer_first", "direct"), ("page_first_direct", "direct")]  # fmt: skip
PAIR_IDS = [f"{layout}-{io}" for layout, io in PAIRS]
NVFP4_PAGE = 128  # MSA-v1: the NVFP4 pools take no other page size
LAYERS = [0, 1, 2]


def sparse_pool(nvfp4: bool, page_size: int):
    from sglang.srt.mem_cache.memory_pool import MiniMaxSparseKVPool
    from sglang.srt.mem_cache.minimax_m3_nvfp4_pool import MiniMaxM3Nvfp4KVPool

    cls = MiniMaxM3Nvfp4KVPool if nvfp4 else MiniMaxSparseKVPool
    return cls(size=4 * page_size, page_size=page_size, dtype=torch.bfloat16, head_num=2,
               head_dim=128 if nvfp4 else 16, idx_head_dim=128 if nvfp4 else 32, dense_layer_ids=[],
               sparse_layer_ids=LAYERS, disable_value_sparse_layer_ids=LAYERS, device=DEVICE,
               enable_memory_saver=False, start_layer=0, end_layer=len(LAYERS))  # fmt: skip


def stack(pool):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler

    allocator = allocator_for(pool.main_pool)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator,
                             page_size=pool.page_size)  # fmt: skip
    group, controller = hybrid_pool_assembler.build_minimax_sparse_hicache_stack(
        params=params, sparse_pool=pool, load_cache_event=threading.Event(), storage_backend=None
    )
    return group, controller, allocator


def device_tensors(pool) -> list[torch.Tensor]:
    """What each sub-pool's device holds: the NVFP4 slabs, or the K/V and index-K layers."""
    if hasattr(pool.main_pool, "slab"):
        return [pool.main_pool.slab, pool.index_k_pool.slab]
    return [*pool.main_pool.k_buffer, *pool.main_pool.v_buffer, *pool.index_k_pool.k_buffer]


def pages_of(slots: torch.Tensor, page: int) -> torch.Tensor:
    return slots.reshape(-1, page)[:, 0] // page


def nvfp4_host_rows(host, layer: int, pages: torch.Tensor) -> torch.Tensor:
    """SGLang's ``_host_layer_pages(layer)[pages]``: ``kv_buffer[layer]`` or ``kv_buffer[:, layer, 0]``."""
    buf, pages = host.kv_buffer, pages.cpu()
    rows = buf[layer] if host.layout == "layer_first" else buf[:, layer, 0]
    return rows[pages]


def k_only_host_rows(host, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """``MHATokenToKOnlyPoolHost.k_buffer``: (L, S, H, D), (S, L, H, D) or (P, L, p, H, D)."""
    buf, slots, p = host.k_buffer, slots.cpu(), host.page_size
    if host.layout == "layer_first":
        return buf[layer, slots]
    if host.layout == "page_first":
        return buf[slots, layer]
    return buf[slots // p, layer, slots % p]


def sidecar():
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    return [PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV)]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("layout, io_backend", PAIRS, ids=PAIR_IDS)
def test_nvfp4_stack(layout, io_backend):
    """Main rows (payload and scales) and index rows back up and load byte-exact through SGLang's controller."""
    from hicache_sglang.builders.minimax import SGLangMiniMaxM3Nvfp4IndexKPoolHost, SGLangMiniMaxM3Nvfp4MainKVPoolHost
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.minimax_m3_nvfp4_pool import _main_page_components, _page_row_layout
    from sglang.srt.mem_cache.pool_host.minimax_m3_nvfp4 import (  # SGLang's classes, for isinstance
        MiniMaxM3Nvfp4IndexKPoolHost,
        MiniMaxM3Nvfp4MainKVPoolHost,
    )

    publish_settings(layout=layout, io_backend=io_backend, page_size=NVFP4_PAGE)
    pool = sparse_pool(True, NVFP4_PAGE)
    group, controller, allocator = stack(pool)
    main, index = group.get_pool(PoolName.KV), group.get_pool(PoolName.INDEXER)
    assert type(main) is SGLangMiniMaxM3Nvfp4MainKVPoolHost and type(index) is SGLangMiniMaxM3Nvfp4IndexKPoolHost
    assert isinstance(main, MiniMaxM3Nvfp4MainKVPoolHost) and isinstance(index, MiniMaxM3Nvfp4IndexKPoolHost)
    assert main.layer_num == index.layer_num == len(LAYERS) and index.size == main.size

    slabs = device_tensors(pool)
    fill_random(slabs, seed=41)
    device_slots = allocator.alloc(2 * NVFP4_PAGE)
    dpages = pages_of(device_slots, NVFP4_PAGE).to(slabs[0].device)
    written = [slab[:, dpages].cpu().clone() for slab in slabs]  # (layers, pages, row)

    host_slots = controller.write(device_slots, node_id=1, extra_pools=sidecar())
    controller.ack_write_queue.pop().finish_event.synchronize()
    synchronize()
    hpages = pages_of(host_slots, NVFP4_PAGE)
    offsets, row_bytes = _page_row_layout(_main_page_components(2, 128, NVFP4_PAGE))
    for host, want in ((main, written[0]), (index, written[1])):
        for layer in range(len(LAYERS)):
            got = nvfp4_host_rows(host, layer, hpages)
            assert torch.equal(got, want[layer]), (host.pool_label, layer)
    # the main row's V scales (its last component) are on the host at SGLang's offset, with their payload
    assert row_bytes == main.row_bytes
    v_scale = slice(offsets[3], row_bytes)
    assert torch.equal(nvfp4_host_rows(main, 1, hpages)[:, v_scale], written[0][1][:, v_scale])

    fill_random(slabs, seed=42)
    load_slots = controller.load(host_slots, node_id=2, extra_pools=sidecar())
    controller.start_loading()
    controller.ack_load_queue.pop().finish_event.synchronize()
    synchronize()
    lpages = pages_of(load_slots, NVFP4_PAGE).to(slabs[0].device)
    for slab, want in zip(slabs, written):
        assert torch.equal(slab[:, lpages].cpu(), want)


@pytest.mark.parametrize("layout, io_backend", PAIRS, ids=PAIR_IDS)
def test_k_only_stack(layout, io_backend):
    """Without NVFP4: the MHA anchor (build_kv_host_pool) and the K-only index, byte-exact through the controller."""
    import hicache_sglang
    from hicache_sglang.builders.minimax import SGLangKOnlyHostPool
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKOnlyPoolHost

    publish_settings(layout=layout, io_backend=io_backend, page_size=4)
    pool = sparse_pool(False, 4)
    group, controller, allocator = stack(pool)
    main, index = group.get_pool(PoolName.KV), group.get_pool(PoolName.INDEXER)
    assert isinstance(main, hicache_sglang.SGLangMHAHostPool)
    assert type(index) is SGLangKOnlyHostPool and isinstance(index, MHATokenToKOnlyPoolHost)

    tensors = device_tensors(pool)
    fill_random(tensors, seed=43)
    device_slots = allocator.alloc(8)
    idx_k = list(pool.index_k_pool.k_buffer)
    written = [t[device_slots.to(t.device)].cpu().clone() for t in idx_k]
    host_slots = controller.write(device_slots, node_id=1, extra_pools=sidecar())
    controller.ack_write_queue.pop().finish_event.synchronize()
    synchronize()
    for layer, want in enumerate(written):
        assert torch.equal(as_bytes(k_only_host_rows(index, layer, host_slots)), as_bytes(want)), layer

    fill_random(tensors, seed=44)
    load_slots = controller.load(host_slots, node_id=2, extra_pools=sidecar())
    controller.start_loading()
    controller.ack_load_queue.pop().finish_event.synchronize()
    synchronize()
    for t, want in zip(idx_k, written):
        assert torch.equal(as_bytes(t[load_slots.to(t.device)].cpu()), as_bytes(want))


def located(ptrs: list[int], buffer: torch.Tensor) -> list[int]:
    base = buffer.data_ptr()
    assert all(base <= p < base + buffer.nbytes for p in ptrs)
    return [p - base for p in ptrs]


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_members_match_sglangs_pools(layout):
    """Shapes, sizes, flat pages and storage objects agree with SGLang's own MiniMax host pools."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.pool_host import mha as sglang_mha  # SGLang's module: not replaced there
    from sglang.srt.mem_cache.pool_host import minimax_m3_nvfp4 as theirs_module
    from sglang.srt.runtime_context import get_memory

    io = "direct" if layout == "page_first_direct" else "kernel"
    pairs = []
    publish_settings(layout=layout, io_backend=io, page_size=NVFP4_PAGE)
    pool = sparse_pool(True, NVFP4_PAGE)
    group, _, _ = stack(pool)
    main, index = group.get_pool(PoolName.KV), group.get_pool(PoolName.INDEXER)
    originals = {attr: orig for module, attr, orig in __import__("hicache_sglang").builders._patched
                 if module is theirs_module}  # fmt: skip
    theirs_main = originals["MiniMaxM3Nvfp4MainKVPoolHost"](
        pool.main_pool.get_device_pool_infos()[0].buffer_info, get_memory().hicache_ratio, 0, NVFP4_PAGE, layout,
        pin_memory=False,
        device_capacity_tokens=pool.main_pool.size, start_layer=pool.main_pool.start_layer,
        end_layer=pool.main_pool.end_layer)  # fmt: skip
    theirs_index = originals["MiniMaxM3Nvfp4IndexKPoolHost"](
        pool.index_k_pool.get_device_pool_infos()[0].buffer_info, main, layout, pin_memory=False,
        start_layer=pool.index_k_pool.start_layer, end_layer=pool.index_k_pool.end_layer)  # fmt: skip
    pairs += [(main, theirs_main), (index, theirs_index)]

    publish_settings(layout=layout, io_backend=io, page_size=4)
    plain = sparse_pool(False, 4)
    group, _, _ = stack(plain)
    k_only, anchor = group.get_pool(PoolName.INDEXER), group.get_pool(PoolName.KV)
    theirs_k_only = sglang_mha.MHATokenToKOnlyPoolHost(plain.index_k_pool, anchor, layout, pin_memory=False)
    pairs.append((k_only, theirs_k_only))

    gen = torch.Generator().manual_seed(45)
    for ours, theirs in pairs:
        for name in ["layout", "page_size", "size", "page_num", "layer_num", "start_layer", "end_layer", "dtype",
                     "size_per_token"]:  # fmt: skip
            assert getattr(ours, name) == getattr(theirs, name), (type(theirs).__name__, name)
        assert ours.get_size_per_token() == theirs.get_size_per_token()
        assert ours.get_ksize_per_token() == theirs.get_ksize_per_token()
        mine, sglangs = ours.get_hybrid_pool_buffer(), theirs.get_hybrid_pool_buffer()
        assert [t.shape for t in mine] == [t.shape for t in sglangs] and [t.dtype for t in mine] == [
            t.dtype for t in sglangs]  # fmt: skip
        for a, b in zip(mine, sglangs):
            a.view(torch.uint8).copy_(torch.randint(0, 256, a.view(torch.uint8).shape, dtype=torch.uint8,
                                                    generator=gen))  # fmt: skip
            b.view(torch.uint8).copy_(a.view(torch.uint8))
        for page in (0, 2, ours.page_num - 1):
            slot = page * ours.page_size
            assert torch.equal(as_bytes(ours.get_data_page(slot)), as_bytes(theirs.get_data_page(slot))), page
            flat = ours.get_data_page(slot).clone()
            target = ((page + 1) % ours.page_num) * ours.page_size
            ours.set_from_flat_data_page(target, flat)
            theirs.set_from_flat_data_page(target, flat)
        assert torch.equal(as_bytes(mine[0]), as_bytes(sglangs[0]))
        assert ours.get_dummy_flat_data_page().shape == theirs.get_dummy_flat_data_page().shape
        slots = torch.cat([torch.arange(ours.page_size) + ours.page_size * p for p in (1, 3)])
        if layout == "layer_first":
            with pytest.raises(ValueError, match="Unsupported"):
                ours.get_page_buffer_meta(slots)
            continue
        (ptrs, sizes), (their_ptrs, their_sizes) = ours.get_page_buffer_meta(slots), theirs.get_page_buffer_meta(slots)
        assert located(ptrs, mine[0]) == located(their_ptrs, sglangs[0])
        assert list(sizes) == list(their_sizes)
        if hasattr(ours, "page_bytes"):  # SGLang's test on its own buffer, applied to hicache's
            aligned = mine[0].data_ptr() % 4096 == 0 and ours.page_bytes % 4096 == 0
            assert ours.is_stride_page_aligned() == aligned


def test_nvfp4_refuses_drafts_and_unaligned_indices():
    from sglang.srt.mem_cache.hicache_storage import PoolName

    publish_settings(layout="page_first", io_backend="kernel", page_size=NVFP4_PAGE)
    pool = sparse_pool(True, NVFP4_PAGE)
    group, _, _ = stack(pool)
    main = group.get_pool(PoolName.KV)
    before = main.kv_buffer.clone()
    idx = torch.arange(NVFP4_PAGE)
    with pytest.raises(ValueError, match="supports only the base model"):
        main.load_to_device_per_layer(pool.main_pool, idx, idx, 0, "kernel", is_draft=True)
    with pytest.raises(
        IndexError,
        match=rf"layer_id {len(LAYERS)} is out of range \[0, {len(LAYERS)}\) \(the M3.1 NVFP4 "
        r"pool's host layers\)",
    ):
        main.load_to_device_per_layer(pool.main_pool, idx, idx, len(LAYERS), "kernel")
    with pytest.raises(ValueError):
        main.backup_from_device_all_layer(pool.main_pool, idx[:5] + NVFP4_PAGE, idx[:5] + NVFP4_PAGE, "kernel")
    assert torch.equal(main.kv_buffer, before)
