"""Host-pool members that are not SGLang-specific, computed from a hicache ``HostPool``.

SGLang's storage backends (Mooncake, NIXL, UMBP) and its PD disaggregation call these on
any host pool. They depend only on the pool's geometry and layout declaration, so they
belong in ``hicache_core.HostPool``; they live here, as functions of a core pool, until the
core's host pool takes them (the core is being reworked: pool kinds as declarations).
Every address comes from the bound parts of the pool's transfer plan, never from a
layout name, so a plugin's layout gets them too.
"""

from __future__ import annotations

from typing import Any

import torch


def head_geometry(pool: Any) -> tuple[int, int, int]:
    """``(head_num, head_dim, v_head_dim)`` of an MHA pool (rows per token, elements per row)."""
    comps = pool.geometry.components
    if comps[0].heads is None or len(comps) != 2:
        raise ValueError(f"a {pool.geometry.kind} pool has no K/V head geometry")
    return comps[0].heads, comps[0].dim, comps[1].dim


def page_starts(pool: Any, indices: torch.Tensor) -> list[int]:
    """The page of each run of ``page_size`` slots (indices must come in whole pages)."""
    slots = indices.to("cpu", torch.int64).reshape(-1)
    if slots.numel() % pool.page_size:
        raise ValueError(f"whole pages only: {slots.numel()} slots with page_size {pool.page_size}")
    return (slots[:: pool.page_size] // pool.page_size).tolist()


def _dense_block_bytes(part: Any, num_layers: int) -> int | None:
    """Bytes of one head's (token, layer, dim) block when it is one dense run, else None."""
    axes = sorted([(part.token_stride, part.tokens_per_page), (part.layer_stride, num_layers)])
    expect = part.piece_bytes
    for stride, size in axes:
        if size > 1 and stride != expect:
            return None
        expect *= size
    return expect


def split_heads_page_buffer_meta(pool: Any, indices: torch.Tensor, split_factor: int) -> tuple[list[int], list[int]]:
    """Pointers and sizes of each page's head groups, K then V per group (heterogeneous-TP storage).

    A page's heads are split into ``split_factor`` groups; each group of each part must be
    one contiguous host run, which holds where the head axis is the outermost axis inside
    a page (``page_head``).
    """
    parts = pool.plan.parts
    heads = parts[0].heads
    if split_factor < 1 or heads % split_factor:
        raise ValueError(f"split_factor {split_factor} does not divide the {heads} heads of a page")
    group = heads // split_factor
    num_layers = pool.plan.num_layers
    for part in parts:
        block = _dense_block_bytes(part, num_layers)
        if block is None or (group > 1 and part.head_stride != block):
            raise ValueError(
                f"layout {pool.layout!r} does not keep a page's heads in contiguous groups; "
                "split-head page meta needs a head-outermost layout such as 'page_head'"
            )
    ptrs: list[int] = []
    sizes: list[int] = []
    for page in page_starts(pool, indices):
        if not 0 <= page < pool.page_num:
            raise IndexError(f"page {page} is outside the pool ({pool.page_num} pages)")
        for first in range(0, heads, group):
            for part in parts:
                offset = part.host_offset + page * part.page_stride + first * part.head_stride
                ptrs.append(part.host.data_ptr() + offset)
                sizes.append(group * _dense_block_bytes(part, num_layers))
    return ptrs, sizes


def page_buffer_element_size(pool: Any, split_factor: int = 1) -> int | None:
    """Bytes of the first storage element of a page (as SGLang's storage backends size objects)."""
    indices = torch.arange(pool.page_size, dtype=torch.int64)
    if split_factor != 1:
        sizes = split_heads_page_buffer_meta(pool, indices, split_factor)[1]
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


def contiguous_buf_infos(pool: Any) -> tuple[list[int], list[int], list[int]]:
    """``(data_ptrs, data_lens, item_lens)`` per part and host layer, like a device pool's (PD registration)."""
    ptrs, lens, items = [], [], []
    for part, _layer, view in layer_slabs(pool):
        ptrs.append(view.data_ptr())
        lens.append(view.numel())
        items.append(part.item_bytes * pool.page_size)
    return ptrs, lens, items
