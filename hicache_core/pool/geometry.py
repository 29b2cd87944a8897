"""Pool geometry: what a device pool holds.

:class:`PoolGeometry` is pure data (no tensors), so the dispatcher, the CLI and
``hicache explain`` can reason about a pool without allocating one. Where a layout puts
it on the host is :mod:`hicache_core.pool.host_layout`. Both read only declarations
(:class:`~hicache_core.declared.pool_kinds.PoolKind`, ``Layout``): no pool kind or layout is
special-cased by name, and neither looks a name up in a registry.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..declared.pool_kinds import PoolKind
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
    if pool_kinds is None:
        # The process registry is the door's default (hicache_core.geometry_of), not this module's.
        raise TypeError(
            "pass pool_kinds= (a registry's pool_kinds); hicache_core.geometry_of and host_pool.pool_kind_of "
            "use the process registry's"
        )
    return pool_kinds


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


def pages_for(size_tokens: int, page_size: int) -> int:
    """Whole pages needed for ``size_tokens`` token slots."""
    return math.ceil(size_tokens / page_size)
