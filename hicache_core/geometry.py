"""Pool geometry: what a device pool holds, and where a layout puts it on the host.

:class:`PoolGeometry` is pure data (no tensors), so the dispatcher, the CLI and
``hicache explain`` can reason about a pool without allocating one.
:func:`host_layout_spec` turns a geometry and a :class:`~hicache_core.layouts.Layout`
into host buffer shapes and, for every part of an item, its strides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .layouts import Layout

#: Device-pool attributes that hold per-layer tensors, by pool kind (SGLang's names).
COMPONENT_ATTRS: dict[str, tuple[str, ...]] = {
    "mha": ("k_buffer", "v_buffer"),
    "mha_asym": ("k_buffer", "v_buffer"),
    "mla": ("kv_buffer",),
    "page_rows": ("index_k_with_scale_buffer",),
}
_COMPONENT_NAMES = {"k_buffer": "k", "v_buffer": "v", "kv_buffer": "kv", "index_k_with_scale_buffer": "row"}


@dataclass(frozen=True)
class Component:
    """One per-layer device tensor family (K, V, the MLA latent+rope row, a page row).

    ``heads`` is ``None`` for page-row pools, whose rows have no head axis; ``dim``
    counts elements per head (bytes per row for page rows).
    """

    name: str
    attr: str
    heads: int | None
    dim: int


@dataclass(frozen=True)
class PoolGeometry:
    """Everything about a device pool that decides how its bytes move; no tensors."""

    kind: str
    dtype: torch.dtype
    page_size: int
    layer_num: int
    start_layer: int
    end_layer: int
    draft_layers: int
    device_type: str
    components: tuple[Component, ...]
    extras: tuple[tuple[str, int], ...] = ()

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def owned_layers(self) -> int:
        return self.end_layer - self.start_layer

    @property
    def host_layers(self) -> int:
        return self.owned_layers + self.draft_layers

    @property
    def sharded(self) -> bool:
        return self.start_layer != 0 or self.end_layer != self.layer_num

    @property
    def items_are_pages(self) -> bool:
        """Page-row pools move one whole page per item; the others one token."""
        return self.kind == "page_rows"

    @property
    def item_bytes(self) -> tuple[int, ...]:
        return tuple((c.heads or 1) * c.dim * self.itemsize for c in self.components)

    def extra(self, name: str) -> int:
        for key, value in self.extras:
            if key == name:
                return value
        raise ValueError(f"the {self.kind} pool has no attribute {name!r} (needed by the layout)")


def geometry_of(device_pool: Any, *, page_size: int | None = None, draft_pools: tuple = ()) -> PoolGeometry:
    """Read the geometry of any object shaped like SGLang's device pools (duck typing)."""
    kind = pool_kind_of(device_pool)
    attrs = COMPONENT_ATTRS[kind]
    layers = [list(getattr(device_pool, attr)) for attr in attrs]
    if not layers[0]:
        raise ValueError(f"device pool {type(device_pool).__name__} has no layers in {attrs[0]}")
    start = int(getattr(device_pool, "start_layer", 0) or 0)
    end = getattr(device_pool, "end_layer", None)
    end = start + len(layers[0]) if end is None else int(end)
    if end == start + len(layers[0]) - 1:
        # SGLang's own pools keep end_layer inclusive (end_layer = layer_num - 1) and count only their
        # own layers in layer_num; hicache's are exclusive and count the model's layers.
        end += 1
    layer_num = max(int(getattr(device_pool, "layer_num", end)), end)
    if not 0 <= start < end <= layer_num:
        raise ValueError(f"device pool layer range [{start}, {end}) is not inside [0, {layer_num})")
    for attr, per_layer in zip(attrs, layers):
        if len(per_layer) != end - start:
            raise ValueError(
                f"device pool {attr} has {len(per_layer)} layers, but it owns [{start}, {end}) = {end - start}"
            )
    first = layers[0][0]
    components = []
    for attr, per_layer in zip(attrs, layers):
        t = per_layer[0]
        if kind == "page_rows":
            if t.dim() != 2:
                raise ValueError(f"{attr}[0] must be 2-D (pages, row bytes), got shape {tuple(t.shape)}")
            components.append(Component(_COMPONENT_NAMES[attr], attr, None, t.shape[1] * t.element_size()))
        else:
            if t.dim() != 3:
                raise ValueError(f"{attr}[0] must be 3-D (slots, heads, dim), got shape {tuple(t.shape)}")
            components.append(Component(_COMPONENT_NAMES[attr], attr, t.shape[1], t.shape[2]))
        for layer, tensor in enumerate(per_layer):
            if tensor.shape != t.shape or tensor.dtype != first.dtype or not tensor.is_contiguous():
                raise ValueError(
                    f"{attr}[{layer}] must be contiguous and match {attr}[0] "
                    f"(shape {tuple(t.shape)}, dtype {first.dtype})"
                )
    drafts = 0
    for draft in draft_pools:
        if pool_kind_of(draft) != kind:
            raise ValueError(f"draft pool kind {pool_kind_of(draft)!r} differs from the target's {kind!r}")
        for attr, per_layer in zip(attrs, layers):
            draft_layers = list(getattr(draft, attr))
            t, target = (draft_layers[0] if draft_layers else None), per_layer[0]
            # A draft layer's rows must be shaped, typed and placed like the target's; only their
            # number may differ (bounds are checked against each layer's own rows).
            if t is None or t.shape[1:] != target.shape[1:] or t.dtype != target.dtype or t.device != target.device:
                raise ValueError(
                    f"draft pool {attr}[0] must match the target's {attr}[0]: rows of {tuple(target.shape[1:])}, "
                    f"dtype {target.dtype}, device {target.device}; got "
                    + ("nothing" if t is None else f"rows of {tuple(t.shape[1:])}, dtype {t.dtype}, device {t.device}")
                )
            if not t.is_contiguous():
                raise ValueError(f"draft pool {attr}[0] must be contiguous")
        drafts += 1
    extras = tuple(
        (name, int(getattr(device_pool, name)))
        for name in ("kv_lora_rank", "qk_rope_head_dim")
        if getattr(device_pool, name, None) is not None
    )
    device_page_size = getattr(device_pool, "page_size", None)
    if page_size is None:
        page_size = int(device_page_size or 1)
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if kind == "page_rows" and device_page_size is not None and page_size != int(device_page_size):
        raise ValueError(
            f"page_size={page_size} differs from the page-row device pool's page_size={device_page_size}: "
            "each device row is one whole device page"
        )
    dtype = torch.uint8 if kind == "page_rows" else first.dtype
    return PoolGeometry(
        kind=kind,
        dtype=dtype,
        page_size=page_size,
        layer_num=layer_num,
        start_layer=start,
        end_layer=end,
        draft_layers=drafts,
        device_type=first.device.type,
        components=tuple(components),
        extras=extras,
    )


