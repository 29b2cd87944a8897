"""HiSparse inside SGLang: the pools SGLang's ``HiSparseCoordinator`` builds are hicache's.

SGLang's own coordinator, device pools (``HiSparseDSATokenToKVPool``, MiniMax-M3's
``MiniMaxSparseKVPool`` with ``HiSparseMHAMainPool``), allocator (``HiSparseTokenToKVPoolAllocator``)
and ``ReqToTokenPool`` are built on ``DEVICE``; nothing of their allocation is patched. The
coordinator's own methods move the bytes: ``admit_request_into_staging`` (prefill backup, all
layers), ``admit_request_direct`` (its preload, per layer) and ``naive_load_topk`` (single
scattered tokens, per layer). A request is a namespace holding the fields the coordinator reads
(``rid``, ``extend_end``, ``kv.req_pool_idx``, ``kv.kv_allocated_len``); a TP group of one is
a gloo group on 127.0.0.1. The host bytes are read through SGLang's ``layer_first`` shapes.
"""

from __future__ import annotations

import socket
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from sglang_platform import SGLANG_SEES_NO_GPU
from sglang_setup import DEVICE, fill_random, synchronize

LAYERS, REQS, CONTEXT = 3, 4, 512


@pytest.fixture(scope="module")
def tp_group():
    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield dist.group.WORLD


@pytest.fixture(autouse=True)
def small_host_reserve(monkeypatch):
    """SGLang keeps 10 GiB of host memory free beyond a host pool; these pools are KBs on a shared machine."""
    from sglang.srt.mem_cache.pool_host import base

    monkeypatch.setattr(base, "HICACHE_HOST_MEMORY_RESERVE_BYTES", 1 << 28)


@pytest.fixture
def swap_in_accepted(monkeypatch):
    from hicache_sglang.builders import hisparse

    monkeypatch.setenv(hisparse.ENV_SWAP_IN, "sglang")


def dsa_device(page: int):
    from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool

    return HiSparseDSATokenToKVPool(size=32 * max(page, 32), page_size=page, kv_lora_rank=32, dtype=torch.bfloat16,
                                    qk_rope_head_dim=16, layer_num=LAYERS, device=DEVICE, index_head_dim=128,
                                    enable_memory_saver=False, kv_cache_dim=48)  # fmt: skip


def m3_device(page: int):
    from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseMHAMainPool
    from sglang.srt.mem_cache.memory_pool import MiniMaxSparseKVPool

    return MiniMaxSparseKVPool(size=32 * max(page, 32), page_size=page, dtype=torch.bfloat16, head_num=1, head_dim=32,
                               idx_head_dim=16, dense_layer_ids=[0], sparse_layer_ids=[1, 2], device=DEVICE,
                               start_layer=0, end_layer=LAYERS, main_pool_cls=HiSparseMHAMainPool,
                               enable_hisparse=True)  # fmt: skip


def coordinator(kvcache, page: int, tp_group):
    from sglang.srt.managers.hisparse_coordinator import HiSparseCoordinator
    from sglang.srt.mem_cache.allocator.hisparse import HiSparseTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    allocator = HiSparseTokenToKVPoolAllocator(size=kvcache.size, page_size=page, dtype=torch.bfloat16, device=DEVICE,
                                               kvcache=kvcache, need_sort=False)  # fmt: skip
    req_to_token = ReqToTokenPool(size=REQS, max_context_len=CONTEXT, device=DEVICE, enable_memory_saver=False)
    return HiSparseCoordinator(req_to_token, allocator, top_k=16, device_buffer_size=max(2 * page, 64), device=DEVICE,
                               tp_group=tp_group)  # fmt: skip


def device_layers(co) -> list[tuple[int, list[torch.Tensor]]]:
    """(layer id the coordinator passes, [device tensors of that layer]) for each layer of its device pool."""
    dev = co.mem_pool_device
    if co.is_m3_hisparse:
        ids = range(dev.start_layer, dev.end_layer)
        return [(lid, [dev.get_key_buffer(lid), dev.get_value_buffer(lid)]) for lid in ids]
    return [(lid, [dev.kv_buffer[lid]]) for lid in range(dev.layer_num)]


