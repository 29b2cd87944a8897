"""The five errors this project began with, inside SGLang 0.5.23.

Each stack is built by SGLang's own code (its device pool classes, its assembler entry
points) with the adapter installed, and SGLang's controllers drive it. 000, 001 and 004
move bytes exactly; 002 and 003 are refused when SGLang builds the pool, with hicache's
``UnsupportedCombinationError`` naming what would work, never SGLang's ``ValueError`` at the
first transfer.
"""

from __future__ import annotations

import threading

import pytest
import torch
from family_setup import dsa_pool, dsa_stack, owned_layers
from sglang_setup import (
    LAYERS,
    allocator_for,
    device_layers,
    device_rows,
    fill_random,
    host_rows,
    mha_pool,
    publish_settings,
    synchronize,
)


def asym_host_rows(host, layer: int, slots: torch.Tensor) -> list[torch.Tensor]:
    """SGLang's AsymmetricMHATokenToKVPoolHost, page_first_direct: K (P, L, p, H, D) and V (P, L, p, H, Dv)."""
    p, s = host.page_size, slots.cpu()
    return [b[s // p, layer, s % p].contiguous().view(torch.uint8).reshape(len(s), -1)
            for b in (host.k_buffer, host.v_buffer)]  # fmt: skip


def hicache_controller(host, dev, io_backend):
    from sglang.srt.managers.cache_controller import HiCacheController

    return HiCacheController(token_to_kv_pool_allocator=allocator_for(dev), mem_pool_host=host,
                             page_size=dev.page_size, tp_group=None, load_cache_event=threading.Event(),
                             io_backend=io_backend)  # fmt: skip


@pytest.mark.parametrize("asked", ["as-resolved", "as-asked"])
def test_seed_000_asymmetric_mha_page_first_direct_kernel_load_one_layer(asked):
    """MHA with head_dim != v_head_dim, layout page_first_direct, io backend kernel: load layer by layer.

    SGLang's resolution turns page_first_direct + kernel into direct (it logs so); "as-asked"
    keeps the io backend the seed asks for (SGLang's own memory-settings override), and
    hicache's kernel plugin serves it.
    """
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
    from sglang.srt.runtime_context import get_memory

    publish_settings(layout="page_first_direct", io_backend="kernel", page_size=16)
    io_backend = "kernel" if asked == "as-asked" else get_memory().hicache_io_backend
    assert asked == "as-asked" or io_backend == "direct"  # SGLang's own rewrite
    with get_memory().override(hicache_io_backend=io_backend):
        dev = mha_pool(16, head_dim=32, v_head_dim=16)
        host = hybrid_pool_assembler.build_kv_host_pool(kv_pool=dev, page_size=16, use_mla=False)
        assert host.core.geometry.kind == "mha_asym" and host.io_backend == io_backend
        controller = hicache_controller(host, dev, io_backend)
        fill_random(device_layers(dev), seed=100)
        device_indices = controller.mem_pool_device_allocator.alloc(3 * 16)
        written = [device_rows(dev, "mha", layer, device_indices) for layer in range(LAYERS)]
        host_indices = controller.write(device_indices, node_id=1)
        controller.ack_write_queue.pop().finish_event.synchronize()
        load_indices = controller.load(host_indices, node_id=2)
        fill_random(device_layers(dev), seed=101)
        controller.start_loading()  # the controller's load stream: one load_to_device_per_layer per layer
        controller.ack_load_queue.pop().finish_event.synchronize()
        synchronize()
    for layer in range(LAYERS):
        assert all(torch.equal(h, d) for h, d in zip(asym_host_rows(host, layer, host_indices), written[layer]))
        assert all(torch.equal(a, b) for a, b in zip(device_rows(dev, "mha", layer, load_indices), written[layer]))


@pytest.mark.parametrize("shard_rank", [0, 1])
def test_seed_001_layer_sharded_mla_backup_page_first_kv_split(shard_rank):
    """A context-parallel LayerSplit DSA pool's MLA rows, layout page_first_kv_split, kernel: back up, load back.

    SGLang's own MLA host pool refuses this backup ("Layer-sharded HiCache backup does not
    support layout: page_first_kv_split"). Built through SGLang's ``build_kv_only_stack``.
    """
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_only_stack

    publish_settings(layout="page_first_kv_split", io_backend="kernel", page_size=64)
    pool = dsa_pool(shard_rank=shard_rank)
    allocator = allocator_for(pool)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator,
                             page_size=64)  # fmt: skip
    group, controller = build_kv_only_stack(params=params, kv_pool=pool,
                                            full_layer_mapping={i: i for i in range(pool.layer_num)},
                                            load_cache_event=threading.Event(), storage_backend=None,
                                            use_mla=True)  # fmt: skip
    host = group.get_pool(PoolName.KV)
    owned = owned_layers(pool)
    assert host.layer_shard_enabled and host.layer_num == len(owned) and host.layout == "page_first_kv_split"
    assert host.implementations["backup_from_device_per_layer"]
    fill_random([t for t in pool.kv_buffer if t.numel()], seed=110)
    device_indices = allocator.alloc(2 * 64)
    written = {layer: device_rows(pool, "mla", layer, device_indices)[0] for layer in owned}
    host_indices = controller.write(device_indices, node_id=1)
    controller.ack_write_queue.pop().finish_event.synchronize()
    synchronize()
    for host_layer, layer in enumerate(owned):
        assert torch.equal(host_rows(host, "mla", host_layer, host_indices)[0], written[layer]), layer
    load_indices = controller.load(host_indices, node_id=2)
    fill_random([t for t in pool.kv_buffer if t.numel()], seed=111)
    controller.start_loading()
    controller.ack_load_queue.pop().finish_event.synchronize()
    synchronize()
    for layer in owned:
        assert torch.equal(device_rows(pool, "mla", layer, load_indices)[0], written[layer]), layer