def pool_kind_of(device_pool: Any) -> str:
    """The pool kind: an explicit ``pool_kind`` attribute, else inferred from SGLang's attribute names."""
    if device_pool is None:
        raise ValueError("device_pool is None; pass the device pool the host pool mirrors")
    kind = getattr(device_pool, "pool_kind", None)
    if kind is not None:
        if kind not in COMPONENT_ATTRS:
            raise ValueError(f"unknown pool_kind {kind!r}; known: {sorted(COMPONENT_ATTRS)}")
        return kind
    if getattr(device_pool, "index_k_with_scale_buffer", None) is not None:
        return "page_rows"
    if getattr(device_pool, "kv_buffer", None) is not None:
        return "mla"
    k, v = getattr(device_pool, "k_buffer", None), getattr(device_pool, "v_buffer", None)
    if k is not None and v is not None:
        return "mha" if k[0].shape[1:] == v[0].shape[1:] else "mha_asym"
    raise ValueError(
        f"cannot tell the pool kind of {type(device_pool).__name__}: it has none of "
        "k_buffer/v_buffer (MHA), kv_buffer (MLA), index_k_with_scale_buffer (page rows)"
    )


@dataclass(frozen=True)
class HostBufferSpec:
    """One host tensor: the attribute it is exposed as, and its (SGLang) shape."""

    attr: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    full_shape: tuple[int, ...]


@dataclass(frozen=True)
class HostPart:
    """Where one part of an item lives: one component, or a slice of its ``dim``.

    Strides and offset are in elements of the pool dtype, inside ``buffers[buffer]``.
    """

    name: str
    buffer: int
    component: int
    dim_start: int
    dim_stop: int
    heads: int
    offset: int
    page_stride: int
    token_stride: int
    layer_stride: int
    head_stride: int

    @property
    def dim(self) -> int:
        return self.dim_stop - self.dim_start


