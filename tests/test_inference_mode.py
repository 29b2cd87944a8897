"""Servers call hicache under ``torch.inference_mode``: index tensors made there have no version counter.

Such tensors are never cached by identity (an in-place write to one could not be seen), so each call
converts them again and moves exactly the pages it names.
"""

from __future__ import annotations

import pytest
import torch

import hicache_core as hc


@pytest.mark.parametrize("io_backend", ["reference", "direct"])
def test_loads_under_inference_mode_see_in_place_index_changes(io_backend):
    if io_backend == "direct":
        pytest.importorskip("hicache_direct")
    dev = hc.MHADevicePool(64, 4, torch.float32, 2, 8, 2, "cpu")
    host = hc.make_host_pool(dev, layout="page_first_direct", io_backend=io_backend, pin_memory=False)
    g = torch.Generator().manual_seed(5)
    for t in dev.k_buffer + dev.v_buffer:
        t.copy_(torch.randn(t.shape, generator=g))
    original = [t.clone() for t in dev.k_buffer + dev.v_buffer]
    with torch.inference_mode():
        h = host.alloc(8)
        d = torch.arange(4, 12)
        assert h.is_inference() or d.is_inference()
        host.backup_from_device_all_layer(dev, h, d, io_backend)
        for t in dev.k_buffer + dev.v_buffer:
            t.zero_()
        d.copy_(torch.arange(16, 24))  # same tensor object, new rows: the next load must use them
        for layer in range(2):
            host.load_to_device_per_layer(dev, h, d, layer, io_backend)
    for got, want in zip(dev.k_buffer + dev.v_buffer, original):
        assert torch.equal(got[16:24], want[4:12])
        assert not got[4:12].any()  # the rows of the first index contents were not written again
