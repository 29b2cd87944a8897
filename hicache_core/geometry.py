"""Pool geometry: what a device pool holds, and where a layout puts it on the host.

:class:`PoolGeometry` is pure data (no tensors), so the dispatcher, the CLI and
``hicache explain`` can reason about a pool without allocating one.
:func:`host_layout_spec` turns a geometry and a :class:`~hicache_core.layouts.Layout`
into host buffers (names, shapes) and, for every part of an item, its strides. Both
read only declarations (:class:`~hicache_core.pool_kinds.PoolKind`, ``Layout``): no
pool kind or layout is special-cased by name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .layouts import Layout
from .pool_kinds import PoolKind
from .validation import positive_int


@dataclass(frozen=True)
class Component:
    """One per-layer device tensor family (K, V, the MLA latent+rope row, a page row).

    ``heads`` is ``None`` for page items, whose rows have no head axis; ``dim`` counts
    elements per head (bytes per row for page items). ``host_attr`` names its host buffer
    when it has one of its own.
    """

    name: str
    attr: str
    heads: int | None
    dim: int
    host_attr: str = ""


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
    decl: PoolKind | None = None

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
        """Page items move one whole page each; token items one token slot."""
        return self.decl is not None and self.decl.items_are_pages

    @property
    def item_bytes(self) -> tuple[int, ...]:
        return tuple((c.heads or 1) * c.dim * self.itemsize for c in self.components)

    def extra(self, name: str) -> int:
        for key, value in self.extras:
            if key == name:
                return value
        raise ValueError(f"the {self.kind} pool has no attribute {name!r} (needed by the layout)")


def _known_kinds(pool_kinds: Mapping[str, PoolKind] | None) -> Mapping[str, PoolKind]:
    if pool_kinds is not None:
        return pool_kinds
    from .registry import get_registry  # late: the registry imports this module

    return get_registry().pool_kinds


def pool_kind_of(device_pool: Any, pool_kinds: Mapping[str, PoolKind] | None = None) -> PoolKind:
    """The pool kind: an explicit ``pool_kind`` attribute, else the one declared kind whose detector matches."""
    if device_pool is None:
        raise ValueError("device_pool is None; pass the device pool the host pool mirrors")
    kinds = _known_kinds(pool_kinds)
    name = getattr(device_pool, "pool_kind", None)
    if name is not None:
        kind = kinds.get(name) if isinstance(name, str) else None
        if kind is None:
            raise ValueError(f"unknown pool_kind {name!r}; registered pool kinds: {', '.join(sorted(kinds))}")
        return kind
    matches = []
    for kind in kinds.values():
        try:
            if kind.detect is not None and kind.detect(device_pool):
                matches.append(kind)
        except Exception:  # noqa: BLE001 - a detector that cannot read this pool simply does not match it
            continue
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ValueError(
            f"{type(device_pool).__name__} looks like several pool kinds ({', '.join(k.name for k in matches)}); "
            "set its pool_kind attribute to the one it is"
        )
    described = "; ".join(
        f"{k.name}: {', '.join(c.device_attr for c in k.components)}" for k in kinds.values()
    )  # fmt: skip
    raise ValueError(
        f"cannot tell the pool kind of {type(device_pool).__name__}: it matches no registered pool kind "
        f"({described}). Set its pool_kind attribute, or register the kind (hicache_register_pool_kinds)."
    )


def _component(kind: PoolKind, decl, rows: tuple[int, ...], elem_bytes: int) -> Component:
    if kind.items_are_pages:
        return Component(decl.name, decl.device_attr, None, math.prod(rows) * elem_bytes, decl.host_attr)
    return Component(decl.name, decl.device_attr, rows[0], rows[1], decl.host_attr)


def geometry_of(
    device_pool: Any,
    *,
    page_size: int | None = None,
    draft_pools: tuple = (),
    pool_kinds: Mapping[str, PoolKind] | None = None,
) -> PoolGeometry:
    """Read the geometry of any object shaped like SGLang's device pools (duck typing)."""
    kind = pool_kind_of(device_pool, pool_kinds)
    attrs = tuple(c.device_attr for c in kind.components)
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
    want_dim = 2 if kind.items_are_pages else 3
    first = layers[0][0]
    components = []
    for decl, attr, per_layer in zip(kind.components, attrs, layers):
        if len(per_layer) != end - start:
            raise ValueError(
                f"device pool {attr} has {len(per_layer)} layers, but it owns [{start}, {end}) = {end - start}"
            )
        t = per_layer[0]
        if t.dim() != want_dim:
            what = "(pages, row)" if kind.items_are_pages else "(slots, heads, dim)"
            raise ValueError(f"{attr}[0] must be {want_dim}-D {what}, got shape {tuple(t.shape)}")
        if 0 in t.shape[1:]:
            raise ValueError(f"{attr}[0] has an empty row (shape {tuple(t.shape)}): nothing to move per item")
        for layer, tensor in enumerate(per_layer):
            same_dtype = kind.items_are_pages or tensor.dtype == first.dtype
            if tensor.shape != t.shape or not same_dtype or not tensor.is_contiguous() or tensor.device != t.device:
                raise ValueError(
                    f"{attr}[{layer}] must be contiguous and match {attr}[0] "
                    f"(shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device})"
                )
        components.append(_component(kind, decl, tuple(t.shape[1:]), t.element_size()))
    drafts = 0
    for draft in draft_pools:
        if pool_kind_of(draft, pool_kinds) is not kind:
            raise ValueError(
                f"draft pool kind {pool_kind_of(draft, pool_kinds).name!r} differs from the target's {kind.name!r}"
            )
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
        (name, int(getattr(device_pool, name))) for name in kind.extras if getattr(device_pool, name, None) is not None
    )
    device_page_size = getattr(device_pool, "page_size", None)
    if device_page_size is not None:
        device_page_size = positive_int(device_page_size, "the device pool's page_size")
    if page_size is None:
        page_size = device_page_size if device_page_size is not None else 1
    page_size = positive_int(page_size, "page_size")
    if kind.items_are_pages and device_page_size is not None and page_size != device_page_size:
        raise ValueError(
            f"page_size={page_size} differs from the {kind.name} device pool's page_size={device_page_size}: "
            "each device row is one whole device page"
        )
    return PoolGeometry(
        kind=kind.name,
        dtype=torch.uint8 if kind.items_are_pages else first.dtype,
        page_size=page_size,
        layer_num=layer_num,
        start_layer=start,
        end_layer=end,
        draft_layers=drafts,
        device_type=first.device.type,
        components=tuple(components),
        extras=extras,
        decl=kind,
    )