def test_seed_002_v4_paged_unsupported_io_backend_refused_at_construction():
    """DeepSeek-V4 paged pools with an io backend nobody implements ("kdma"): refused when SGLang builds them.

    SGLang's own pool would raise ``Unsupported V4 paged host layout/backend: page_first/kdma``
    at the first backup.
    """
    from test_dsv4 import v4_pool, v4_stack

    from hicache_core import UnsupportedCombinationError

    publish_settings(layout="page_first", io_backend="kdma", page_size=256)
    pool = v4_pool()
    with pytest.raises(UnsupportedCombinationError) as caught:
        v4_stack(pool)
    message = str(caught.value)
    assert "io backend 'kdma'" in message and "pool kind    dsv4_paged" in message
    assert "Valid io backends: auto, direct, kernel, reference" in message
    assert "io backends for layout 'page_first': 'direct', 'kernel'" in message
    assert "--hicache-mem-layout page_first --hicache-io-backend kdma" in "\n".join(caught.value.__notes__)


@pytest.mark.parametrize("io_backend", ["memcpy", "None"])
def test_seed_003_asymmetric_mha_unknown_io_backend_refused_at_construction(io_backend):
    """Asymmetric MHA, io backend "memcpy" (or a missing one): refused when SGLang builds the pool, listing io backends.

    SGLang's own pool would raise ``Unsupported IO backend for models with head_dim !=
    v_head_dim: memcpy`` at the first load.
    """
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler

    from hicache_core import UnsupportedCombinationError

    publish_settings(layout="page_first_direct", io_backend=io_backend, page_size=16)
    with pytest.raises(UnsupportedCombinationError) as caught:
        hybrid_pool_assembler.build_kv_host_pool(kv_pool=mha_pool(16, head_dim=32, v_head_dim=16), page_size=16,
                                                 use_mla=False)  # fmt: skip
    message = str(caught.value)
    assert f"io backend {io_backend!r}" in message and "mha_asym" in message
    assert "io backends for layout 'page_first_direct':" in message and "'direct'" in message


@pytest.mark.parametrize("shard_rank", [0, 1])
def test_seed_004_layer_sharded_dsa_indexer_page_first_kernel(shard_rank):
    """A LayerSplit DSA indexer, layout page_first, kernel, backed up per owned layer, then loaded back.

    SGLang's own DSA indexer pool refuses this backup ("Layer-sharded DSA indexer HiCache
    backup with page_first layout is not supported without a per-layer LF->PF kernel").
    """
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from test_dsa import round_trip  # the sidecar PoolTransfer SGLang's radix tree sends, through its controller

    publish_settings(layout="page_first", io_backend="kernel", page_size=64)
    pool = dsa_pool(shard_rank=shard_rank)
    group, controller, allocator = dsa_stack(pool)
    index_host = group.get_pool(PoolName.INDEXER)
    assert index_host.layer_shard_enabled and index_host.layout == "page_first"
    assert index_host.implementations["backup_from_device_per_layer"]
    round_trip(pool, group, controller, allocator)
