"""Build SGLang's own objects (server settings, device pools, allocators) for the tests.

Nothing of SGLang is stubbed: settings go through SGLang's own hicache resolution, pools
and allocators are SGLang's classes on ``DEVICE``.
"""

from __future__ import annotations

import os

import torch

DEVICE = os.environ.get("HICACHE_TEST_DEVICE", "cpu")
LAYERS = 3
#: A pipeline-parallel rank whose device pool starts at model layer 20.
PP_START = 20

#: (layout, io backend) pairs SGLang 0.5.23 accepts and keeps after its own resolution
#: (it rewrites page_first_direct+kernel to direct, page_first+direct to page_first_direct),
#: and its controller can drive (its move_indices takes 'direct' only with these two layouts).
MHA_PAIRS = [
    ("layer_first", "kernel"),
    ("page_first", "kernel"),
    ("page_head", "kernel"),
    ("layer_first", "direct"),
    ("page_first_direct", "direct"),
]
MLA_PAIRS = [
    ("layer_first", "kernel"),
    ("page_first", "kernel"),
    ("page_first_kv_split", "kernel"),
    ("layer_first", "direct"),
    ("page_first_direct", "direct"),
]
#: Every (kind, layout, io backend) the SGLang tests drive, and their readable ids.
KIND_PAIRS = [("mha", *pair) for pair in MHA_PAIRS] + [("mla", *pair) for pair in MLA_PAIRS]
KIND_PAIR_IDS = [f"{kind}-{layout}-{io}" for kind, layout, io in KIND_PAIRS]


def publish_settings(*, layout: str, io_backend: str, page_size: int, **extra):
    """SGLang server settings, resolved by SGLang's own hicache hooks and published to this process."""
    from sglang.srt.arg_groups.hicache_hook import handle_hicache, handle_hicache_ratio_default
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    args = ServerArgs(
        model_path="dummy",
        page_size=page_size,
        enable_hierarchical_cache=True,
        hicache_mem_layout=layout,
        hicache_io_backend=io_backend,
        **extra,
    )
    args.resolve_once()  # a dummy model stops the pipeline before the hicache hooks: run them here
    handle_hicache_ratio_default(args)
    handle_hicache(args)
    set_global_server_args_for_scheduler(args)
    return args


def mha_pool(page_size: int, *, pages: int = 8, layers: int = LAYERS, start_layer: int = 0,
             head_num: int = 2, head_dim: int = 16, v_head_dim: int | None = None):  # fmt: skip
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        size=pages * page_size,
        page_size=page_size,
        dtype=torch.bfloat16,
        head_num=head_num,
        head_dim=head_dim,
        layer_num=layers,
        device=DEVICE,
        enable_memory_saver=False,
        start_layer=start_layer,
        end_layer=start_layer + layers,  # what SGLang's model runner passes: exclusive
        v_head_dim=v_head_dim,
    )


def mla_pool(page_size: int, *, pages: int = 8, layers: int = LAYERS, start_layer: int = 0):
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return MLATokenToKVPool(
        size=pages * page_size,
        page_size=page_size,
        dtype=torch.bfloat16,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        layer_num=layers,
        device=DEVICE,
        enable_memory_saver=False,
        start_layer=start_layer,
        end_layer=start_layer + layers,
    )


def device_pool(kind: str, page_size: int, **kw):
    return mla_pool(page_size, **kw) if kind == "mla" else mha_pool(page_size, **kw)


def allocator_for(pool):
    """The allocator SGLang pairs with the pool: token-granular for page size 1, else paged."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

    if pool.page_size == 1:
        return TokenToKVPoolAllocator(size=pool.size, dtype=pool.dtype, device=DEVICE, kvcache=pool, need_sort=False)
    return PagedTokenToKVPoolAllocator(size=pool.size, page_size=pool.page_size, dtype=pool.dtype, device=DEVICE,
                                       kvcache=pool, need_sort=False)  # fmt: skip


def device_layers(pool) -> list[torch.Tensor]:
    """Every per-layer device tensor of a SGLang pool (K layers then V layers, or the MLA rows)."""
    if hasattr(pool, "kv_buffer"):
        return list(pool.kv_buffer)
    return list(pool.k_buffer) + list(pool.v_buffer)


def fill_random(tensors, seed: int) -> None:
    """Random bytes in every tensor (drawn on each tensor's own device)."""
    gen = torch.Generator(device=tensors[0].device).manual_seed(seed)
    for t in tensors:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=t.device, generator=gen))


