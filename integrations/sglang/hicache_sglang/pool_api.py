"""Host-pool members that are not SGLang-specific, computed from a hicache ``HostPool``.

SGLang's storage backends (Mooncake, NIXL, UMBP) and its PD disaggregation call these on
any host pool. They depend only on the pool's geometry and layout declaration, so they
belong in ``hicache_core.HostPool`` (which already has page meta, split-head meta and
contiguous buffer infos); these live here, as functions of a core pool, until it takes
them too. Every address comes from the bound parts of the pool's transfer plan, never
from a layout name, so a plugin's layout gets them as well.
"""

from __future__ import annotations

from typing import Any

import torch


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
