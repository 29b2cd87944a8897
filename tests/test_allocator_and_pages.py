"""The slot allocator, and the page-level API L3 storage backends use."""

from __future__ import annotations

import ctypes

import pytest
import torch
from core_helpers import device_pool, device_tensors, fill_random, random_page_slots, same_bytes

import hicache_core as hc


@pytest.fixture
def host(direct_only):
    return hc.make_host_pool(device_pool("mha", 4), layout="page_first_direct", io_backend="direct", size=24,
                             registry=direct_only)  # fmt: skip


def test_alloc_free_available(host):
    assert host.size == 24 and host.available_size() == 24
    a = host.alloc(8)
    assert a.tolist() == list(range(8)) and host.available_size() == 16
    b = host.alloc(16)
    assert host.alloc(4) is None  # full: SGLang returns None
    assert host.free(a) == 8 and host.available_size() == 8
    with pytest.raises(ValueError, match=r"double free: slots \[0, 1, 2, 3, 4, 5, 6, 7\] were already freed"):
        host.free(a)
    with pytest.raises(ValueError, match="The requested size should be a multiple of the page size."):
        host.alloc(3)
    with pytest.raises(ValueError, match="free\\(\\) takes whole pages"):
        host.free(b[:3])
    with pytest.raises(IndexError, match="outside the pool"):
        host.free(torch.arange(24, 28))
    host.free(b)
    assert host.available_size() == 24


def test_default_size_follows_the_device_pool(direct_only):
    dev = device_pool("mla", 4, pages=6)  # 24 tokens
    host = hc.make_host_pool(dev, layout="layer_first", io_backend="direct", registry=direct_only)
    assert host.size == 48 and host.page_num == 12  # host_to_device_ratio 2.0
    host = hc.make_host_pool(dev, layout="layer_first", io_backend="direct", host_to_device_ratio=1.0,
                             registry=direct_only)  # fmt: skip
    assert host.size == 24
    host = hc.make_host_pool(dev, layout="layer_first", io_backend="direct", size=26, registry=direct_only)
    assert host.size == 28  # whole pages


def test_a_host_pool_smaller_than_its_device_pool_is_refused(direct_only):
    dev = device_pool("mla", 4, pages=6)  # 24 tokens
    with pytest.raises(ValueError, match=r"host pool \(10 tokens\) would be smaller than its device pool \(24 tok"):
        hc.make_host_pool(dev, layout="layer_first", io_backend="direct", size=10, registry=direct_only)
    with pytest.raises(ValueError, match="smaller than its device pool"):
        hc.make_host_pool(dev, layout="layer_first", io_backend="direct", host_to_device_ratio=0.5,
                          registry=direct_only)  # fmt: skip


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_flat_data_page_round_trip(layout, direct_only):
    host = hc.make_host_pool(device_pool("mha", 4), layout=layout, io_backend="reference", size=24,
                             registry=direct_only)  # fmt: skip
    fill_random([host.kv_buffer], seed=1)
    page = host.get_data_page(8)
    assert page.numel() == 2 * 3 * 4 * 2 * 8 and page.dtype == torch.bfloat16
    expected = {
        "layer_first": host.kv_buffer[:, :, 8:12],
        "page_first": host.kv_buffer[:, 8:12],
        "page_first_direct": host.kv_buffer[:, 2],
        "page_head": host.kv_buffer[:, 2],
    }[layout]
    assert same_bytes(page, expected.flatten())
    other = host.get_data_page(4).clone()
    host.set_from_flat_data_page(12, other)
    assert same_bytes(host.get_data_page(12), other)
    assert same_bytes(host.get_data_page(8), page)  # neighbours untouched
    with pytest.raises(ValueError, match="a flat page here is 384 elements"):
        host.set_from_flat_data_page(0, other[:10])
    assert host.get_dummy_flat_data_page().numel() == page.numel()


def _read(ptr: int, nbytes: int) -> bytes:
    return ctypes.string_at(ptr, nbytes)


@pytest.mark.parametrize(
    "kind, layout, runs_per_page",
    [("mha", "layer_first", 6), ("mha", "page_first", 2), ("mha", "page_first_direct", 2), ("mha", "page_head", 2),
     ("mla", "page_first_kv_split", 2), ("mha_asym", "page_first", 2), ("page_rows", "page_first", 1)],
)  # fmt: skip
def test_page_buffer_meta_points_at_the_page(kind, layout, runs_per_page, direct_only):
    dev = device_pool(kind, 4)
    host = hc.make_host_pool(dev, layout=layout, io_backend="reference", size=24, registry=direct_only)
    fill_random(device_tensors(dev), seed=1)
    h, d = random_page_slots(4, 2, 4, seed=2), random_page_slots(6, 2, 4, seed=3, first=1)
    host.backup_from_device_all_layer(dev, h, d, "reference")
    ptrs, sizes = host.get_page_buffer_meta(h)
    assert len(ptrs) == len(sizes) == 2 * runs_per_page
    total = sum(t.numel() * t.element_size() for t in host.plan.host_buffers.values()) // host.page_num
    assert sum(sizes[:runs_per_page]) == total
    # In memory order within each buffer, the runs spell the page exactly as get_data_page does.
    buffers = list(host.plan.host_buffers.values())

    def where(ptr: int) -> tuple[int, int]:
        b = next(i for i, t in enumerate(buffers) if t.data_ptr() <= ptr < t.data_ptr() + t.numel() * t.element_size())
        return b, ptr

    first = sorted(zip(ptrs[:runs_per_page], sizes[:runs_per_page]), key=lambda run: where(run[0]))
    page_bytes = b"".join(_read(p, n) for p, n in first)
    flat = host.get_data_page(int(h[0]))
    assert page_bytes == bytes(flat.reshape(-1).view(torch.uint8).tolist())


def test_page_buffer_meta_lists_k_and_v_of_a_layer_together_like_sglang(direct_only):
    host = hc.make_host_pool(device_pool("mha", 4), layout="layer_first", io_backend="reference", size=24,
                             registry=direct_only)  # fmt: skip
    ptrs, sizes = host.get_page_buffer_meta(torch.arange(8, 12))
    kv = host.kv_buffer  # (2, L, S, H, D)
    expected = [kv[c, layer, 8].data_ptr() for layer in range(3) for c in range(2)]
    assert ptrs == expected and sizes == [4 * 2 * 8 * 2] * 6