def rows(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The rows at ``indices`` as raw bytes, on the CPU."""
    return tensor[indices.to(tensor.device)].view(torch.uint8).cpu()


def synchronize() -> None:
    if DEVICE != "cpu":
        torch.cuda.synchronize()


def _mha_host(host, layout: str, component: int, layer: int, slots: torch.Tensor) -> torch.Tensor:
    kv, p = host.kv_buffer, host.page_size
    s = slots.cpu()
    if layout == "layer_first":  # (2, L, S, H, D)
        out = kv[component, layer, s]
    elif layout == "page_first":  # (2, S, L, H, D)
        out = kv[component, s, layer]
    elif layout == "page_first_direct":  # (2, P, L, p, H, D)
        out = kv[component, s // p, layer, s % p]
    elif layout == "page_head":  # (2, P, H, p, L, D)
        out = kv[component, s // p, :, s % p, layer]
    else:
        raise ValueError(layout)
    return out.contiguous().view(torch.uint8).reshape(len(s), -1)


def _mla_host(host, layout: str, layer: int, slots: torch.Tensor) -> torch.Tensor:
    p, s = host.page_size, slots.cpu()
    if layout == "layer_first":  # (L, S, 1, D)
        out = host.kv_buffer[layer, s]
    elif layout == "page_first":  # (S, L, 1, D)
        out = host.kv_buffer[s, layer]
    elif layout == "page_first_direct":  # (P, L, p, 1, D)
        out = host.kv_buffer[s // p, layer, s % p]
    elif layout == "page_first_kv_split":  # k (P, L, p, 1, kv_lora_rank), v (P, L, p, 1, rope)
        out = torch.cat([host.k_buffer[s // p, layer, s % p], host.v_buffer[s // p, layer, s % p]], dim=-1)
    else:
        raise ValueError(layout)
    return out.contiguous().view(torch.uint8).reshape(len(s), -1)


def host_rows(host, kind: str, layer: int, slots: torch.Tensor) -> list[torch.Tensor]:
    """The host bytes of ``slots`` in host layer ``layer``, read through SGLang's own buffer shapes per layout.

    An oracle independent of hicache: the indexing is SGLang's ``HostKVCache`` shapes (and what its
    transfer kernels address), so a host pool placing a byte elsewhere fails.
    """
    if kind == "mla":
        return [_mla_host(host, host.layout, layer, slots)]
    return [_mha_host(host, host.layout, c, layer, slots) for c in (0, 1)]


def device_rows(pool, kind: str, layer: int, slots: torch.Tensor) -> list[torch.Tensor]:
    """Device bytes of ``slots`` in local layer ``layer`` (K and V, or the MLA row), one row per slot."""
    tensors = [pool.kv_buffer[layer]] if kind == "mla" else [pool.k_buffer[layer], pool.v_buffer[layer]]
    return [rows(t, slots).reshape(len(slots), -1) for t in tensors]


def flat_page(kind: str, layout: str, pool, slots: torch.Tensor, kv_lora_bytes: int = 0) -> torch.Tensor:
    """The bytes of one page (``slots``, device rows of all layers) in SGLang's flat-page order.

    SGLang's host pools flatten a page as their buffer slice is laid out: MHA (2, L, p, H, D)
    for layer_first and page_first_direct, (2, p, L, H, D) for page_first, (2, H, p, L, D) for
    page_head; MLA (L, p, 1, D), or (p, L, 1, D) for page_first. page_first_kv_split (not
    flattened by SGLang) is hicache's: latent parts of (L, p), then rope parts.
    """
    layers = range(len(pool.kv_buffer) if kind == "mla" else len(pool.k_buffer))
    if kind == "mla":
        x = torch.stack([device_rows(pool, kind, layer, slots)[0] for layer in layers])  # (L, p, bytes)
        if layout == "page_first":
            x = x.permute(1, 0, 2)
        if layout == "page_first_kv_split":
            return torch.cat([x[..., :kv_lora_bytes].flatten(), x[..., kv_lora_bytes:].flatten()])
        return x.flatten()
    x = torch.stack([torch.stack(device_rows(pool, kind, layer, slots)) for layer in layers])  # (L, 2, p, bytes)
    heads = pool.k_buffer[0].shape[1]
    x = x.permute(1, 0, 2, 3).reshape(2, len(layers), len(slots), heads, -1)  # (2, L, p, H, D bytes)
    if layout == "page_first":
        x = x.permute(0, 2, 1, 3, 4)
    elif layout == "page_head":
        x = x.permute(0, 3, 2, 1, 4)
    return x.flatten()
