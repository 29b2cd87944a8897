"""DeepSeek-V4 HiSparse inside SGLang: the C4 host pool ``HiSparseCoordinator`` builds is hicache's.

SGLang's own ``DeepSeekV4TokenToKVPool`` (``enable_hisparse=True``: its C4 KV is a
``HiSparseC4DevicePool``), ``SWATokenToKVPoolAllocator``, ``DeepSeekV4HiSparseTokenToKVPoolAllocator``,
``ReqToTokenPool`` and ``HiSparseCoordinator`` are built on ``DEVICE``; nothing of them is patched. The
coordinator's own methods move the bytes: ``admit_request_into_staging`` (prefill backup, all
layers: whole pages and partial ones), ``_eager_backup_previous_token`` (the decode step's one
compressed token per request, ``backup_tokens_from_device_all_layer``) and
``_preload_to_device_buffer`` (the direct-to-host preload, per layer). ``naive_load_topk`` is not
DeepSeek-V4's (SGLang asserts so).

The oracle is SGLang's C4 page row, written from its ``deepseek_v4/kvcacheio.cuh``
(``get_pointer_paged``): ``kPageSize`` 64 tokens, token ``t`` of page ``t // 64`` has its 576-byte
value at ``(t % 64) * 576`` and its 8-byte scale at ``64 * 576 + (t % 64) * 8`` of the row; a whole
page moves its whole row (SGLang's page-row copy).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import test_hisparse as hisparse_suite
import torch
from sglang_platform import SGLANG_SEES_NO_GPU
from sglang_setup import DEVICE, fill_random, publish_settings, synchronize

# The MLA / MHA suite's fixtures: one gloo TP group, SGLang's host reserve lowered, the swap-in opt-in.
tp_group, small_host_reserve, swap_in_accepted = (hisparse_suite.tp_group, hisparse_suite.small_host_reserve,
                                                  hisparse_suite.swap_in_accepted)  # fmt: skip
pinned_memory_on_cpu = hisparse_suite.pinned_memory_on_cpu

PAGE, SWA_PAGE, C4 = 256, 128, 4  # the model's page; C4 pages are PAGE // 4 = 64 compressed tokens
P, VALUE, SCALE = 64, 576, 8
LAYERS, REQS, CONTEXT = 2, 4, 8192


def v4_stack(tp_group, device_buffer_size: int = 64):
    from sglang.srt.managers.hisparse_coordinator import HiSparseCoordinator
    from sglang.srt.mem_cache.allocator.hisparse import DeepSeekV4HiSparseTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    # The settings SGLang's DeepSeek-V4 pool reads (its attention backend); HiSparse itself passes layer_first/kernel.
    publish_settings(layout="layer_first", io_backend="kernel", page_size=PAGE)
    pool = DeepSeekV4TokenToKVPool(
        max_num_reqs=REQS, swa_size=2048, c4_size=1024, c128_size=256,
        c4_state_pool_size=(2048 // SWA_PAGE + 1) * 4, c128_state_pool_size=0,
        page_size=PAGE, swa_page_size=SWA_PAGE, dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32,
        c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128,
        layer_num=LAYERS, device=DEVICE, enable_memory_saver=False, compression_ratios=[4, 4], sliding_window=128,
        start_layer=0, end_layer=LAYERS, enable_hisparse=True,
    )  # fmt: skip
    logical = SWATokenToKVPoolAllocator(size=4096, size_swa=2048, page_size=PAGE, dtype=torch.uint8, device=DEVICE,
                                        kvcache=pool, need_sort=False)  # fmt: skip
    allocator = DeepSeekV4HiSparseTokenToKVPoolAllocator(logical)
    req_to_token = ReqToTokenPool(size=REQS, max_context_len=CONTEXT, device=DEVICE, enable_memory_saver=False)
    return HiSparseCoordinator(req_to_token, allocator, top_k=16, device_buffer_size=device_buffer_size,
                               device=DEVICE, tp_group=tp_group)  # fmt: skip


def token_bytes(row: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ``t``'s (value, scale) bytes of a C4 layer buffer ``(pages, row_bytes)`` (the oracle)."""
    page, off = divmod(int(t), P)
    r = row[page]
    return r[off * VALUE:(off + 1) * VALUE], r[P * VALUE + off * SCALE:P * VALUE + (off + 1) * SCALE]


