"""DeepSeek-V4 inside SGLang: every host pool of ``build_deepseek_v4_hicache_stack`` is hicache's.

SGLang's own ``DeepSeekV4TokenToKVPool`` (SWA, C4 and C128 KV, C4 indexer, compress states)
and ``SWATokenToKVPoolAllocator`` on ``DEVICE``; SGLang's assembler entry point builds the
group and its ``HybridCacheController``; the controller writes and loads every sub-pool, the
sidecars travelling as the ``PoolTransfer`` objects SGLang's radix tree sends (C4/C128 on the
FULL indices, the states on the SWA ones). The host bytes are read through SGLang's host
shapes (``memory_pool_host.py``): ``layer_first`` a list of ``(pages, row)``, ``page_first``
``(pages, L, row)``, ``page_first_direct`` ``(pages, L, 1, row)``.
"""

from __future__ import annotations

import threading

import pytest
import torch
from sglang_setup import DEVICE, fill_random, publish_settings, synchronize

PAGE, SWA_PAGE = 256, 128
PAIRS = [("layer_first", "kernel"), ("page_first", "kernel"), ("layer_first", "direct"),
         ("page_first_direct", "direct")]  # fmt: skip


def v4_pool():
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    return DeepSeekV4TokenToKVPool(
        max_num_reqs=4, swa_size=1024, c4_size=1024, c128_size=256,
        # SGLang's sizing: one ring (4 slots for C4) per SWA page, the padding page included
        c4_state_pool_size=(1024 // SWA_PAGE + 1) * 4, c128_state_pool_size=0,
        page_size=PAGE, swa_page_size=SWA_PAGE, dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32,
        c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128,
        layer_num=3, device=DEVICE, enable_memory_saver=False, compression_ratios=[4, 128, 4], sliding_window=128,
        start_layer=0, end_layer=3,
    )  # fmt: skip


def v4_stack(pool):
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler

    allocator = SWATokenToKVPoolAllocator(size=1024, size_swa=1024, page_size=PAGE, dtype=torch.uint8, device=DEVICE,
                                          kvcache=pool, need_sort=False)  # fmt: skip
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator,
                             page_size=PAGE)  # fmt: skip
    group, controller = hybrid_pool_assembler.build_deepseek_v4_hicache_stack(
        params=params, kvcache=pool, load_cache_event=threading.Event(), storage_backend=None
    )
    return group, controller, allocator


def device_tensors(host) -> list[torch.Tensor]:
    return list(getattr(host, "device_page_views", None) or host.device_buffers)


def page_rows(host, layer: int, pages: torch.Tensor) -> torch.Tensor:
    buf, pages = host.kv_buffer, pages.cpu()
    if host.layout == "layer_first":
        out = buf[layer][pages]
    elif host.layout == "page_first":
        out = buf[pages, layer]
    else:
        out = buf[pages, layer, 0]
    return out.contiguous().view(torch.uint8)


def transfers(group, swa_device=None, swa_host=None):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    out = []
    for entry in group.entries:
        if entry.name == PoolName.KV:
            continue
        if entry.name == PoolName.SWA:
            out.append(PoolTransfer(name=PoolName.SWA, device_indices=swa_device, host_indices=swa_host))
        else:
            source = PoolName.SWA if "state" in entry.name.value else PoolName.KV
            out.append(PoolTransfer(name=entry.name, indices_from_pool=source))
    return out


def pages_of(slots: torch.Tensor, page: int) -> torch.Tensor:
    return slots.reshape(-1, page)[:, 0] // page


