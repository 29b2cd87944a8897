"""The members SGLang reads from a host pool mean what SGLang's own host pools mean.

The oracle is SGLang's own ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``, built over
the same device pool with ``pin_memory=False`` (so it needs no GPU; its transfers need
sgl_kernel and are never called here). With the same bytes in both host buffers, flat
pages, page pointers (as offsets from each buffer's base), element sizes and sizes per
token must agree: storage backends and PD transfer see no difference.
"""

from __future__ import annotations

import pytest
import torch
from hicache_sglang import pool_api
from sglang_setup import LAYERS, PP_START, device_pool, mha_pool, publish_settings

MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
CASES = [("mha", layout) for layout in MHA_LAYOUTS] + [("mla", layout) for layout in MLA_LAYOUTS]
CASE_IDS = [f"{kind}-{layout}" for kind, layout in CASES]


def io_for(layout: str) -> str:
    return "direct" if layout == "page_first_direct" else "kernel"


def ours_and_theirs(kind: str, layout: str, page_size: int, dev=None):
    """hicache's pool (through SGLang's build_kv_host_pool) and SGLang's own, over one device pool."""
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    publish_settings(layout=layout, io_backend=io_for(layout), page_size=page_size)
    dev = dev if dev is not None else device_pool(kind, page_size, start_layer=PP_START)
    ours = hybrid_pool_assembler.build_kv_host_pool(kv_pool=dev, page_size=page_size, use_mla=kind == "mla")
    info = dev.get_device_pool_infos()[0].buffer_info
    common = dict(pin_memory=False, device_capacity_tokens=dev.size, start_layer=dev.start_layer,
                  end_layer=dev.end_layer)  # fmt: skip
    if kind == "mla":
        theirs = MLATokenToKVPoolHost(info, 2.0, 0, page_size, layout, target_layer_num=dev.layer_num,
                                      override_kv_cache_dim=dev.kv_cache_dim, **common)  # fmt: skip
    else:
        theirs = MHATokenToKVPoolHost(info, 2.0, 0, page_size, layout, **common)
    gen = torch.Generator().manual_seed(41)
    raw = ours.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    theirs.kv_buffer.view(torch.uint8).copy_(raw)
    return dev, ours, theirs


def offsets(meta, base: int) -> tuple[list[int], list[int]]:
    ptrs, sizes = meta
    return [p - base for p in ptrs], list(sizes)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).flatten()


@pytest.mark.parametrize("page_size", [1, 16], ids=["page1", "page16"])
@pytest.mark.parametrize("kind, layout", CASES, ids=CASE_IDS)
def test_geometry_members(kind, layout, page_size):
    from sglang.srt.mem_cache.pool_host.base import HostKVCache

    dev, ours, theirs = ours_and_theirs(kind, layout, page_size)
    assert isinstance(ours, type(theirs)) and isinstance(ours, HostKVCache)  # SGLang's isinstance checks agree
    names = ["layout", "page_size", "page_num", "size", "logical_size", "layer_num", "target_layer_num",
             "start_layer", "end_layer", "dtype", "device", "size_per_token", "dcp_size", "dcp_rank",
             "shared_allocation_domain", "storage_format_tag", "stores_page_envelope", "pool_label",
             "token_stride_size", "layout_dim"]  # fmt: skip
    names += ["kv_lora_rank", "qk_rope_head_dim", "kv_cache_dim"] if kind == "mla" else ["head_num", "head_dim"]
    for name in names:
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.kv_buffer.shape == theirs.kv_buffer.shape
    if kind == "mha":
        assert ours.k_buffer.shape == theirs.k_buffer.shape and ours.v_buffer.shape == theirs.v_buffer.shape
    assert ours.get_size_per_token() == theirs.get_size_per_token()
    assert ours.get_ksize_per_token() == theirs.get_ksize_per_token()
    assert ours.get_page_buffer_element_size() == theirs.get_page_buffer_element_size()
    # What SGLang's controller reads to keep host indices on the CPU: hicache pools take them anywhere.
    assert ours.can_use_write_back_jit is True
    indices = torch.tensor([5, 9], dtype=torch.int64)
    assert ours.prepare_transfer_indices(indices, indices + 1, io_for(layout))[0] is indices


@pytest.mark.parametrize("page_size", [1, 16], ids=["page1", "page16"])
@pytest.mark.parametrize("kind, layout", CASES, ids=CASE_IDS)
def test_flat_pages_match_sglangs(kind, layout, page_size):
    """The L3 generic path (file, hf3fs, eic): page bytes out, page bytes in."""
    dev, ours, theirs = ours_and_theirs(kind, layout, page_size)
    for page in (0, 3, ours.page_num - 1):
        slot = page * page_size
        assert torch.equal(as_bytes(ours.get_data_page(slot)), as_bytes(theirs.get_data_page(slot))), page
    dummy, their_dummy = ours.get_dummy_flat_data_page(), theirs.get_dummy_flat_data_page()
    assert (dummy.numel(), dummy.dtype, bool(dummy.any())) == (their_dummy.numel(), their_dummy.dtype, False)
    page = theirs.get_data_page(2 * page_size).clone()
    ours.set_from_flat_data_page(torch.tensor(5 * page_size), page)  # SGLang passes a 0-d tensor slot
    theirs.set_from_flat_data_page(5 * page_size, page)
    assert torch.equal(ours.kv_buffer.view(torch.uint8), theirs.kv_buffer.view(torch.uint8))


