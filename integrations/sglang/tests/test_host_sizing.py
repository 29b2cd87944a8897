"""``hicache size`` against the host pools SGLang's own builders then make through the adapter, byte for byte.

An MHA and an MLA KV pool (``build_kv_host_pool``), and a Qwen3-Next-style hybrid's KV and Mamba state pools
(``build_hybrid_mamba_stack``, its state shaped by SGLang's ``Mamba2StateShape.create`` exactly as SGLang's
``Qwen3NextConfig`` calls it), each sized by SGLang's ``--hicache-ratio`` from the device pool.
"""

from __future__ import annotations

import threading

import pytest
import torch
from sglang_setup import DEVICE, LAYERS, allocator_for, mha_pool, mla_pool, publish_settings

from hicache_core.tools.sizing import size_host_tier

PAGE = 16


def _same(report_pool, core) -> None:
    assert core.host_memory.buffers == report_pool.memory.buffers
    assert (core.size, core.host_memory.mapped) == (report_pool.slots, report_pool.memory.mapped)
    assert core.get_size_per_token() == report_pool.host_bytes_per_unit


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
def test_an_mha_and_an_mla_server_pool_equal_the_report(layout):
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler

    io = "direct" if layout == "page_first_direct" else "kernel"
    publish_settings(layout=layout, io_backend=io, page_size=PAGE, hicache_ratio=3.0)
    mha = {"num_hidden_layers": LAYERS, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
           "hidden_size": 32, "torch_dtype": "bfloat16"}  # fmt: skip
    mla = {"num_hidden_layers": LAYERS, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "torch_dtype": "bfloat16"}
    for config, dev in ((mha, mha_pool(PAGE)), (mla, mla_pool(PAGE))):
        ours = hybrid_pool_assembler.build_kv_host_pool(kv_pool=dev, page_size=PAGE, use_mla="kv_lora_rank" in config)
        report = size_host_tier(config, layout=layout, page_size=PAGE, hicache_ratio=3.0, device_tokens=dev.size,
                                device="cpu")  # fmt: skip
        _same(report.pools[0], ours.core)


def test_a_hybrid_servers_kv_and_mamba_pools_equal_the_report():
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool

    config = {"num_hidden_layers": 4, "full_attention_interval": 2, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 16, "hidden_size": 32, "linear_num_key_heads": 2,
              "linear_key_head_dim": 8, "linear_num_value_heads": 4, "linear_value_head_dim": 8,
              "linear_conv_kernel_dim": 4, "torch_dtype": "bfloat16"}  # fmt: skip
    publish_settings(layout="page_first", io_backend="kernel", page_size=1, hicache_ratio=2.0)
    key_dim, value_dim = 2 * 8, 4 * 8
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=value_dim, n_groups=2, num_heads=4,
                                    head_dim=8, state_size=8, conv_kernel=4,
                                    conv_shard_groups=[key_dim, key_dim, value_dim])  # fmt: skip
    params = Mamba2CacheParams(shape=shape, layers=[0, 2],
                               dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32))  # fmt: skip
    req = HybridReqToTokenPool(size=4, mamba_size=6, mamba_spec_state_size=0, max_context_len=64, device=DEVICE,
                               enable_memory_saver=False, cache_params=params, mamba_layer_ids=[0, 2],
                               enable_mamba_extra_buffer=False)  # fmt: skip
    kv = HybridLinearKVPool(size=64, dtype=torch.bfloat16, page_size=1, head_num=2, head_dim=16,
                            full_attention_layer_ids=[1, 3], device=DEVICE, mamba_pool=req.mamba_pool)  # fmt: skip
    init = CacheInitParams(disable=False, req_to_token_pool=req, token_to_kv_pool_allocator=allocator_for(kv),
                           page_size=1)  # fmt: skip
    group, _, _ = hybrid_pool_assembler.build_hybrid_mamba_stack(
        params=init, decls=kv.host_pool_decls(), mamba_pool=req.mamba_pool, full_layer_mapping={1: 0, 3: 1},
        start_layer=0, load_cache_event=threading.Event(), storage_backend=None, use_mla=False, qsa_pool=None,
    )  # fmt: skip
    report = size_host_tier(config, layout="page_first", page_size=1, hicache_ratio=2.0, device_tokens=kv.size,
                            mamba_slots=req.mamba_pool.size, device="cpu")  # fmt: skip
    kv_pool, mamba_pool = report.pools
    _same(mamba_pool, group.get_pool(PoolName.MAMBA).core)
    assert mamba_pool.host_bytes_per_unit == 2 * (4 * 8 * 8 * 4 + (2 * key_dim + value_dim) * 3 * 2)
    _same(kv_pool, group.get_pool(PoolName.KV).core)
