"""SGLang's own DSA device pools (plain and context-parallel LayerSplit) and its DSA stack, for the family tests.

The pools are SGLang's classes on ``DEVICE``. A LayerSplit pool reads the attention
context-parallel group at construction (to set up its layer broadcast); a test runs as one
rank of that group, so the group is stated through SGLang's own override as a group of one
(no broadcast communicator is made, exactly as SGLang does for a single rank). Nothing of the
pools' allocation is patched.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from types import SimpleNamespace

import torch
from sglang_setup import DEVICE, fill_random, rows

#: SGLang's DSA keeps 64-token physical pages on CUDA.
DSA_PAGE = 64
DSA_LAYERS = 4
SHARDS = 2


@contextmanager
def single_rank_cp_group():
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_cp_group=SimpleNamespace(world_size=1, pynccl_comm=None)):
        yield


def dsa_pool(*, pages: int = 4, layers: int = DSA_LAYERS, shard_rank: int | None = None,
             skip_topk: list[bool] | None = None, start_layer: int = 0):  # fmt: skip
    """SGLang's ``DSATokenToKVPool`` (bf16 MLA rows of 32 + 16, 128-wide index keys), or its LayerSplit subclass."""
    from sglang.srt.mem_cache.dsa_cache_layer_split import LayerSplitDSATokenToKVPool
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    kw = dict(size=pages * DSA_PAGE, page_size=DSA_PAGE, kv_lora_rank=32, dtype=torch.bfloat16, qk_rope_head_dim=16,
              layer_num=layers, device=DEVICE, index_head_dim=128, enable_memory_saver=False, kv_cache_dim=48,
              start_layer=start_layer, end_layer=start_layer + layers, skip_topk_layers=skip_topk)  # fmt: skip
    if shard_rank is None:
        return DSATokenToKVPool(**kw)
    with single_rank_cp_group():
        return LayerSplitDSATokenToKVPool(**kw, layer_shard_rank=shard_rank, layer_shard_size=SHARDS)


def dsa_stack(pool, drafts: tuple = ()):
    """SGLang's DSA strategy (``_DsaStrategy.build``): its host pool group and its ``HybridCacheController``."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _DsaStrategy
    from sglang_setup import allocator_for

    allocator = allocator_for(pool)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator,
                             page_size=pool.page_size, mtp_draft_device_pools=drafts)  # fmt: skip
    result = _DsaStrategy().build(cache=None, kvcache=pool, params=params, server_args=None,
                                  load_cache_event=threading.Event())  # fmt: skip
    return result.host_pool_group, result.cache_controller, allocator


def owned_layers(pool) -> list[int]:
    start, end = pool._owned_local_layer_range() if getattr(pool, "layer_shard_enabled", False) else (0, pool.layer_num)
    return list(range(start, end))


def fill_dsa(pools, seed: int) -> None:
    tensors = [t for p in pools for t in list(p.kv_buffer) + list(p.index_k_with_scale_buffer) if t.numel()]
    fill_random(tensors, seed)


def index_rows(pool, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """The device page rows of the pages ``slots`` cover (whole pages), as bytes."""
    pages = slots.reshape(-1, pool.page_size)[:, 0] // pool.page_size
    return rows(pool.index_k_with_scale_buffer[layer], pages)


def host_index_rows(host, host_layer: int, slots: torch.Tensor) -> torch.Tensor:
    """SGLang's DSA host shapes: layer_first ``(L, pages, stride)``; page_first(_direct) ``(pages, L, 1, stride)``."""
    pages = (slots.reshape(-1, host.page_size)[:, 0] // host.page_size).cpu()
    buf = host.index_k_with_scale_buffer
    out = buf[host_layer, pages] if host.layout == "layer_first" else buf[pages, host_layer, 0]
    return out.contiguous().view(torch.uint8)