def example_geometry(
    kind: PoolKind,
    *,
    page_size: int,
    layer_num: int,
    start_layer: int = 0,
    end_layer: int | None = None,
    draft_layers: int = 0,
    device_type: str = "cpu",
    rows: Mapping[str, tuple[int, ...]] | None = None,
    extras: Mapping[str, int] | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> PoolGeometry:
    """A geometry for ``kind`` without a device pool: rows from ``rows`` or the declaration's examples."""
    rows = dict(rows or {})
    elem = 1 if kind.items_are_pages else torch.empty((), dtype=dtype).element_size()
    comps = tuple(_component(kind, c, tuple(rows.get(c.name, c.example)), elem) for c in kind.components)
    values = dict(kind.example_extras) | dict(extras or {})
    return PoolGeometry(
        kind=kind.name,
        dtype=torch.uint8 if kind.items_are_pages else dtype,
        page_size=page_size,
        layer_num=layer_num,
        start_layer=start_layer,
        end_layer=layer_num if end_layer is None else end_layer,
        draft_layers=draft_layers,
        device_type=device_type,
        components=comps,
        extras=tuple((name, values[name]) for name in kind.extras if name in values),
        decl=kind,
    )


@dataclass(frozen=True)
class HostBufferSpec:
    """One host tensor: the attribute it is exposed as, its (SGLang) shape, and the axes of each dimension.

    ``axes`` and ``full_shape`` list every axis separately (outermost first); ``dims`` says which
    axes each dimension of ``shape`` covers (several where the layout merges them).
    """

    attr: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    full_shape: tuple[int, ...]
    dims: tuple[tuple[str, ...], ...] = ()

    def dim_of(self, axis: str) -> int | None:
        """The dimension of ``shape`` that holds ``axis`` alone, or ``None`` (absent, or merged)."""
        for i, group in enumerate(self.dims):
            if group == (axis,):
                return i
        return None


@dataclass(frozen=True)
class HostAlias:
    """A host attribute that names a view of a buffer: all of it, or one component of a stacked buffer."""

    attr: str
    buffer: str
    component: int | None = None


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
    """The host side of a pool: buffers, item parts, aliases, and sizes."""

    layout: Layout
    num_pages: int
    tokens_per_page: int
    num_layers: int
    buffers: tuple[HostBufferSpec, ...]
    parts: tuple[HostPart, ...]
    aliases: tuple[HostAlias, ...]

    @property
    def num_items(self) -> int:
        return self.num_pages * self.tokens_per_page


def _parts_and_buffers(geometry: PoolGeometry, layout: Layout) -> tuple[list[tuple], bool, list[HostAlias]]:
    """``(name, component, dim range, buffer attr)`` per part; whether parts stack on a component axis; aliases."""
    kind = geometry.decl
    comps = geometry.components
    if kind is None:
        raise ValueError("the geometry has no pool kind declaration")
    if layout.split:
        if kind.split_by is None:
            raise ValueError(f"pool kind {kind.name!r} declares no attribute to split its items at")
        at = geometry.extra(kind.split_by)
        if not 0 < at < comps[0].dim:
            raise ValueError(f"{kind.split_by}={at} does not split an item of {comps[0].dim} elements")
        (first, first_attr), (second, second_attr) = kind.split_parts
        parts = [(first, 0, 0, at, first_attr), (second, 0, at, comps[0].dim, second_attr)]
        aliases = [HostAlias(kind.split_alias, first_attr)] if kind.split_alias else []
        return parts, False, aliases
    equal = len(comps) > 1 and len({(c.heads, c.dim) for c in comps}) == 1
    if layout.components == "stacked" and (not equal or kind.stacked_attr is None):
        why = "its components differ in shape" if not equal else "it names no stacked buffer"
        raise ValueError(f"layout {layout.name!r} stacks components in one buffer, but pool kind {kind.name!r}: {why}")
    if equal and kind.stacked_attr is not None and layout.components != "separate":
        parts = [(c.name, i, 0, c.dim, kind.stacked_attr) for i, c in enumerate(comps)]
        aliases = [HostAlias(c.host_attr, kind.stacked_attr, i) for i, c in enumerate(comps)]
        return parts, True, aliases
    return [(c.name, i, 0, c.dim, c.host_attr) for i, c in enumerate(comps)], False, []


def host_layout_spec(geometry: PoolGeometry, layout: Layout, num_pages: int) -> HostLayoutSpec:
    """Derive host buffer names, shapes and part strides from the layout and pool kind declarations."""
    kind = geometry.decl
    if kind is None:
        raise ValueError("the geometry has no pool kind declaration")
    if layout.pool_kinds is not None and kind.name not in layout.pool_kinds:
        raise ValueError(f"layout {layout.name!r} cannot store pool kind {kind.name!r}")
    if kind.layouts is not None and layout.name not in kind.layouts:
        raise ValueError(f"pool kind {kind.name!r} allows only the layouts {', '.join(sorted(kind.layouts))}")
    comps = geometry.components
    tokens_per_page = 1 if geometry.items_are_pages else geometry.page_size
    parts, stacked, aliases = _parts_and_buffers(geometry, layout)
    # The shape is presented as another layout's where the kind says so (same bytes).
    shape_as = kind.shape_layout(layout.name)
    groups = layout.merge_groups
    if shape_as != layout.name:
        from .registry import get_registry

        groups = get_registry().layouts[shape_as].merge_groups if shape_as in get_registry().layouts else groups
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
            buffers.append(_buffer_spec(attr, axes, sizes, groups, shape_as != layout.name))
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
        aliases=tuple(a for a in aliases if a.attr != a.buffer),
    )


