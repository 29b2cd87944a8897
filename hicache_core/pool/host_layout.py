"""Where a layout puts a pool's bytes on the host: buffers, their shapes, and every part's strides.

:func:`host_layout_spec` turns a :class:`~hicache_core.pool.geometry.PoolGeometry` and a
:class:`~hicache_core.declared.layouts.Layout` into host buffers (names, shapes) and, for every part
of an item, its strides, from the declarations alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..declared.layouts import Layout

if TYPE_CHECKING:
    from .geometry import PoolGeometry


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
    # A split layout stores a kind with nothing to split as its declared unsplit twin; the spec (and the
    # pool built from it) is that layout's, so the kind's own layouts are checked against it.
    layout = layout.for_kind(kind)
    if not layout.allows(kind.name):
        raise ValueError(f"layout {layout.name!r} cannot store pool kind {kind.name!r}")
    if kind.layouts is not None and layout.name not in kind.layouts:
        raise ValueError(f"pool kind {kind.name!r} allows only the layouts {', '.join(sorted(kind.layouts))}")
    comps = geometry.components
    tokens_per_page = 1 if geometry.items_are_pages else geometry.page_size
    parts, stacked, aliases = _parts_and_buffers(geometry, layout)
    # The shape is presented as another layout's where the kind says so (same bytes); the registry
    # that holds the kind has bound that layout's declaration to it.
    presented = kind.presented_as(layout)
    groups = presented.merge_groups
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
            buffers.append(_buffer_spec(attr, axes, sizes, groups, presented is not layout))
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
