"""Host-pool members that are not SGLang-specific, computed from a hicache ``HostPool``.

SGLang's storage backends (Mooncake, NIXL, UMBP) and its PD disaggregation call these on
any host pool. They depend only on the pool's geometry and layout declaration, so they
belong in ``hicache_core.HostPool`` (which already has page meta, split-head meta and
contiguous buffer infos); these live here, as functions of a core pool, until it takes
them too. Every address comes from the bound parts of the pool's transfer plan, never
from a layout name, so a plugin's layout gets them as well.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hicache_core.loads.pool_loads import CallPerLayer, PoolLoad


def copies_only(load: Callable) -> Callable:
    """Marks a pool class's ``load_to_device_per_layer`` as one copy of the hicache pool's layer its layer id
    names: such a pool's layer-wise loads hand the core one part, its indices checked once (``prepare_load``)."""
    load.copies_only = True  # type: ignore[attr-defined]
    return load


class CoreSlots:
    """SGLang's allocator members, answered by the hicache pool in ``self.core`` (whole pages of slots)."""

    core: Any

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` free host slots (whole pages), or ``None`` when the pool is full."""
        return self.core.alloc(need_size)

    def free(self, indices: torch.Tensor) -> int:
        """Give slots back; a slot freed twice raises."""
        return self.core.free(indices)

    def available_size(self) -> int:
        return self.core.available_size()

    def clear(self) -> None:
        self.core.clear()


class HostPoolMembers(CoreSlots):
    """The members every adapter pool answers alike from its hicache pool (``self.core``).

    Both :class:`~hicache_sglang.SGLangHostPool` (KV pools) and
    :class:`~hicache_sglang.sidecar.SGLangSidecarHostPool` (pools on another's slots) take them;
    what differs (layer ids, flat pages, the K size) stays with each.
    """

    core: Any
    pool_label: str
    layout: str
    size: int
    size_per_token: int

    dcp_size = 1
    dcp_rank = 0
    #: No compacting layout shared between pools: indices are physical slots as given.
    shared_allocation_domain = None
    stores_page_envelope = False
    #: Pages are stored in SGLang's own byte format (same flat pages), so L3 keys need no tag.
    storage_format_tag: str | None = None
    #: SGLang's controller keeps host indices on the CPU for a page_first write only when the pool says
    #: so; a hicache pool takes indices anywhere and moves them where its implementation wants them.
    can_use_write_back_jit = True

    def _take_core(self, core: Any, pool_label: str) -> None:
        """The attributes SGLang reads that the hicache pool answers (layout, page size, layers, dtype, ...)."""
        self.core = core
        self.pool_label = pool_label
        self.layout = core.layout
        self.page_size = core.page_size
        self.layer_num = core.layer_num
        self.dtype = core.dtype
        self.device = "cpu"
        self.pin_memory = core.pin_memory
        self.io_backend = core.io_backend
        self.size_per_token = core.get_size_per_token()

    @property
    def implementations(self) -> dict[str, str]:
        """The hicache implementation serving each operation."""
        return self.core.implementations

    @property
    def logical_size(self) -> int:
        """Slots the radix tree sees (SGLang widens them under decode context parallelism; not served)."""
        return self.size

    def prepare_transfer_indices(
        self, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Physical indices for one submission: they already are (no shared compacting layout)."""
        return host_indices, device_indices

    def prepare_load(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str,
                     layer_ids: Sequence[int | None], *, is_draft: bool = False,
                     ) -> PoolLoad | CallPerLayer:  # fmt: skip
        """This pool's part of a layer-wise load (:func:`hicache_core.loads.pool_loads.submit_loads`): step ``i`` loads
        SGLang's layer ``layer_ids[i]`` (``None``: nothing). A pool whose per-layer load is one copy maps SGLang's
        ids through the core's layer map and hands the core its part; one whose load does more is called per layer."""
        if not getattr(type(self).load_to_device_per_layer, "copies_only", False):

            def call(i: int) -> None:
                if layer_ids[i] is not None:
                    self.load_to_device_per_layer_physical(device_pool, host_indices, device_indices, layer_ids[i],
                                                           io_backend, is_draft=is_draft)  # fmt: skip

            return CallPerLayer(call, self.core.plan.device, keep=(host_indices, device_indices))
        return self.core.prepare_load(device_pool, host_indices, device_indices, io_backend, layer_ids,
                                      is_draft=is_draft)  # fmt: skip

    def load_to_device_per_layer_physical(self, device_pool: Any, host_indices: torch.Tensor,
                                          device_indices: torch.Tensor, layer_id: int, io_backend: str, *,
                                          is_draft: bool = False) -> None:  # fmt: skip
        """The transfer engine's entry: indices are physical already (see :meth:`prepare_transfer_indices`)."""
        self.load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend,
                                      is_draft=is_draft)  # fmt: skip

    def backup_from_device_all_layer_physical(
        self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str
    ) -> None:
        self.backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return self.core.get_dummy_flat_data_page()

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """Pointer and byte size of each contiguous host run of the given pages (zero-copy L3)."""
        return self.core.get_page_buffer_meta(indices)

    def get_page_buffer_element_size(self, split_factor: int = 1) -> int | None:
        return page_buffer_element_size(self.core, split_factor)

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        """The host tensors to register for zero-copy I/O, one per item part (K, V; or the MLA row)."""
        return part_buffers(self.core)

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """``(ptrs, lens, item_lens)`` of the host regions made of whole pages (PD direct-to-host registration)."""
        return self.core.get_contiguous_buf_infos()

    def get_size_per_token(self) -> int:
        return self.size_per_token

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        """Whether every page pointer the zero-copy paths hand out is ``page_size_bytes``-aligned (O_DIRECT)."""
        if self.layout == "layer_first":
            # Its page runs are per layer; SGLang answers False for it, and so does this.
            return False
        return self.core.is_stride_page_aligned(page_size_bytes)

    def destroy(self) -> None:
        """Release the host buffers; the pool is unusable after (SGLang calls it at shutdown)."""
        self.core.destroy()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.pool_label!r} {self.core!r}>"


def head_geometry(pool: Any) -> tuple[int, int, int]:
    """``(head_num, head_dim, v_head_dim)`` of an MHA pool (rows per token, elements per row)."""
    comps = pool.geometry.components
    if comps[0].heads is None or len(comps) != 2:
        raise ValueError(f"a {pool.geometry.kind} pool has no K/V head geometry")
    return comps[0].heads, comps[0].dim, comps[1].dim


def page_buffer_element_size(pool: Any, split_factor: int = 1) -> int | None:
    """Bytes of the first storage element of a page (as SGLang's storage backends size objects)."""
    indices = torch.arange(pool.page_size, dtype=torch.int64)
    if split_factor != 1:
        sizes = pool.get_split_heads_page_buffer_meta(indices, split_factor)[1]
    else:
        sizes = pool.get_page_buffer_meta(indices)[1]
    return int(sizes[0]) if sizes else None


def part_buffers(pool: Any) -> list[torch.Tensor]:
    """One host tensor per item part (K and V, the MLA row, or its two split halves), in the pool dtype."""
    out = []
    for part in pool.plan.parts:
        buffer = getattr(pool, pool.spec.buffers[part.spec.buffer].attr)
        stacked = len(pool.plan.parts) > 1 and all(p.spec.buffer == part.spec.buffer for p in pool.plan.parts)
        out.append(buffer[part.spec.component] if stacked else buffer)
    return out


def layer_slabs(pool: Any) -> list[tuple[Any, int, torch.Tensor]]:
    """``(part, layer, view)`` per part and host layer, where each layer of a part is one contiguous slab.

    Only a layout whose layer axis is outside page and token (``layer_first``) has such slabs.
    """
    out = []
    for part in pool.plan.parts:
        tokens = part.num_pages * part.tokens_per_page
        slab = tokens * part.item_bytes
        if not (part.item_bytes == part.token_stride and part.page_stride == part.tokens_per_page * part.token_stride
                and part.host_item_contiguous):  # fmt: skip
            raise ValueError(
                f"layout {pool.layout!r} does not keep each layer in one contiguous host slab "
                "(per-layer buffer registration needs 'layer_first')"
            )
        for layer in range(pool.plan.num_layers):
            start = part.host_offset + layer * part.layer_stride
            view = part.host[start : start + slab]
            out.append((part, layer, view))
    return out


def backup_all(pool: Any, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
               io_backend: str) -> None:  # fmt: skip
    """Every kept layer and every packed draft of ``pool`` device -> host: one call, or under LayerSplit one call
    per layer, kept layers then drafts (SGLang's loop)."""
    core = pool.core
    if not pool.layer_shard_enabled:
        core.backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)
        return
    layers = core.layer_map
    layers.check_pool(device_pool, core.label)
    for layer_id in layers.kept_ids:
        core.backup_from_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend)
    for depth, draft in enumerate(layers.draft_pools):
        core.backup_from_device_per_layer(draft, host_indices, device_indices, layers.draft_base + depth, io_backend,
                                          is_draft=True)  # fmt: skip
