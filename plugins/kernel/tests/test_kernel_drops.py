"""Indices the kernel masks are reported: the host pool's next call raises DroppedIndicesError naming the call.

Without ``HICACHE_VALIDATE`` the pool passes indices to the kernel unchecked; the kernel masks
out-of-range ones (no memory outside the pools is touched) and stores the call's number in the
pool's drop word, so the faulty call itself returns and moves every valid pair, and the next
call on the pool raises before moving anything (:mod:`hicache_core.pool.drops`).
"""

from __future__ import annotations

import pytest
import torch

import hicache_core as hc
from hicache_core.pool.drops import DroppedIndicesError
from hicache_core.testing.guarded import check_reported_at_next_call

OPS = [(hc.LOAD, 1), (hc.BACKUP_LAYER, 2), (hc.BACKUP_ALL, None)]


def _pools(kind: str, layout: str, device: str):
    if kind == "mla":
        dev = hc.MLADevicePool(28, 4, torch.bfloat16, 16, 8, 3, device)
    else:
        dev = hc.MHADevicePool(28, 4, torch.bfloat16, 2, 8, 3, device)
    kw = dict(layout=layout, size=32, operations=hc.OPERATIONS, validate=False)
    return dev, hc.make_host_pool(dev, io_backend="kernel", **kw), hc.make_host_pool(dev, io_backend="reference", **kw)


@pytest.mark.parametrize("op, layer_id", OPS, ids=[op for op, _ in OPS])
@pytest.mark.parametrize("kind, layout", [("mla", "page_first"), ("mha", "page_head")])
def test_dropped_indices_raise_at_the_next_call(kind, layout, op, layer_id, kernel_device):
    dev, host, ref = _pools(kind, layout, kernel_device)
    assert set(host.implementations.values()) == {"kernel.triton_uva"}
    check_reported_at_next_call(host, ref, dev, op, layer_id)


def test_check_dropped_waits_for_the_device(kernel_device):
    dev, host, _ = _pools("mla", "layer_first", kernel_device)
    where = host.plan.device
    host.load_to_device_per_layer(dev, torch.tensor([0, 99], device=where), torch.tensor([1, 2], device=where), 1,
                                  "kernel")  # fmt: skip
    with pytest.raises(DroppedIndicesError) as err:
        host.check_dropped()
    assert "load_to_device_per_layer" in str(err.value) and "layer_id 1" in str(err.value)
    host.check_dropped()  # reported once