def expected_host(host_rows: torch.Tensor, dev_rows: torch.Tensor, host_slots, device_slots) -> torch.Tensor:
    """The host layer after SGLang's copy of ``device_slots`` to ``host_slots``: whole rows for whole aligned pages
    on both sides, else token by token."""
    want = host_rows.clone()
    h, d = torch.as_tensor(host_slots).tolist(), torch.as_tensor(device_slots).tolist()
    if len(h) % P == 0 and all(
        s[i] % P == 0 and s[i:i + P] == list(range(s[i], s[i] + P)) for s in (h, d) for i in range(0, len(s), P)
    ):  # fmt: skip
        for i in range(0, len(h), P):
            want[h[i] // P] = dev_rows[d[i] // P]
        return want
    for ht, dt in zip(h, d):
        for w, g in zip(token_bytes(want, ht), token_bytes(dev_rows, dt)):
            w.copy_(g)
    return want


def request(co, idx: int, full_tokens: int, device_slots: torch.Tensor):
    """A request of ``full_tokens`` prefilled tokens whose compressed tokens sit at ``device_slots`` of the C4 pool."""
    alloc = co.token_to_kv_pool_allocator
    # Full (logical) slots of one request, page-aligned and apart from the others' (SGLang's SWA allocator
    # hands out whole pages; the coordinator only reads them back from req_to_token).
    full = torch.arange(idx * 1024, idx * 1024 + full_tokens, device=alloc.device)
    compressed = co.mem_pool_device.translate_loc_from_full_to_compressed(full)
    assert compressed.numel() == len(device_slots) == full_tokens // C4
    alloc.full_to_hisparse_device_index_mapping[compressed] = device_slots.to(alloc.device, torch.int64)
    co.req_to_token_pool.req_to_token[idx, :full_tokens] = full.to(torch.int32)
    return SimpleNamespace(rid=f"r{idx}", extend_end=full_tokens, hisparse_staging=False,
                           kv=SimpleNamespace(req_pool_idx=idx, kv_allocated_len=full_tokens))  # fmt: skip


def snapshot(co) -> list[torch.Tensor]:
    return [co.mem_pool_host.kv_buffer[layer].clone() for layer in range(LAYERS)]


def device_rows(co) -> list[torch.Tensor]:
    return [t.cpu() for t in co.mem_pool_device.kv_buffer]


def test_coordinator_moves_c4_pages_and_tokens_through_hicache(tp_group, swap_in_accepted, monkeypatch):
    from hicache_sglang.builders.hisparse_dsv4 import SGLangHiSparseDSV4HostPool
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool

    co = v4_stack(tp_group)
    host, dev = co.mem_pool_host, co.mem_pool_device
    assert co.is_dsv4_hisparse and type(host) is SGLangHiSparseDSV4HostPool
    assert isinstance(host, DeepSeekV4PagedHostPool)
    assert dev.page_size == P and dev.bytes_per_page_padded == 37440 and co.item_size_bytes == VALUE + SCALE
    # SGLang's layer_first shapes: a list of (num_host_pages, item_bytes) uint8 rows per layer.
    assert [tuple(t.shape) for t in host.kv_buffer] == [(host.num_host_pages, 37440)] * LAYERS
    assert all(t.dtype == torch.uint8 for t in host.kv_buffer)
    assert host.size == host.num_host_pages * P and host.core.io_backend == "kernel" and host.core.page_size == 1
    fill_random(list(dev.kv_buffer), seed=7)

    # Staging of two whole, aligned pages (8 * 64 full tokens): SGLang's page-row copy, padding included.
    req = request(co, 0, 2 * P * C4, torch.arange(3 * P, 5 * P))
    before = snapshot(co)
    co.admit_request_into_staging(req)
    synchronize()
    hslots = co.req_to_host_pool[0, :2 * P].cpu()
    assert hslots.tolist() == list(range(int(hslots[0]), int(hslots[0]) + 2 * P)) and int(hslots[0]) % P == 0
    for layer, rows in enumerate(device_rows(co)):
        want = expected_host(before[layer], rows, hslots, torch.arange(3 * P, 5 * P))
        assert torch.equal(host.kv_buffer[layer], want), layer
    assert co.collect_ready_reqs() == [req]

    # Staging of a partial page with scattered device slots: token by token, each its value and its scale only.
    scattered = torch.randperm(4 * P, generator=torch.Generator().manual_seed(3))[:37] + P
    req1 = request(co, 1, 37 * C4 + 2, scattered)
    before = snapshot(co)
    co.admit_request_into_staging(req1)
    synchronize()
    hslots1 = co.req_to_host_pool[1, :37].cpu()
    for layer, rows in enumerate(device_rows(co)):
        want = expected_host(before[layer], rows, hslots1, scattered)
        assert torch.equal(host.kv_buffer[layer], want), layer
        assert not torch.equal(want, before[layer])
    assert co.collect_ready_reqs() == [req1]

    # A decode step that completes a compressed token: the coordinator backs up that one token, all layers.
    # seq_len - 1 == 4 * 38: compressed position 37 (the 38th), from its device buffer slot.
    co._skip_first_backup[1] = False
    co.req_to_device_buffer[1, 37] = 7 * P + 9
    fill_random(list(dev.kv_buffer), seed=8)
    before = snapshot(co)
    seq = torch.tensor([38 * C4 + 1])
    with pinned_memory_on_cpu(monkeypatch):
        co._eager_backup_previous_token(seq.to(co.device), torch.tensor([1], device=co.device), seq,
                                        torch.tensor([1]))  # fmt: skip
    co.wait_for_pending_backup()
    synchronize()
    hslot = int(co.req_to_host_pool[1, 37])
    assert hslot >= 0 and hslot not in hslots1.tolist()
    for layer, rows in enumerate(device_rows(co)):
        want = expected_host(before[layer], rows, [hslot], [7 * P + 9])
        assert torch.equal(host.kv_buffer[layer], want), layer

    # A decode backup of 64 single tokens is still 64 tokens, never mistaken for a page.
    before = snapshot(co)
    hs = host.alloc_page(1)
    ds = torch.randperm(P, generator=torch.Generator().manual_seed(4)) + 2 * P
    host.backup_tokens_from_device_all_layer(hs, ds)
    synchronize()
    for layer, rows in enumerate(device_rows(co)):
        assert torch.equal(host.kv_buffer[layer], expected_host(before[layer], rows, hs, ds)), layer
    host.free(hs)

    # The direct-to-host preload, layer by layer: the host bytes land in the device buffer slots.
    n = 40
    req2 = request(co, 2, n * C4, torch.arange(n))
    slots = host.alloc_paged_token_slots(co.req_to_host_pool, co.req_to_host_pool_allocated_len, 2, 0, n).cpu()
    gen = torch.Generator().manual_seed(9)
    for layer in range(LAYERS):
        for t in slots.tolist():
            for part in token_bytes(host.kv_buffer[layer], t):
                part.copy_(torch.randint(0, 256, part.shape, dtype=torch.uint8, generator=gen))
    co.req_to_device_buffer[2, :n] = torch.randperm(8 * P, generator=gen)[:n].to(co.req_to_device_buffer.dtype)
    fill_random(list(dev.kv_buffer), seed=10)
    dev_before = device_rows(co)
    co._preload_to_device_buffer(req2)
    synchronize()
    locs = co.req_to_device_buffer[2, :n].cpu()
    for layer, rows in enumerate(device_rows(co)):
        want = dev_before[layer].clone()
        for h, d in zip(slots.tolist(), locs.tolist()):
            for w, g in zip(token_bytes(want, d), token_bytes(host.kv_buffer[layer], h)):
                w.copy_(g)
        assert torch.equal(rows, want), layer

    # Finishing gives every whole page back.
    for r in (req, req1, req2):
        co.request_finished(r)
    assert host.available_size() == host.size


def test_refused_without_accepting_sglangs_swap_in(tp_group, monkeypatch):
    from hicache_sglang import NotServedError
    from hicache_sglang.builders import hisparse

    monkeypatch.delenv(hisparse.ENV_SWAP_IN, raising=False)
    with pytest.raises(NotServedError, match=rf"--enable-hisparse \(DeepSeek-V4\).*{hisparse.ENV_SWAP_IN}=sglang"):
        v4_stack(tp_group)


def test_bad_input_is_refused_before_any_byte_moves(tp_group, swap_in_accepted):
    co = v4_stack(tp_group)
    host = co.mem_pool_host
    fill_random(list(co.mem_pool_device.kv_buffer), seed=11)
    before = snapshot(co)
    with pytest.raises(ValueError, match="index size mismatch"):
        host.backup_tokens_from_device_all_layer(torch.arange(3), torch.arange(2))
    with pytest.raises(ValueError, match="does not hold the C4 buffers"):
        host.backup_from_device_all_layer(SimpleNamespace(kv_buffer=[torch.zeros(1)]), torch.arange(P),
                                          torch.arange(P), "kernel")  # fmt: skip
    with pytest.raises(IndexError, match="outside"):
        host.load_to_device_per_layer(co.mem_pool_device, torch.arange(3), torch.arange(3), LAYERS, "kernel")
    assert all(torch.equal(a, b) for a, b in zip(snapshot(co), before))


def test_other_c4_geometries_are_refused(swap_in_accepted):
    from hicache_sglang import NotServedError
    from hicache_sglang.builders.hisparse_dsv4 import SGLangHiSparseDSV4HostPool

    rows = [torch.zeros(4, 37440, dtype=torch.uint8)]
    with pytest.raises(NotServedError, match="pages of 32 tokens"):
        SGLangHiSparseDSV4HostPool("dsv4_hisparse_c4", rows, 37440, 8, 32)
    with pytest.raises(NotServedError, match="layout 'page_first'"):
        SGLangHiSparseDSV4HostPool("dsv4_hisparse_c4", rows, 37440, 8, 64, layout="page_first")


@pytest.mark.skipif(DEVICE != "cuda", reason="SGLang's token-granular C4 copy (transfer_cache_dsv4_mla) is CUDA's")
@pytest.mark.skipif(SGLANG_SEES_NO_GPU, reason="SGLang's own C4 copy is sgl_kernel's, which cannot load beside this "
                    "torch (sglang_platform): on the GPU machine its transfer_kv_all_layer_mla is undefined")
def test_same_bytes_as_sglangs_own_c4_copy(tp_group, swap_in_accepted):
    """SGLang's own ``DeepSeekV4PagedHostPool`` (its module's class, not replaced) and hicache's, on one device pool."""
    from sglang.srt.mem_cache import memory_pool_host

    co = v4_stack(tp_group)
    ours, dev = co.mem_pool_host, co.mem_pool_device
    theirs = memory_pool_host.DeepSeekV4PagedHostPool(
        pool_name="dsv4_hisparse_c4", device_buffers=dev.kv_buffer, item_bytes=dev.bytes_per_page_padded,
        num_host_pages=ours.num_host_pages, slot_page_size=dev.page_size, layout="layer_first",
    )  # fmt: skip
    fill_random(list(dev.kv_buffer), seed=21)
    gen = torch.Generator().manual_seed(22)
    tokens_h = torch.randperm(ours.size, generator=gen)[:50].to(DEVICE)
    tokens_d = torch.randperm(8 * P, generator=gen)[:50].to(DEVICE)
    pages_h = torch.arange(2 * P, 4 * P, device=DEVICE)
    pages_d = torch.arange(5 * P, 7 * P, device=DEVICE)
    for pool in (ours, theirs):
        pool.backup_tokens_from_device_all_layer(tokens_h, tokens_d)
        pool.backup_from_device_all_layer(dev, pages_h, pages_d, "kernel")
    synchronize()
    for layer in range(LAYERS):
        assert torch.equal(ours.kv_buffer[layer].cpu(), theirs.kv_buffer[layer].cpu()), layer
    # And back: one layer, token by token, from hicache's host bytes and from SGLang's.
    back = torch.randperm(8 * P, generator=gen)[:50].to(DEVICE)
    loaded = []
    for pool in (ours, theirs):
        fill_random(list(dev.kv_buffer), seed=23)
        pool.load_to_device_per_layer(dev, tokens_h, back, 1, "kernel")
        synchronize()
        loaded.append(dev.kv_buffer[1].cpu().clone())
    assert torch.equal(loaded[0], loaded[1])
