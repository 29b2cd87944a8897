"""Hybrid Mamba / linear-attention models inside SGLang: KV, Mamba state (and QSA indexer) host pools are hicache's.

SGLang's ``HybridReqToTokenPool`` (its ``MambaPool`` of conv and SSM states per request slot)
and ``HybridLinearKVPool`` on ``DEVICE``; SGLang's ``build_hybrid_mamba_stack`` builds the
group and its ``HybridCacheController``, which writes and loads the Mamba states as the
``PoolTransfer`` SGLang's radix tree sends (the state's own slots). The host bytes are read
through SGLang's ``MambaPoolHost`` shapes: ``(slots, layers, 1, *state)``.
"""

from __future__ import annotations

import threading

import pytest
import torch
from sglang_setup import DEVICE, allocator_for, fill_random, publish_settings, synchronize

PAIRS = [("page_first", "kernel"), ("page_first_direct", "direct"), ("page_first_direct", "kernel")]
MAMBA_LAYERS = [0, 2]
QSA_PAGE = 4


def mamba_stack(qsa: bool = False):
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
    from sglang.srt.mem_cache.qsa_kv_pool import QSATokenToKVPool

    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=64, n_groups=1, num_heads=4, head_dim=16,
                                    state_size=8, conv_kernel=4)  # fmt: skip
    params = Mamba2CacheParams(shape=shape, layers=MAMBA_LAYERS,
                               dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32))  # fmt: skip
    req = HybridReqToTokenPool(size=4, mamba_size=6, mamba_spec_state_size=0, max_context_len=64, device=DEVICE,
                               enable_memory_saver=False, cache_params=params, mamba_layer_ids=MAMBA_LAYERS,
                               enable_mamba_extra_buffer=False)  # fmt: skip
    page = QSA_PAGE if qsa else 1
    common = dict(size=64, dtype=torch.bfloat16, page_size=page, head_num=2, head_dim=16,
                  full_attention_layer_ids=[1, 3], device=DEVICE, mamba_pool=req.mamba_pool)  # fmt: skip
    if qsa:  # QSA sparse attention: compressed keys, one group per qsa_compress_ratio tokens
        kv = QSATokenToKVPool(**common, qsa_index_kv_heads=1, qsa_index_head_dim=32, qsa_compress_ratio=QSA_PAGE,
                              qsa_token_topk=8, num_request_slots=5)  # fmt: skip
    else:
        kv = HybridLinearKVPool(**common)
    allocator = allocator_for(kv)
    init = CacheInitParams(disable=False, req_to_token_pool=req, token_to_kv_pool_allocator=allocator, page_size=page)
    group, controller, _ = hybrid_pool_assembler.build_hybrid_mamba_stack(
        params=init, decls=kv.host_pool_decls(), mamba_pool=req.mamba_pool, full_layer_mapping={1: 0, 3: 1},
        start_layer=0, load_cache_event=threading.Event(), storage_backend=None, use_mla=False,
        qsa_pool=kv if qsa else None,
    )  # fmt: skip
    return req, kv, allocator, group, controller


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)  # random bytes hold NaNs: compare bytes, not values


def states(mamba_pool) -> list[torch.Tensor]:
    (info,) = mamba_pool.get_device_pool_infos()
    return [info.buffer_info.temporal, *info.buffer_info.conv]


