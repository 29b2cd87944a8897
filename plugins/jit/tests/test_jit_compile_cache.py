"""Kernels are specialised per key, built on first use, and a repeated key builds nothing."""

from __future__ import annotations

import hicache_jit
import torch
from jit_helpers import fill_random, small_pool

import hicache_core as hc


def _odd_pool(device: str, head_dim: int):
    """A shape no other test uses (so its keys are new here): MHA, 3 heads of ``head_dim`` bf16."""
    return hc.MHADevicePool(24, 4, torch.bfloat16, 3, head_dim, 2, device)


def _host(dev):
    return hc.make_host_pool(dev, layout="page_first", io_backend="kernel", operations=[hc.LOAD, hc.BACKUP_LAYER],
                             implementation="jit.one_layer", size=32)  # fmt: skip


def test_second_call_with_the_same_key_compiles_nothing(jit_device):
    dev = _odd_pool(jit_device, head_dim=40)
    host = _host(dev)
    fill_random([t for p in host.plan.parts for t in p.device_layers], 0)
    h = torch.arange(8, device=jit_device)
    before = hicache_jit.compile_count()
    host.load_to_device_per_layer(dev, h, h + 8, 0, "kernel")
    assert hicache_jit.compile_count() == before + 1, "the first call builds its specialisation"
    new = hicache_jit.compiled_keys()[-1]
    assert new.kernel in ("rows", "flat") and new.to_device and new.host_index_dtype == "int64"
    assert dict(new.constexprs)["A_PAGE"] > 0
    seconds = hicache_jit.compile_seconds()[new]
    assert seconds > 0

    host.load_to_device_per_layer(dev, h, h + 8, 1, "kernel")  # same key, other layer and indices
    host.load_to_device_per_layer(dev, h[:3], h[:3], 0, "kernel")
    assert hicache_jit.compile_count() == before + 1
    assert hicache_jit.compile_seconds()[new] == seconds  # recorded once, at the first call

    # A second pool of the same shape (other memory, other size) reuses the kernel too.
    dev2 = _odd_pool(jit_device, head_dim=40)
    host2 = hc.make_host_pool(dev2, layout="page_first", io_backend="kernel", operations=[hc.LOAD],
                              implementation="jit.one_layer", size=32)  # fmt: skip
    host2.load_to_device_per_layer(dev2, h, h, 1, "kernel")
    assert hicache_jit.compile_count() == before + 1

    # Another direction, another index dtype or another shape is another key.
    host.backup_from_device_per_layer(dev, h, h, 0, "kernel")
    assert hicache_jit.compile_count() == before + 2
    host.load_to_device_per_layer(dev, h.int(), h.int(), 0, "kernel")
    assert hicache_jit.compile_count() == before + 3
    dev3 = _odd_pool(jit_device, head_dim=48)
    host3 = _host(dev3)
    host3.load_to_device_per_layer(dev3, h, h, 0, "kernel")
    assert hicache_jit.compile_count() == before + 4
    keys = hicache_jit.compiled_keys()
    assert len(set(keys)) == len(keys)


def test_nothing_is_built_at_pool_construction_and_warmup_builds_both_directions(jit_device):
    before = hicache_jit.compile_count()
    host = _host(_odd_pool(jit_device, head_dim=56))
    assert hicache_jit.compile_count() == before
    impl = host.implementation_for(hc.LOAD)
    impl.warmup((torch.int64, torch.int32))
    assert hicache_jit.compile_count() == before + 4  # 2 directions x 2 index dtypes
    impl.warmup((torch.int64, torch.int32))
    assert hicache_jit.compile_count() == before + 4


def test_tuning_changes_the_key(jit_device):
    host = _host(small_pool("mla", jit_device))
    impl = host.implementation_for(hc.LOAD)
    h = torch.arange(4, device=jit_device)
    warps = impl.num_warps
    impl.load_to_device_per_layer(h, h, 0)
    before = hicache_jit.compile_count()
    impl.load_to_device_per_layer(h, h, 0)
    assert hicache_jit.compile_count() == before
    impl.num_warps = warps // 2
    impl.load_to_device_per_layer(h, h, 0)
    assert hicache_jit.compile_count() == before + 1
    key = hicache_jit.compiled_keys()[-1]
    assert key.num_warps == warps // 2 and str(key).startswith(("rows/h2d", "flat/h2d"))
    impl.num_warps = warps  # back to a key already built
    impl.load_to_device_per_layer(h, h, 0)
    assert hicache_jit.compile_count() == before + 1
