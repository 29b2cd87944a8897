"""``build_kv_host_pool`` for SGLang 0.5.23, building hicache pools.

SGLang builds every KV host pool (the radix tree's, the hybrid stacks', the decode-offload
one) in ``sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler.build_kv_host_pool``.
:func:`build_kv_host_pool` takes its place with the same keyword arguments. Layout, io
backend, ratio and size come from SGLang's own resolved server settings
(``--hicache-mem-layout``, ``--hicache-io-backend``, ``--hicache-ratio``,
``--hicache-size``); the device buffers come from SGLang's own description of them
(``kv_pool.get_device_pool_infos()``). What this adapter cannot serve is refused here, with
:class:`~hicache_sglang.NotServedError`, or by hicache's dispatcher with
``UnsupportedCombinationError``, before any byte moves.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import hicache_core as hc

# ``1`` makes every KV host pool validate indices and layer ownership on each call, which SGLang cannot
# pass through: make_host_pool reads it (the one reading); the name stays importable from here.
from hicache_core.pool.host_pool import ENV_VALIDATE as ENV_VALIDATE

from . import layers, metrics, scales
from .errors import NotServedError
from .host_memory import sglang_budget
from .identity import log_pool
from .pool import DeviceView, SGLangHostPool, SGLangMHAHostPool, SGLangMLAHostPool

#: The layouts SGLang 0.5.23's controller can prepare indices for under io backend 'direct'.
DIRECT_LAYOUTS = ("layer_first", "page_first_direct")


def check_layout_io(layout: str, io_backend: str, label: str) -> None:
    """Refuse a layout SGLang's controller cannot drive with ``io_backend`` (at start-up and at pool build).

    :raises NotServedError: io backend ``direct`` with a layout other than ``DIRECT_LAYOUTS``.
    """
    if io_backend == "direct" and layout not in DIRECT_LAYOUTS:
        raise NotServedError(
            f"SGLang's cache controller prepares indices for io backend 'direct' only with layouts "
            f"{' and '.join(DIRECT_LAYOUTS)} (HiCacheController.move_indices raises for any other at the first "
            f"write), so the {label} could never be driven. Use --hicache-io-backend kernel, or layout "
            "page_first_direct or layer_first."
        )


def build_kv_host_pool(
    *,
    kv_pool: Any,
    page_size: int,
    use_mla: bool | None = None,
    override_kv_cache_dim: int | None = None,
    host_size: float | None = None,
    mtp_draft_device_pools: tuple[Any, ...] = (),
    pool_label: str = "kv",
    host_token_capacity: int | None = None,
) -> SGLangHostPool:
    """Build the hicache host pool SGLang asked for (same arguments as SGLang's function).

    ``host_token_capacity`` (not SGLang's argument; the draft builder's) sizes the pool to
    exactly that many slots, as SGLang's ``HostKVCache`` does for a pool on another's slots.

    :raises NotServedError: a pool or setting this adapter does not serve.
    :raises hicache_core.UnsupportedCombinationError: no installed hicache plugin serves the
        layout and io backend asked for.
    """
    from sglang.srt.runtime_context import get_memory

    memory = get_memory()
    layout, io_backend = memory.hicache_mem_layout, memory.hicache_io_backend
    label = f"{pool_label!r} host pool ({type(kv_pool).__name__}, layout {layout!r}, io backend {io_backend!r})"
    check_layout_io(layout, io_backend, label)
    drafts = tuple(mtp_draft_device_pools)
    use_mla, layer_shard = _refuse_unserved(kv_pool, use_mla, drafts, label)
    dev = _device_side(kv_pool, use_mla, drafts, override_kv_cache_dim, layout, page_size, label)
    capacity = kv_pool.size if kv_pool.host_capacity_tokens is None else kv_pool.host_capacity_tokens
    view, draft_views = _views(kv_pool, dev, page_size, capacity)
    bytes_per_token = _bytes_per_token(dev.buffers, len(dev.owned) + len(drafts))
    if dev.scaled is not None:
        bytes_per_token += scales.scale_bytes_per_token(dev.scaled)
    if host_token_capacity is None:
        tokens = _host_tokens(memory, host_size, capacity, page_size, bytes_per_token)
    else:  # a sidecar on another pool's slots (SGLang's non-packed drafts): exactly that many, no padding page
        tokens = _exact_tokens(host_token_capacity, page_size, label)
    layer_map = layers.device_layers(kv_pool, device_layer_num=dev.device_layer_num, kept=dev.owned, draft_pools=drafts)
    if dev.scaled is not None:  # first: its layout and io backend are the narrower ones
        scale_core = scales.make_scale_core(dev.scaled, layout=layout, io_backend=io_backend, tokens=tokens,
                                            label=label, layer_map=layer_map)  # fmt: skip
    core = hc.make_host_pool(view, layout=layout, io_backend=io_backend, page_size=page_size, size=tokens,
                             draft_pools=draft_views, label=label, host_memory_check=sglang_budget(label),
                             layer_map=layer_map)  # fmt: skip
    metrics.start()  # hicache's figures beside SGLang's /metrics, when SGLang's metrics are on
    common = dict(sglang_start_layer=kv_pool.start_layer, sglang_end_layer=kv_pool.end_layer,
                  device_capacity_tokens=capacity, pool_label=pool_label, layer_shard=layer_shard)  # fmt: skip
    if use_mla:
        info = dev.info
        pool = SGLangMLAHostPool(core, kv_lora_rank=info.kv_lora_rank, qk_rope_head_dim=info.qk_rope_head_dim,
                                 kv_cache_dim=info.kv_cache_dim, packed_fp8=info.packed_fp8, **common)  # fmt: skip
        return log_pool(pool)
    if dev.scaled is not None:
        return log_pool(scales.SGLangScaledMHAHostPool(core, scale_core=scale_core, **common))
    return log_pool(SGLangMHAHostPool(core, **common))


class _DeviceSide(NamedTuple):
    """What the host pool mirrors of a SGLang KV pool: its buffers as hicache reads them, and its layers."""

    kind: str
    info: Any
    buffers: dict[str, list]
    draft_buffers: list[dict[str, list]]
    first_layer: int
    owned: range
    device_layer_num: int
    extras: dict[str, int]
    scaled: Any


def _refuse_unserved(kv_pool: Any, use_mla: bool | None, drafts: tuple, label: str) -> tuple[bool, bool]:
    """Refuse what the adapter does not serve, saying why; ``(use_mla, layer_shard)`` of the pool."""
    from sglang.srt.mem_cache.hybrid_cache.host_pool_config import check_packed_kv_rows, is_mla_pool
    from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveKVPoolMixin
    from sglang.srt.runtime_context import get_parallel

    if get_parallel().dcp_enabled:
        raise NotServedError(
            f"hicache-sglang does not serve decode context parallelism (--dcp-size > 1) for the {label}: "
            "SGLang's DCP host pool widens logical slots and translates them per rank, which the adapter does not "
            "do. Run without --dcp-size, or without hicache_sglang.install()."
        )
    if isinstance(kv_pool, PageInterleaveKVPoolMixin):
        raise NotServedError(
            f"hicache-sglang does not serve page-interleaved KV pools ({label}): their pages are sharded across "
            "ranks and SGLang wraps the host pool in a placement-aware PageInterleaveHostPool. Run without page "
            "interleaving, or without hicache_sglang.install()."
        )
    if use_mla is None:
        use_mla = is_mla_pool(kv_pool)
    layer_shard = bool(getattr(kv_pool, "layer_shard_enabled", False))
    if layer_shard and not use_mla:
        raise NotServedError(
            f"hicache-sglang serves layer-sharded (context-parallel LayerSplit) device pools for MLA rows only; the "
            f"{label} is not MLA. SGLang builds LayerSplit pools only for DSA MLA models "
            "(--enable-dsa-cache-layer-split)."
        )
    check_packed_kv_rows(kv_pool=kv_pool, drafts=drafts, use_mla=use_mla)  # SGLang's own check, same message
    return use_mla, layer_shard


def _device_side(kv_pool: Any, use_mla: bool, drafts: tuple, override_kv_cache_dim: int | None, layout: str,
                 page_size: int, label: str) -> _DeviceSide:  # fmt: skip
    """The device pool's buffers, layers and drafts (MLA rows, or MHA K/V with their scales), checked."""
    first_layer = int(kv_pool.start_layer or 0)
    scaled = None
    if use_mla:
        info = _mla_info(kv_pool, label)
        if override_kv_cache_dim is not None and override_kv_cache_dim != info.kv_cache_dim:
            raise NotServedError(
                f"override_kv_cache_dim={override_kv_cache_dim} differs from the device rows' width "
                f"{info.kv_cache_dim} ({label}); hicache stores rows exactly as the device holds them"
            )
        decl = hc.get_registry().layouts.get(layout)
        if info.packed_fp8 and decl is not None and decl.split:
            raise NotServedError(
                f"layout {layout!r} splits a row at kv_lora_rank, but this pool packs FP8 DSA rows "
                f"of {info.kv_cache_dim} bytes ({label}); use layer_first, page_first or page_first_direct"
            )
        owned = range(info.layer_indices[0], info.layer_indices[-1] + 1) if info.layer_indices else range(0)
        if tuple(owned) != tuple(info.layer_indices) or not owned:
            raise NotServedError(f"the device pool's layers {info.layer_indices} are not one range ({label})")
        extras = {"kv_lora_rank": info.kv_lora_rank, "qk_rope_head_dim": info.qk_rope_head_dim}
        buffers = {"kv_buffer": list(info.buffers)}
        device_layer_num = info.device_layer_num
        draft_buffers = [{"kv_buffer": list(_mla_info(d, label).buffers)} for d in drafts]
        kind = "mla"
    else:
        info = _mha_info(kv_pool, label)
        if info.scales is not None:
            scales.check_scales(info, drafts=drafts, label=label)
            scaled = info
        extras = {}
        buffers = {"k_buffer": list(info.buffers.k), "v_buffer": list(info.buffers.v)}
        device_layer_num = len(info.buffers.k)
        owned = range(device_layer_num)
        draft_buffers = []
        for d in drafts:
            dinfo = _mha_info(d, label)
            draft_buffers.append({"k_buffer": list(dinfo.buffers.k), "v_buffer": list(dinfo.buffers.v)})
        kind = "mha" if info.head_dim == info.v_head_dim else "mha_asym"
    if page_size != kv_pool.page_size:
        raise NotServedError(
            f"page_size {page_size} differs from the device pool's {kv_pool.page_size} ({label}); "
            "a host page must be a device page"
        )
    for depth, buffers_of_draft in enumerate(draft_buffers):
        if len(next(iter(buffers_of_draft.values()))) != 1:
            raise NotServedError(f"packed draft pool {depth} has more than one layer ({label})")
    return _DeviceSide(kind, info, buffers, draft_buffers, first_layer, owned, device_layer_num, extras, scaled)


def _views(kv_pool: Any, dev: _DeviceSide, page_size: int, capacity: int) -> tuple[DeviceView, list[DeviceView]]:
    """The device pool, and each packed draft, as hicache reads a device pool (absolute layers)."""
    view = DeviceView(kind=dev.kind, buffers=dev.buffers, page_size=page_size, size=capacity,
                      first_layer=dev.first_layer, owned=dev.owned, device_layer_num=dev.device_layer_num,
                      extras=dev.extras)  # fmt: skip
    draft_views = [DeviceView(kind=dev.kind, buffers=b, page_size=page_size, size=capacity, first_layer=0,
                              owned=range(1), device_layer_num=1, extras=dev.extras)
                   for b in dev.draft_buffers]  # fmt: skip
    return view, draft_views


def _mha_info(pool: Any, label: str):
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, MHABufferInfo

    info = _buffer_info(pool, label)
    if not isinstance(info, MHABufferInfo):
        raise NotServedError(f"{type(pool).__name__} describes {type(info).__name__}, not MHA K/V buffers ({label})")
    if info.scales is not None:
        scales.check_scale_layout(info, label)
    if info.transfer_buffers is not None:
        raise NotServedError(
            f"{type(pool).__name__} relocates its K/V backing at transfer time; hicache-sglang binds device buffers "
            f"once, at pool construction ({label})"
        )
    if info.buffers.layout != KVBufferLayout.NHD:
        raise NotServedError(
            f"{type(pool).__name__} stores K/V as {info.buffers.layout.value}; hicache-sglang serves token-major "
            f"(NHD) device rows ({label})"
        )
    _check_rows(pool, list(info.buffers.k) + list(info.buffers.v), label)
    if any(t.shape[1:] != (info.head_num, info.head_dim) for t in info.buffers.k) or any(
        t.shape[1:] != (info.head_num, info.v_head_dim) for t in info.buffers.v
    ):
        raise NotServedError(f"{type(pool).__name__}'s K/V tensors are not [rows, head_num, head_dim] ({label})")
    return info


def _mla_info(pool: Any, label: str):
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo

    info = _buffer_info(pool, label)
    if not isinstance(info, MLABufferInfo):
        raise NotServedError(f"{type(pool).__name__} describes {type(info).__name__}, not MLA rows ({label})")
    if not isinstance(info.buffers, tuple):
        raise NotServedError(
            f"{type(pool).__name__} keeps native split MLA buffers (Ascend); hicache-sglang serves one row per "
            f"token and layer ({label})"
        )
    if info.scales is not None:
        raise NotServedError(
            f"{type(pool).__name__} keeps per-slot FP4 block scales beside its rows, which SGLang's MLA host pool "
            f"refuses too ({label}); hicache-sglang serves {scales.SERVED}. Run this KV dtype without "
            "hicache_sglang.install()."
        )
    _check_rows(pool, list(info.buffers), label)
    return info


def _buffer_info(pool: Any, label: str):
    try:
        infos = pool.get_device_pool_infos()
    except NotImplementedError as exc:
        raise NotServedError(f"{type(pool).__name__} does not describe its device buffers ({label}): {exc}") from exc
    if len(infos) != 1:
        raise NotServedError(f"{type(pool).__name__} describes {len(infos)} buffer sets; expected one ({label})")
    return infos[0].buffer_info


def _check_rows(pool: Any, tensors: list, label: str) -> None:
    for t in tensors:
        if t.dim() != 3 or not t.is_contiguous():
            raise NotServedError(
                f"{type(pool).__name__}'s device rows are {'strided' if t.dim() == 3 else f'{t.dim()}-D'} "
                f"(shape {tuple(t.shape)}, strides {t.stride()}); hicache-sglang needs contiguous [rows, heads, dim] "
                f"per layer ({label})"
            )


def _bytes_per_token(buffers: dict[str, list], host_layers: int) -> int:
    return sum(t[0][0].numel() * t[0].element_size() for t in buffers.values()) * host_layers


def _host_tokens(memory: Any, host_size: float | None, capacity: int, page_size: int, bytes_per_token: int) -> int:
    """SGLang's sizing: ``--hicache-size`` GB, else ``--hicache-ratio`` times the device; plus a padding page."""
    from sglang.srt.mem_cache.pool_host.base import sync_fixed_hicache_size

    size_gb = memory.hicache_size if host_size is None else host_size
    if size_gb > 0:
        tokens = sync_fixed_hicache_size(int(size_gb * 1e9 // bytes_per_token), size_gb)
    else:
        tokens = int(capacity * memory.hicache_ratio)
    return (tokens // page_size + 1) * page_size


def _exact_tokens(tokens: int, page_size: int, label: str) -> int:
    if tokens <= 0 or tokens % page_size:
        raise ValueError(
            f"Host token capacity must be positive and page-aligned, got {tokens} for page_size={page_size} ({label})"
        )
    return tokens
