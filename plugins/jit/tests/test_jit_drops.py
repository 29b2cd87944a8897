"""Indices the jit kernels mask are reported: the host pool's next call raises DroppedIndicesError naming the call.

See :mod:`hicache_core.pool.drops`: the faulty call returns and moves every valid pair; the next call on
the pool raises before moving anything; a good call after that works.
"""

from __future__ import annotations

import pytest
import torch
from hicache_jit import VARIANTS

import hicache_core as hc
from hicache_core.testing.guarded import check_reported_at_next_call

ONE_LAYER = [hc.LOAD, hc.BACKUP_LAYER]


def _pools(kind: str, layout: str, device: str, variant: str):
    if kind == "mla":
        dev = hc.MLADevicePool(28, 4, torch.bfloat16, 16, 8, 3, device)
    else:
        dev = hc.MHADevicePool(28, 4, torch.bfloat16, 2, 8, 3, device, v_head_dim=4)
    kw = dict(layout=layout, size=32, operations=ONE_LAYER, validate=False)
    host = hc.make_host_pool(dev, io_backend="kernel", implementation="jit.one_layer", **kw)
    host.implementation_for(hc.LOAD).variant = variant
    return dev, host, hc.make_host_pool(dev, io_backend="reference", **kw)


@pytest.mark.parametrize("op", ONE_LAYER)
@pytest.mark.parametrize("kind, layout", [("mla", "page_first"), ("mha_asym", "page_first_direct")])
def test_dropped_indices_raise_at_the_next_call(kind, layout, op, jit_device):
    dev, host, ref = _pools(kind, layout, jit_device, "rows")
    check_reported_at_next_call(host, ref, dev, op, 2)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_reports(variant, jit_device):
    dev, host, ref = _pools("mla", "page_first_direct", jit_device, variant)
    check_reported_at_next_call(host, ref, dev, hc.LOAD, 1)