def host_layers(co, host_layer: int) -> list[torch.Tensor]:
    """SGLang's ``layer_first`` host shapes: MLA ``kv_buffer[layer]``, MHA ``k_buffer[layer]`` / ``v_buffer[layer]``."""
    host = co.mem_pool_host
    if co.is_m3_hisparse:
        return [host.k_buffer[host_layer], host.v_buffer[host_layer]]
    return [host.kv_buffer[host_layer]]


def new_request(co, idx: int, tokens: int):
    """A request of ``tokens`` prefilled tokens: logical slots and their HiSparse device slots (``alloc``'s map)."""
    alloc = co.token_to_kv_pool_allocator
    whole = -(-tokens // alloc.page_size) * alloc.page_size  # SGLang's paged allocators hand out whole pages
    logical = alloc.logical_attn_allocator.alloc(whole)[:tokens]
    device = alloc.hisparse_attn_allocator.alloc(whole)[:tokens]
    alloc.full_to_hisparse_device_index_mapping[logical] = device
    co.req_to_token_pool.req_to_token[idx, :tokens] = logical.to(torch.int32)
    return SimpleNamespace(rid=f"r{idx}", extend_end=tokens, hisparse_staging=False,
                           kv=SimpleNamespace(req_pool_idx=idx, kv_allocated_len=tokens)), device  # fmt: skip


@contextmanager
def pinned_memory_on_cpu(monkeypatch):
    """``torch.tensor(..., pin_memory=True)`` needs CUDA; without it (a CPU machine) the tensor is a plain one."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.tensor

    def tensor(*args, pin_memory=False, **kw):
        return original(*args, **kw)

    with monkeypatch.context() as m:
        m.setattr(torch, "tensor", tensor)
        yield


# SGLang's DSA keeps 64-token pages; MiniMax-M3 runs with any page size.
FAMILIES = [("mla", 64), ("mha", 64), ("mha", 1)]


@pytest.mark.parametrize("family, page", FAMILIES, ids=[f"{f}-page{p}" for f, p in FAMILIES])
def test_coordinator_backs_up_and_loads_through_hicache(family, page, tp_group, swap_in_accepted, monkeypatch):
    from hicache_sglang.builders.hisparse import SGLangHiSparseMHAHostPool, SGLangHiSparseMLAHostPool
    from sglang.srt.mem_cache.pool_host.mha import HiSparseMHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    co = coordinator(dsa_device(page) if family == "mla" else m3_device(page), page, tp_group)
    host = co.mem_pool_host
    ours, theirs = ((SGLangHiSparseMLAHostPool, MLATokenToKVPoolHost) if family == "mla"
                    else (SGLangHiSparseMHAHostPool, HiSparseMHATokenToKVPoolHost))  # fmt: skip
    assert type(host) is ours and isinstance(host, theirs)
    assert host.layout == "layer_first" and host.page_size == page and host.core.page_size == 1
    assert host.core.io_backend == "kernel" and set(host.core.implementations) >= {"load_to_device_per_layer"}
    layers = device_layers(co)
    fill_random([t for _, ts in layers for t in ts], seed=41)

    # Prefill staging: every layer of the request's device slots, backed up by the coordinator.
    tokens = 3 * page + 5 if page > 1 else 37
    req, device_slots = new_request(co, 1, tokens)
    free_before = host.available_size()
    co.admit_request_into_staging(req)
    synchronize()
    host_slots = co.req_to_host_pool[1, :tokens].cpu()
    assert free_before - host.available_size() == -(-tokens // page) * page  # whole pages, as SGLang's mixin
    assert len(set(host_slots.tolist())) == tokens
    for host_layer, (_, device) in enumerate(layers):
        for d, h in zip(device, host_layers(co, host_layer)):
            want = d[device_slots.to(d.device)].cpu()
            assert torch.equal(h[host_slots].view(torch.uint8), want.view(torch.uint8)), host_layer
    assert co.collect_ready_reqs() == [req] and not req.hisparse_staging

    # Two decode steps: the first after staging backs nothing up; the second backs up the token the first
    # wrote (one scattered token, all layers). SGLang stages that step's batch positions in pinned memory.
    dbs = co.device_buffer_size
    for step in (1, 2):
        seq = torch.tensor([tokens + step])
        new_loc = co.token_to_kv_pool_allocator.logical_attn_allocator.alloc(page)[:1]
        with pinned_memory_on_cpu(monkeypatch):
            co.map_last_loc_to_buffer(seq.to(co.device), new_loc, torch.tensor([1], device=co.device), seq,
                                      torch.tensor([1]))  # fmt: skip
        synchronize()
        written_at = int(co.req_to_device_buffer[1, min(tokens + step - 1, dbs)])
        if step == 1:
            fill_random([t for _, ts in layers for t in ts], seed=45)  # the model writes the new token
            new_token = [[d[written_at].cpu().clone() for d in device] for _, device in layers]
    host_slot = int(co.req_to_host_pool[1, tokens])
    assert host_slot >= 0 and host_slot not in host_slots.tolist()
    for host_layer, want in enumerate(new_token):
        for h, w in zip(host_layers(co, host_layer), want):
            assert torch.equal(h[host_slot].view(torch.uint8), w.view(torch.uint8)), host_layer
    fill_random([t for _, ts in layers for t in ts], seed=46)

    # Single scattered tokens back to the device buffer, one layer per call (naive_load_topk): a request longer
    # than the hot buffer, so every selected token but the newest is loaded from the host pool.
    long = co.device_buffer_size + 9
    req2, _ = new_request(co, 2, long)
    co.admit_request_into_staging(req2)
    synchronize()
    assert co.collect_ready_reqs() == [req2]
    top = torch.zeros((1, co.top_k), dtype=torch.int32, device=co.device)
    top[0, :6] = torch.tensor([0, 5, 7, long - 4, 3, 11], dtype=torch.int32)
    staged = co.req_to_host_pool[2].cpu()
    for host_layer, (lid, device) in enumerate(layers):
        fill_random(device, seed=50 + host_layer)  # what the load must overwrite
        got = co.naive_load_topk(torch.tensor([2]), torch.tensor([long]), top, lid)[0].cpu()
        synchronize()
        for d, h in zip(device, host_layers(co, host_layer)):
            for pos, loc in zip(top[0].cpu().tolist(), got.tolist()):
                assert torch.equal(d[loc].cpu().view(torch.uint8), h[staged[pos]].view(torch.uint8)), (lid, pos)

    # Direct-to-host admission: bytes already in the host pool, preloaded layer by layer into the device buffer.
    n = min(co.device_buffer_size, 2 * page + 3 if page > 1 else 21)
    req3, _ = new_request(co, 3, n)
    slots = host.alloc_paged_token_slots(co.req_to_host_pool, co.req_to_host_pool_allocated_len, 3, 0, n).cpu()
    payload = []
    for host_layer in range(len(layers)):
        per = []
        for h in host_layers(co, host_layer):
            rows = torch.randint(0, 256, (n, h[0].nbytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(
                60 + host_layer))  # fmt: skip
            h.view(torch.uint8).view(h.shape[0], -1)[slots] = rows
            per.append(rows)
        payload.append(per)
    co.admit_request_direct(req3)
    synchronize()
    buffer_locs = co.req_to_device_buffer[3, :n].cpu()
    for host_layer, (_, device) in enumerate(layers):
        for d, rows in zip(device, payload[host_layer]):
            assert torch.equal(d[buffer_locs.to(d.device)].cpu().view(torch.uint8).reshape(n, -1), rows), host_layer

    # Finishing gives every whole page back.
    for r in (req, req2, req3):
        co.request_finished(r)
    assert host.available_size() == host.size


@pytest.mark.parametrize("family", ["mla", "mha"])
def test_refused_without_accepting_sglangs_swap_in(family, tp_group, monkeypatch):
    from hicache_sglang import NotServedError
    from hicache_sglang.builders import hisparse

    monkeypatch.delenv(hisparse.ENV_SWAP_IN, raising=False)
    with pytest.raises(NotServedError, match=rf"--enable-hisparse .*{hisparse.ENV_SWAP_IN}=sglang"):
        coordinator(dsa_device(64) if family == "mla" else m3_device(64), 64, tp_group)
    monkeypatch.setenv(hisparse.ENV_SWAP_IN, "yes")
    with pytest.raises(ValueError, match=r"^HICACHE_SGLANG_HISPARSE_SWAP_IN='yes' is not one of: 'sglang'$"):
        coordinator(dsa_device(64) if family == "mla" else m3_device(64), 64, tp_group)


def test_m3_transfers_require_kernel(tp_group, swap_in_accepted):
    co = coordinator(m3_device(64), 64, tp_group)
    idx = torch.arange(4)
    with pytest.raises(ValueError, match="MiniMax M3 HiSparse host transfers require the kernel backend"):
        co.mem_pool_host.backup_from_device_all_layer(co.mem_pool_device, idx, idx, "direct")
    with pytest.raises(ValueError, match="require the kernel backend"):
        co.mem_pool_host.load_to_device_per_layer(co.mem_pool_device, idx, idx, 0, "kernel", is_draft=True)


def test_another_device_pool_is_refused(tp_group, swap_in_accepted):
    co = coordinator(dsa_device(64), 64, tp_group)
    idx = torch.arange(4)
    with pytest.raises(ValueError, match="does not hold the buffers this HiSparse host pool was built from"):
        co.mem_pool_host.backup_from_device_all_layer(dsa_device(64), idx, idx, "kernel")


def test_launcher_refuses_hisparse_unless_the_split_is_accepted(monkeypatch):
    from hicache_sglang import NotServedError, startup
    from hicache_sglang.builders import hisparse
    from sglang_setup import publish_settings

    args = publish_settings(layout="layer_first", io_backend="kernel", page_size=64, enable_hisparse=True)
    monkeypatch.delenv(hisparse.ENV_SWAP_IN, raising=False)
    with pytest.raises(NotServedError, match=rf"^--enable-hisparse \(every model\): .*{hisparse.ENV_SWAP_IN}=sglang"):
        startup.check(args)
    monkeypatch.setenv(hisparse.ENV_SWAP_IN, "sglang")
    startup.check(args)


@pytest.mark.parametrize("family", ["mla", "mha"])
def test_members_match_sglangs_hisparse_pools(family, tp_group, swap_in_accepted, monkeypatch):
    """Sizes, shapes, strides, PD buffer infos and the mixin's page-granular slots agree with SGLang's own pools.

    SGLang's pools are built from its own modules (not replaced there) with the coordinator's arguments; their
    host memory registration (``cudaHostRegister``, CUDA-only) is patched out on a CPU machine, and where SGLang
    is shown no GPU (``sglang_platform``: there it registers memory torch already pinned, and the failed call's
    error would surface in a later test), nothing else.
    """
    from sglang.srt.mem_cache.pool_host import common
    from sglang.srt.mem_cache.pool_host import mha as sglang_mha
    from sglang.srt.mem_cache.pool_host import mla as sglang_mla

    if not torch.cuda.is_available() or SGLANG_SEES_NO_GPU:
        monkeypatch.setattr(common, "_cuda_host_register", lambda *a, **k: None)
    page = 64
    co = coordinator(dsa_device(page) if family == "mla" else m3_device(page), page, tp_group)
    ours, dev = co.mem_pool_host, co.mem_pool_device
    info = dev.get_device_pool_infos()[0].buffer_info
    capacity = dev.size if dev.host_capacity_tokens is None else dev.host_capacity_tokens
    if family == "mla":
        theirs = sglang_mla.MLATokenToKVPoolHost(
            buffer_info=info, device_capacity_tokens=capacity, start_layer=dev.start_layer, end_layer=dev.end_layer,
            target_layer_num=dev.layer_num, host_to_device_ratio=2, host_size=0, page_size=page, layout="layer_first",
            override_kv_cache_dim=dev.kv_cache_dim)  # fmt: skip
        buffers = [(ours.kv_buffer, theirs.kv_buffer)]
    else:
        theirs = sglang_mha.HiSparseMHATokenToKVPoolHost(
            buffer_info=info, device_capacity_tokens=capacity, start_layer=dev.start_layer, end_layer=dev.end_layer,
            host_to_device_ratio=2, page_size=page)  # fmt: skip
        buffers = [(ours.k_buffer, theirs.k_buffer), (ours.v_buffer, theirs.v_buffer)]
    for name in ["size", "page_num", "page_size", "layer_num", "layout", "dtype", "token_stride_size",
                 "start_layer", "end_layer"]:  # fmt: skip
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.available_size() == theirs.available_size()
    for a, b in buffers:
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
    (p1, l1, i1), (p2, l2, i2) = ours.get_contiguous_buf_infos(), theirs.get_contiguous_buf_infos()
    assert (l1, i1) == (l2, i2) and len(p1) == len(p2)

    rows = [torch.full((REQS, CONTEXT), -1, dtype=torch.int64) for _ in range(2)]
    lens = [torch.zeros(REQS, dtype=torch.int64) for _ in range(2)]
    for req, start, n in [(1, 0, 70), (2, 0, 1), (1, 70, 1), (1, 71, 60), (2, 1, 64)]:
        got = [pool.alloc_paged_token_slots(r, ln, req, start, n) for pool, r, ln in
               zip((ours, theirs), rows, lens)]  # fmt: skip
        assert torch.equal(got[0], got[1]) and torch.equal(lens[0], lens[1]), (req, start, n)
        assert ours.available_size() == theirs.available_size()
    for req in (1, 2):
        held = [pool.allocated_host_indices(r, req, ln[req]) for pool, r, ln in zip((ours, theirs), rows, lens)]
        assert torch.equal(held[0], held[1]) and held[0].numel() % page == 0
        ours.free(held[0])
    assert ours.available_size() == ours.size
    with pytest.raises(ValueError, match="multiple of the page size"):
        ours.alloc(page + 1)


def test_verification_is_refused_not_skipped(tp_group, swap_in_accepted, monkeypatch):
    from hicache_sglang import NotServedError

    monkeypatch.setenv("HICACHE_VERIFY", "1")
    with pytest.raises(NotServedError, match="HICACHE_VERIFY is set, but SGLang's HiSparse swap-in kernels read"):
        coordinator(dsa_device(64), 64, tp_group)


def test_identity_line_names_the_swap_in(tp_group, swap_in_accepted, caplog):
    import logging

    from hicache_sglang.identity import PREFIX

    with caplog.at_level(logging.INFO, logger="hicache_sglang"):
        co = coordinator(dsa_device(64), 64, tp_group)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith(PREFIX)]
    assert "SGLangHiSparseMLAHostPool" in line and "pool kind mla, layout layer_first, io backend kernel" in line
    assert line.endswith("decode swap-in: SGLang's HiSparse kernels read its layer_first buffers directly "
                         "(HICACHE_SGLANG_HISPARSE_SWAP_IN=sglang)")  # fmt: skip
    assert f"{co.mem_pool_host.size} tokens, page size 1" in line


@pytest.mark.skipif(DEVICE != "cuda", reason="SGLang's HiSparse swap-in kernels are CUDA JIT kernels")
@pytest.mark.skipif(SGLANG_SEES_NO_GPU, reason="SGLang is shown no GPU here (no sgl_kernel beside this torch: "
                    "sglang_platform), so its CUDA swap-in does not run as it would in a server")
def test_sglangs_swap_in_reads_hicaches_bytes(tp_group, swap_in_accepted):
    """With the split accepted, SGLang's own swap-in (``swap_in_selected_pages``) gathers from the hicache pool.

    A request longer than the hot buffer, staged through hicache; after the swap-in every selected
    token's device row is the row hicache backed up for it (hot-buffer hits and host misses alike).
    """
    co = coordinator(dsa_device(64), 64, tp_group)
    layers = device_layers(co)
    fill_random([t for _, ts in layers for t in ts], seed=71)
    long = co.device_buffer_size + 40
    req, device_slots = new_request(co, 1, long)
    co.admit_request_into_staging(req)
    synchronize()
    assert co.collect_ready_reqs() == [req]
    staged = [ts[0][device_slots.to(ts[0].device)].clone() for _, ts in layers]  # each position's row, by layer
    positions = torch.randperm(long - 1, generator=torch.Generator().manual_seed(72))[: co.top_k]
    top = positions.to(torch.int32).view(1, -1).to(co.device)
    co.num_real_reqs.fill_(1)
    for host_layer, (lid, (device,)) in enumerate(layers):
        locs = co.swap_in_selected_pages(torch.tensor([1], device=co.device), torch.tensor([long], dtype=torch.int32,
                                         device=co.device), top, lid)[0].long()  # fmt: skip
        synchronize()
        assert torch.equal(device[locs].cpu(), staged[host_layer][positions].cpu()), lid