@dataclass(frozen=True)
class HostLayoutSpec:
    """The host side of a pool: buffers, item parts, and sizes."""

    layout: Layout
    num_pages: int
    tokens_per_page: int
    num_layers: int
    buffers: tuple[HostBufferSpec, ...]
    parts: tuple[HostPart, ...]
    aliases: tuple[tuple[str, str], ...]

    @property
    def num_items(self) -> int:
        return self.num_pages * self.tokens_per_page


def host_layout_spec(geometry: PoolGeometry, layout: Layout, num_pages: int) -> HostLayoutSpec:
    """Derive host buffer shapes and part strides from a layout declaration."""
    if geometry.kind not in layout.pool_kinds:
        raise ValueError(f"layout {layout.name!r} cannot store pool kind {geometry.kind!r}")
    comps = geometry.components
    tokens_per_page = 1 if geometry.items_are_pages else geometry.page_size
    # (name, component, dim range, buffer attr) per part, and whether parts stack on a component axis.
    if layout.split_at is not None:
        if len(comps) != 1:
            raise ValueError(f"layout {layout.name!r} splits a single-component pool, not {geometry.kind!r}")
        at = geometry.extra(layout.split_at)
        if not 0 < at < comps[0].dim:
            raise ValueError(f"{layout.split_at}={at} does not split an item of {comps[0].dim} elements")
        parts = [("k", 0, 0, at, "k_buffer"), ("v", 0, at, comps[0].dim, "v_buffer")]
        stacked, aliases = False, (("kv_buffer", "k_buffer"),)
    elif len(comps) > 1 and len({(c.heads, c.dim) for c in comps}) == 1:
        parts = [(c.name, i, 0, c.dim, "kv_buffer") for i, c in enumerate(comps)]
        stacked, aliases = True, ()
    elif len(comps) > 1:
        parts = [(c.name, i, 0, c.dim, f"{c.name}_buffer") for i, c in enumerate(comps)]
        stacked, aliases = False, ()
    else:
        parts = [(comps[0].name, 0, 0, comps[0].dim, "kv_buffer")]
        stacked, aliases = False, ()

    has_heads = comps[0].heads is not None
    buffers: list[HostBufferSpec] = []
    out: list[HostPart] = []
    for name, comp, lo, hi, attr in parts:
        sizes = {
            "component": len(parts) if stacked else None,
            "layer": geometry.host_layers,
            "page": num_pages,
            "token": tokens_per_page,
            "head": comps[comp].heads if has_heads else None,
            "dim": hi - lo,
        }
        axes = [a for a in layout.axes if sizes[a] is not None]
        strides = dict.fromkeys(layout.axes, 0)
        running = 1
        for axis in reversed(axes):
            strides[axis] = running
            running *= sizes[axis]
        if attr not in [b.attr for b in buffers]:
            shape: list[int] = []
            for axis in axes:
                if layout.merge_slots and axis == "token":
                    shape[-1] *= sizes["token"]
                else:
                    shape.append(sizes[axis])
            buffers.append(HostBufferSpec(attr, tuple(shape), tuple(axes), tuple(sizes[a] for a in axes)))
        buffer = [b.attr for b in buffers].index(attr)
        out.append(
            HostPart(
                name=name,
                buffer=buffer,
                component=comp,
                dim_start=lo,
                dim_stop=hi,
                heads=comps[comp].heads or 1,
                offset=comp * strides["component"] if stacked else 0,
                page_stride=strides["page"],
                token_stride=strides["token"],
                layer_stride=strides["layer"],
                head_stride=strides["head"],
            )
        )
    return HostLayoutSpec(
        layout=layout,
        num_pages=num_pages,
        tokens_per_page=tokens_per_page,
        num_layers=geometry.host_layers,
        buffers=tuple(buffers),
        parts=tuple(out),
        aliases=aliases,
    )


def pages_for(size_tokens: int, page_size: int) -> int:
    """Whole pages needed for ``size_tokens`` token slots."""
    return max(1, math.ceil(size_tokens / page_size))
