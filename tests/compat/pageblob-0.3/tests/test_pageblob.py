"""The plugin as users meet it: found through its entry point, its layout allocated, dispatch reaching it."""

from __future__ import annotations

import torch

import hicache_core as hc


def test_the_entry_point_loads_it_cleanly():
    record = hc.get_registry().plugins["pageblob"]
    assert record.distribution == "hicache-pageblob" and record.status == "loaded" and not record.errors
    assert record.layouts == ["page_blob_direct"]
    assert record.implementations == ["pageblob.gather"]
    assert record.hooks == ["hicache_register_backends", "hicache_register_layouts"]


def test_dispatch_reaches_the_blob_backend_for_the_new_layout():
    dev = hc.MHADevicePool(256, 16, torch.bfloat16, 4, 32, 3, "cpu")
    host = hc.make_host_pool(dev, layout="page_blob_direct", io_backend="blob", size=512)
    assert set(host.implementations.values()) == {"pageblob.gather"}
    # (P, 2, L, p, H, D), straight from the declaration
    assert tuple(host.kv_buffer.shape) == (32, 2, 3, 16, 4, 32)


def test_a_page_is_one_contiguous_blob():
    dev = hc.MHADevicePool(256, 16, torch.bfloat16, 4, 32, 3, "cpu")
    host = hc.make_host_pool(dev, layout="page_blob_direct", io_backend="blob", size=512)
    ptrs, sizes = host.get_page_buffer_meta(torch.arange(32, 48))
    assert len(ptrs) == 1 and sizes == [2 * 3 * 16 * 4 * 32 * 2]


def test_mla_pools_store_without_a_component_axis():
    dev = hc.MLADevicePool(128, 64, torch.bfloat16, 512, 64, 2, "cpu")
    host = hc.make_host_pool(dev, layout="page_blob_direct", io_backend="blob", size=256)
    assert tuple(host.kv_buffer.shape) == (4, 2, 64, 1, 576)


def test_the_other_io_backends_can_serve_the_new_layout_too():
    # the layout is data: the direct plugin judges it by its strides, with no change to either plugin
    dev = hc.MHADevicePool(256, 16, torch.bfloat16, 4, 32, 3, "cpu")
    registry = hc.get_registry()
    if "direct.copy_engine" in registry.implementations:
        host = hc.make_host_pool(dev, layout="page_blob_direct", io_backend="direct", size=512)
        assert set(host.implementations.values()) == {"direct.copy_engine"}