def _buffer_spec(attr: str, axes: list[str], sizes: dict, groups, unit_axes_last: bool) -> HostBufferSpec:
    """Shape a buffer: axes in order, merge groups multiplied into one dimension each."""
    order = list(axes)
    if unit_axes_last:
        # Presenting another layout's shape moves only axes of size one (page rows: the token axis),
        # which changes no byte; put them where that layout has them: right before the item's bytes.
        units = [a for a in order if sizes[a] == 1 and a == "token"]
        order = [a for a in order if a not in units]
        order[-1:-1] = units
        groups = [g for g in groups if "token" not in g]
    dims: list[tuple[str, ...]] = []
    for axis in order:
        group = next((g for g in groups if axis in g), None)
        present = tuple(a for a in group if a in order) if group else ()
        if group and len(present) > 1 and dims and dims[-1][0] in present and axis in present:
            dims[-1] = dims[-1] + (axis,)
        else:
            dims.append((axis,))
    shape = tuple(math.prod(sizes[a] for a in d) for d in dims)
    return HostBufferSpec(attr, shape, tuple(axes), tuple(sizes[a] for a in axes), tuple(dims))


def pages_for(size_tokens: int, page_size: int) -> int:
    """Whole pages needed for ``size_tokens`` token slots."""
    return math.ceil(size_tokens / page_size)