@pytest.mark.parametrize("page_size", [1, 16], ids=["page1", "page16"])
@pytest.mark.parametrize("kind, layout", CASES, ids=CASE_IDS)
def test_page_buffer_meta_matches_sglangs(kind, layout, page_size):
    """The zero-copy L3 path (Mooncake, NIXL, hf3fs): pointers and sizes of each page's runs."""
    dev, ours, theirs = ours_and_theirs(kind, layout, page_size)
    pages = torch.tensor([1, 4, 2])
    slots = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    got = offsets(ours.get_page_buffer_meta(slots), ours.kv_buffer.data_ptr())
    assert got == offsets(theirs.get_page_buffer_meta(slots), theirs.kv_buffer.data_ptr())
    assert len(got[0]) == len(pages) * (2 * LAYERS if (kind, layout) == ("mha", "layer_first") else
                                        LAYERS if layout == "layer_first" else 2 if kind == "mha" else 1)  # fmt: skip
    for alignment in (64, 4096):  # layer_first is never "aligned" for O_DIRECT, as in SGLang
        if ours.kv_buffer.data_ptr() % alignment == 0 and theirs.kv_buffer.data_ptr() % alignment == 0:
            assert ours.is_stride_page_aligned(alignment) == theirs.is_stride_page_aligned(alignment), alignment


@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("page_size", [1, 16], ids=["page1", "page16"])
def test_split_heads_meta_matches_sglangs(page_size, split):
    """Storage shared between ranks of different TP sizes (Mooncake with tp_lcm_size): page_head only."""
    dev = mha_pool(page_size, start_layer=PP_START, head_num=4)
    dev, ours, theirs = ours_and_theirs("mha", "page_head", page_size, dev)
    slots = torch.arange(3 * page_size, 5 * page_size)
    got = offsets(ours.get_split_heads_page_buffer_meta(slots, split), ours.kv_buffer.data_ptr())
    assert got == offsets(theirs.get_split_heads_page_buffer_meta(slots, split), theirs.kv_buffer.data_ptr())
    assert len(got[0]) == 2 * split * 2  # pages x head groups x (K, V)
    assert ours.get_page_buffer_element_size(split) == theirs.get_page_buffer_element_size(split)
    for ptr, size in zip(*ours.get_split_heads_page_buffer_meta(slots, split)):  # every run lies in the buffer
        base, end = ours.kv_buffer.data_ptr(), ours.kv_buffer.data_ptr() + ours.kv_buffer.nbytes
        assert base <= ptr and ptr + size <= end


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_split_heads_meta_refused_off_page_head(layout):
    dev = mha_pool(16, head_num=4)
    dev, ours, _ = ours_and_theirs("mha", layout, 16, dev)
    with pytest.raises(ValueError, match=f"layout '{layout}' keeps .* outside the head axis within a page, so a "
                                         "group of heads is not one contiguous run; use layout 'page_head'"):
        ours.get_split_heads_page_buffer_meta(torch.arange(16), 2)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_per_layer_registration_matches_sglangs(kind):
    """PD direct-to-host: per-layer host slabs, as SGLang's MLA pool (and MHA's host_kv_data_refs) give them."""
    dev, ours, theirs = ours_and_theirs(kind, "layer_first", 16)
    if kind == "mla":
        got = ours.get_contiguous_buf_infos()
        want = theirs.get_contiguous_buf_infos()
        assert [p - ours.kv_buffer.data_ptr() for p in got[0]] == [p - theirs.kv_buffer.data_ptr() for p in want[0]]
        assert got[1:] == want[1:]
    else:
        mine, sglangs = ours.host_kv_data_refs, theirs.host_kv_data_refs
        assert [t.shape for t in mine] == [t.shape for t in sglangs] and len(mine) == 2 * LAYERS
        assert [t.data_ptr() - ours.kv_buffer.data_ptr() for t in mine] == [
            t.data_ptr() - theirs.kv_buffer.data_ptr() for t in sglangs
        ]
        assert [t.data_ptr() - ours.kv_buffer.data_ptr() for t in ours.get_hybrid_pool_buffer()] == [
            t.data_ptr() - theirs.kv_buffer.data_ptr() for t in theirs.get_hybrid_pool_buffer()
        ]
    dev, ours, _ = ours_and_theirs(kind, "page_first", 16)
    # page_first keeps a page's layers together: one region of whole pages per part
    # (SGLang's MLA pool answers per-layer views of it there, which are not regions of pages).
    ptrs, lens, items = ours.get_contiguous_buf_infos()
    page_bytes = ours.kv_buffer.nbytes // (2 if kind == "mha" else 1) // ours.page_num
    assert (lens, items) == ([ours.page_num * page_bytes] * len(ptrs), [page_bytes] * len(ptrs))
    assert [p - ours.kv_buffer.data_ptr() for p in ptrs] == [i * ours.page_num * page_bytes for i in range(len(ptrs))]
    with pytest.raises(ValueError, match="does not keep each layer in one contiguous host slab"):
        ours.host_kv_data_refs if kind == "mha" else pool_api.layer_slabs(ours.core)


def test_allocator():
    dev, ours, theirs = ours_and_theirs("mha", "page_first", 16)
    assert ours.available_size() == theirs.available_size() == ours.size
    slots = ours.alloc(32)
    assert slots.dtype == torch.int64 and slots.device.type == "cpu" and slots.tolist() == list(range(32))
    assert ours.available_size() == ours.size - 32
    with pytest.raises(ValueError, match="multiple of the page size"):
        ours.alloc(8)
    assert ours.alloc(ours.size) is None
    assert ours.free(slots) == 32
    with pytest.raises(ValueError, match="double free"):
        ours.free(slots)
    ours.alloc(16)
    ours.clear()
    assert ours.available_size() == ours.size