@pytest.mark.parametrize("layout, io_backend", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_mamba_stack(layout, io_backend):
    from hicache_sglang.builders.mamba import SGLangMambaHostPool
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    publish_settings(layout=layout, io_backend=io_backend, page_size=1)
    req, kv, allocator, group, controller = mamba_stack()
    host = group.get_pool(PoolName.MAMBA)
    assert isinstance(host, SGLangMambaHostPool) and isinstance(host, MambaPoolHost)  # the controller's check
    assert host.num_mamba_layers == len(MAMBA_LAYERS) and host.layout == layout
    device = states(req.mamba_pool)
    fill_random(device, seed=71)
    kv_device = allocator.alloc(4)
    mamba_device = req.mamba_allocator.alloc(2)
    written = [t[:, mamba_device.to(t.device)].cpu().clone() for t in device]  # (layers, slots, *state)

    extra = [PoolTransfer(name=PoolName.MAMBA, device_indices=mamba_device)]
    controller.write(kv_device, node_id=1, extra_pools=extra)
    controller.ack_write_queue.pop().finish_event.synchronize()
    synchronize()
    mamba_host = extra[0].host_indices
    host_buffers = [host.temporal_buffer, *host.conv_buffer]  # SGLang's (slots, layers, 1, *state)
    assert [tuple(b.shape) for b in host_buffers] == [(host.size, 2, 1, *t.shape[2:]) for t in device]
    for buf, want in zip(host_buffers, written):
        assert torch.equal(as_bytes(buf[mamba_host, :, 0].transpose(0, 1)), as_bytes(want))

    fill_random(device, seed=72)
    load = [PoolTransfer(name=PoolName.MAMBA, host_indices=mamba_host, device_indices=mamba_device)]
    kv_host = group.alloc(4)
    controller.load(kv_host, node_id=2, extra_pools=load, device_indices=kv_device)
    controller.start_loading()
    controller.ack_load_queue.pop().finish_event.synchronize()
    synchronize()
    for t, want in zip(device, written):
        assert torch.equal(as_bytes(t[:, mamba_device.to(t.device)].cpu()), as_bytes(want))


def test_members_match_sglangs_mamba_pool():
    """Shapes, sizes, flat pages and page pointers agree with SGLang's own MambaPoolHost over the same states."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost  # SGLang's own class, not replaced

    publish_settings(layout="page_first", io_backend="kernel", page_size=1)
    req, _, _, group, _ = mamba_stack()
    ours = group.get_pool(PoolName.MAMBA)
    (info,) = req.mamba_pool.get_device_pool_infos()
    theirs = MambaPoolHost(info.buffer_info, 2.0, 0, device_capacity=req.mamba_pool.size, pin_memory=False,
                           layout="page_first")  # fmt: skip
    for name in ["size", "page_num", "page_size", "num_mamba_layers", "size_per_token", "temporal_state_elem_size",
                 "conv_state_elem_sizes", "temporal_dtype", "conv_dtype", "layout",
                 "can_use_write_back_jit"]:  # fmt: skip
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.temporal_buffer.shape == theirs.temporal_buffer.shape
    assert [b.shape for b in ours.conv_buffer] == [b.shape for b in theirs.conv_buffer]
    assert ours.get_size_per_token() == theirs.get_size_per_token()
    gen = torch.Generator().manual_seed(73)
    for a, b in zip([ours.temporal_buffer, *ours.conv_buffer], [theirs.temporal_buffer, *theirs.conv_buffer]):
        raw = a.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        b.view(torch.uint8).copy_(raw)
    for slot in (0, 3, ours.size - 1):
        assert torch.equal(ours.get_data_page(slot), theirs.get_data_page(slot)), slot
    assert ours.get_dummy_flat_data_page().shape == theirs.get_dummy_flat_data_page().shape
    page = theirs.get_data_page(2).clone()
    ours.set_from_flat_data_page(5, page)
    theirs.set_from_flat_data_page(5, page)
    assert torch.equal(as_bytes(ours.temporal_buffer), as_bytes(theirs.temporal_buffer))
    slots = torch.tensor([1, 4])
    got, want = ours.get_page_buffer_meta(slots), theirs.get_page_buffer_meta(slots)
    bases = [ours.temporal_buffer.data_ptr(), ours.conv_buffer[0].data_ptr()] * 2
    their_bases = [theirs.temporal_buffer.data_ptr(), theirs.conv_buffer[0].data_ptr()] * 2
    assert [p - b for p, b in zip(got[0], bases)] == [p - b for p, b in zip(want[0], their_bases)]
    assert list(got[1]) == list(want[1])


@pytest.mark.parametrize("layout, io_backend", [("page_first", "kernel"), ("page_first_direct", "direct")],
                         ids=["page_first-kernel", "page_first_direct-direct"])  # fmt: skip
def test_qsa_indexer_stack(layout, io_backend):
    """QSA (QSATokenToKVPool): the compressed-key indexer rides on the KV pages, as SGLang's QSAIndexerPoolHost."""
    from hicache_sglang.builders.qsa import SGLangQSAIndexerHostPool
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.pool_host.qsa import QSAIndexerPoolHost

    publish_settings(layout=layout, io_backend=io_backend, page_size=QSA_PAGE)
    req, kv, allocator, group, controller = mamba_stack(qsa=True)
    index_host = group.get_pool(PoolName.INDEXER)
    assert isinstance(index_host, SGLangQSAIndexerHostPool) and isinstance(index_host, QSAIndexerPoolHost)
    rows = index_host.device_buffers  # SGLang's packing: one full-KV page of compressed groups per row
    fill_random(rows + states(req.mamba_pool), seed=75)
    kv_device = allocator.alloc(2 * QSA_PAGE)
    pages = kv_device[::QSA_PAGE] // QSA_PAGE
    written = [r[pages.to(r.device)].cpu().clone() for r in rows]
    sidecar = [PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV)]
    kv_host = controller.write(kv_device, node_id=1, extra_pools=sidecar)
    controller.ack_write_queue.pop().finish_event.synchronize()
    synchronize()
    host_pages = kv_host[::QSA_PAGE] // QSA_PAGE
    for layer, want in enumerate(written):  # SGLang's V4 paged shapes: (pages, L, row) / (pages, L, 1, row)
        got = index_host.kv_buffer[host_pages, layer]
        assert torch.equal(got.reshape(want.shape), want), layer
    fill_random(rows, seed=76)
    again = [PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV)]
    controller.load(kv_host, node_id=2, extra_pools=again, device_indices=kv_device)
    controller.start_loading()
    controller.ack_load_queue.pop().finish_event.synchronize()
    synchronize()
    for r, want in zip(rows, written):
        assert torch.equal(r[pages.to(r.device)].cpu(), want)
