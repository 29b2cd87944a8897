"""The DSA indexer host pool (DeepSeek-V3.2, GLM-5) SGLang 0.5.23 builds beside the MLA anchor, as hicache's.

SGLang builds it in ``pool_host/dsa.py`` (``DSAIndexerHostPoolBuilder.build`` for the target,
``build_full_draft_pools`` for a separate draft indexer), both by calling the module's
``DSAIndexerPoolHost(decl=, anchor_host=, packed_draft_device_pools=, allocator_type=)``.
:func:`build_dsa_indexer_host_pool` takes those arguments and returns hicache's
``page_rows`` pool with SGLang's geometry: host layers are the owned device layers that
hold index keys (shared-topk layers keep none), then one per packed draft; one item is one
page row of ``index_k_with_scale_buffer``; indices are the anchor's token slots, in whole
pages; the buffer keeps SGLang's ``(size + page_size + 1) // page_size`` page rows.
"""

from __future__ import annotations

from typing import Any

import hicache_core as hc

from ..errors import NotServedError
from ..host_memory import sglang_budget
from ..layers import device_layers
from ..sidecar import SGLangSidecarHostPool, SidecarView, sidecar_operations

_ATTR = "index_k_with_scale_buffer"


class SGLangDSAIndexerHostPool(SGLangSidecarHostPool):
    """hicache's DSA indexer host pool, with ``DSAIndexerPoolHost``'s members."""

    def __init__(self, core, *, decl: Any, **kw: Any) -> None:
        super().__init__(core, **kw)
        self.decl = decl
        self.indexer_dtype = decl.storage_info.dtype
        self.indexer_page_stride_size = decl.storage_info.page_bytes(self.page_size)
        self.indexer_layout_dim = self.indexer_page_stride_size * self.layer_num
        self.indexer_page_num = core.page_num

    @property
    def index_k_with_scale_buffer(self):
        return self.core.index_k_with_scale_buffer


def build_dsa_indexer_host_pool(
    decl: Any,
    anchor_host: Any,
    *,
    packed_draft_device_pools: tuple[Any, ...] = (),
    pin_memory: bool = True,
    device: str = "cpu",
    allocator_type: str = "default",
    is_dummy: bool = False,
) -> SGLangDSAIndexerHostPool:
    """``DSAIndexerPoolHost``'s constructor, building hicache's pool (same arguments).

    :raises NotServedError: a dummy (allocator-only) pool, or a device pool this cannot mirror.
    :raises hicache_core.UnsupportedCombinationError: no installed plugin serves the anchor's
        layout and SGLang's io backend for page rows.
    """
    from sglang.srt.runtime_context import get_memory

    device_pool = decl.device_pool
    io_backend = get_memory().hicache_io_backend
    layout = anchor_host.layout
    label = (f"{decl.pool_name.value!r} host pool (DSA indexer of {type(device_pool).__name__}, layout {layout!r}, "
             f"io backend {io_backend!r})")  # fmt: skip
    if is_dummy:
        raise NotServedError(f"hicache-sglang does not build allocator-only (dummy) DSA indexer pools ({label})")
    if allocator_type != "default":
        raise NotServedError(
            f"hicache-sglang allocates host memory itself; the {allocator_type!r} host allocator is SGLang's ({label})"
        )
    page_size = anchor_host.page_size
    layer_shard = bool(getattr(device_pool, "layer_shard_enabled", False))
    if layer_shard:
        owned_start, owned_end = device_pool._owned_local_layer_range()
    else:
        owned_start, owned_end = 0, device_pool.layer_num
    declared = decl.owned_device_layers
    live = [layer for layer in range(owned_start, owned_end) if declared is None or layer in declared]
    if not live:
        raise NotServedError(f"the device pool keeps index keys in none of its owned layers ({label})")
    target_buffers = [getattr(device_pool, _ATTR)[layer] for layer in live]
    drafts = tuple(packed_draft_device_pools)
    draft_buffers = []
    for depth, draft in enumerate(drafts):
        layers = list(getattr(draft, _ATTR))
        if len(layers) != 1:
            raise NotServedError(f"packed draft indexer {depth} has {len(layers)} layers; one expected ({label})")
        draft_buffers.append(layers)
    # SGLang's buffer keeps one spare page row past the anchor's pages (its page count formula).
    page_rows = (anchor_host.size + page_size + 1) // page_size
    view = SidecarView(kind="page_rows", attr=_ATTR, buffers=target_buffers, page_size=page_size,
                       size=anchor_host.size)  # fmt: skip
    draft_views = [SidecarView(kind="page_rows", attr=_ATTR, buffers=b, page_size=page_size, size=anchor_host.size)
                   for b in draft_buffers]  # fmt: skip
    core = hc.make_host_pool(view, layout=layout, io_backend=io_backend, page_size=page_size,
                             size=page_rows * page_size, draft_pools=draft_views, pin_memory=pin_memory,
                             operations=sidecar_operations(layer_shard), label=label,
                             host_memory_check=sglang_budget(label),
                             layer_map=device_layers(device_pool, device_layer_num=device_pool.layer_num,
                                                            kept=live, draft_pools=drafts))  # fmt: skip
    return SGLangDSAIndexerHostPool(
        core,
        decl=decl,
        device_pool=device_pool,
        layer_shard=layer_shard,
        pool_label=decl.pool_name.value,
        size=anchor_host.size,
        page_num=anchor_host.page_num,
    )