@pytest.mark.parametrize("layout, io_backend", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_v4_stack(layout, io_backend):
    from hicache_sglang.builders.dsv4 import (
        SGLangDeepSeekV4PagedHostPool,
        SGLangDeepSeekV4StateHostPool,
        SGLangLogicalHostPool,
    )
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool, DeepSeekV4StateHostPool

    publish_settings(layout=layout, io_backend=io_backend, page_size=PAGE)
    pool = v4_pool()
    group, controller, allocator = v4_stack(pool)
    hosts = {e.name: e.host_pool for e in group.entries}
    assert isinstance(hosts[PoolName.KV], SGLangLogicalHostPool)
    sidecars = {n: h for n, h in hosts.items() if n != PoolName.KV}
    assert {type(h) for h in sidecars.values()} == {SGLangDeepSeekV4PagedHostPool, SGLangDeepSeekV4StateHostPool}
    assert all(isinstance(h, (DeepSeekV4PagedHostPool, DeepSeekV4StateHostPool)) for h in sidecars.values())
    assert {PoolName.SWA, PoolName.DEEPSEEK_V4_C4, PoolName.DEEPSEEK_V4_C128,
            PoolName.DEEPSEEK_V4_C4_STATE} <= set(hosts)  # fmt: skip

    fill_random([t for h in sidecars.values() for t in device_tensors(h)], seed=31)
    kv_device = allocator.full_attn_allocator.alloc(2 * PAGE)
    swa_device = allocator.swa_attn_allocator.alloc(2 * SWA_PAGE)

    def device_pages(name, host):
        slots = swa_device if host.page_size == SWA_PAGE and name != PoolName.DEEPSEEK_V4_C128 else kv_device
        return pages_of(slots, host.page_size)

    written = {name: [t[device_pages(name, h).to(t.device)].cpu().clone() for t in device_tensors(h)]
               for name, h in sidecars.items()}  # fmt: skip
    extra = transfers(group, swa_device=swa_device)
    kv_host = controller.write(kv_device, node_id=1, extra_pools=extra)
    controller.ack_write_queue.pop().finish_event.synchronize()
    synchronize()
    swa_host = next(t.host_indices for t in extra if t.name == PoolName.SWA)
    for name, host in sidecars.items():
        slots = swa_host if host.page_size == SWA_PAGE and name != PoolName.DEEPSEEK_V4_C128 else kv_host
        for layer, want in enumerate(written[name]):
            got = page_rows(host, layer, pages_of(slots, host.page_size))
            assert torch.equal(got, want.view(torch.uint8).reshape(got.shape)), (name, layer)

    fill_random([t for h in sidecars.values() for t in device_tensors(h)], seed=32)
    controller.load(kv_host, node_id=2, extra_pools=transfers(group, swa_device=swa_device, swa_host=swa_host),
                    device_indices=kv_device)  # fmt: skip
    controller.start_loading()
    controller.ack_load_queue.pop().finish_event.synchronize()
    synchronize()
    for name, host in sidecars.items():
        for layer, (t, want) in enumerate(zip(device_tensors(host), written[name])):
            assert torch.equal(t[device_pages(name, host).to(t.device)].cpu(), want), (name, layer)


def test_v4_state_indices_must_be_swa_page_aligned():
    from sglang.srt.mem_cache.hicache_storage import PoolName

    publish_settings(layout="page_first", io_backend="kernel", page_size=PAGE)
    group, _, _ = v4_stack(v4_pool())
    state = group.get_pool(PoolName.DEEPSEEK_V4_C4_STATE)
    idx = torch.arange(SWA_PAGE + 3)
    with pytest.raises(ValueError, match=rf"transfer indices must be SWA-page-aligned, got numel={SWA_PAGE + 3}, "
                                         rf"swa_page_size={SWA_PAGE}"):  # fmt: skip
        state.backup_from_device_all_layer(None, idx, idx, "kernel")
    with pytest.raises(NotImplementedError, match="reuses SWA transfer indices and has no allocator"):
        state.alloc(SWA_PAGE)


def located(ptrs: list[int], buffers: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Each pointer as (buffer number, offset in it): SGLang's layer_first buffers are separate allocations."""
    out = []
    for p in ptrs:
        i = next(i for i, b in enumerate(buffers) if b.data_ptr() <= p < b.data_ptr() + b.nbytes)
        out.append((i, p - buffers[i].data_ptr()))
    return out


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_members_match_sglangs_v4_pools(layout):
    """Shapes, sizes, flat pages and page pointers agree with SGLang's own V4 paged and state pools."""
    from sglang.srt.mem_cache import memory_pool_host  # SGLang's module: its classes are not replaced there
    from sglang.srt.mem_cache.hicache_storage import PoolName

    publish_settings(layout=layout, io_backend="kernel" if layout != "page_first_direct" else "direct",
                     page_size=PAGE)  # fmt: skip
    pool = v4_pool()
    group, _, _ = v4_stack(pool)
    c4, state = group.get_pool(PoolName.DEEPSEEK_V4_C4), group.get_pool(PoolName.DEEPSEEK_V4_C4_STATE)
    theirs_c4 = memory_pool_host.DeepSeekV4PagedHostPool(
        pool_name=c4.pool_name, device_buffers=c4.device_buffers, item_bytes=c4.item_bytes,
        num_host_pages=c4.num_host_pages, slot_page_size=c4.slot_page_size, layout=layout,
        pin_memory=False)  # fmt: skip
    theirs_state = memory_pool_host.DeepSeekV4StateHostPool(
        pool_name=state.pool_name, state_pools=state.state_pools, num_host_pages=state.num_host_pages,
        swa_page_size=state.swa_page_size, layout=layout, pin_memory=False)  # fmt: skip
    gen = torch.Generator().manual_seed(33)
    for ours, theirs in ((c4, theirs_c4), (state, theirs_state)):
        for name in ["layout", "page_size", "size", "layer_num", "start_layer", "end_layer", "dtype", "size_per_token",
                     "num_host_pages"]:  # fmt: skip
            assert getattr(ours, name) == getattr(theirs, name), name
        assert ours.get_size_per_token() == theirs.get_size_per_token()
        mine, sglangs = ours.get_hybrid_pool_buffer(), theirs.get_hybrid_pool_buffer()
        assert [t.shape for t in mine] == [t.shape for t in sglangs]
        for a, b in zip(mine, sglangs):
            a.copy_(torch.randint(0, 256, a.shape, dtype=torch.uint8, generator=gen))
            b.copy_(a)
        for page in (0, 3, ours.num_host_pages - 1):
            slot = page * ours.page_size
            assert torch.equal(ours.get_data_page(slot), theirs.get_data_page(slot)), page
        assert ours.get_dummy_flat_data_page().shape == theirs.get_dummy_flat_data_page().shape
        slots = torch.cat([torch.arange(ours.page_size) + ours.page_size * p for p in (1, 4)])
        (ptrs, sizes), (their_ptrs, their_sizes) = ours.get_page_buffer_meta(slots), theirs.get_page_buffer_meta(slots)
        assert located(ptrs, mine) == located(their_ptrs, sglangs)
        assert list(sizes) == list(their_sizes)
        page = theirs.get_data_page(2 * ours.page_size).clone()
        ours.set_from_flat_data_page(5 * ours.page_size, page)
        theirs.set_from_flat_data_page(5 * ours.page_size, page)
        assert all(torch.equal(a, b) for a, b in zip(mine, sglangs))
