"""Pool kinds, declared as data.

A pool kind says what a device pool holds and how hicache finds it there: its
components (with SGLang's attribute names on the device and on the host), whether
an item is one token or one whole page, the item shape, which geometry attribute
splits an item in two, and how to recognise such a device pool by duck typing.
Everything else (host shapes, strides, buffer names, what each implementation can
serve) follows from the declaration, so a plugin adds a kind through
``hicache_register_pool_kinds`` without touching the core, and the core branches on
no pool-kind name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

#: Items of a token kind are one token slot: device rows ``(slots, heads, dim)``. Items of a
#: page kind are one whole page: device rows ``(pages, row)``, moved as bytes.
ITEM_KINDS = ("token", "page")


@dataclass(frozen=True)
class ComponentDecl:
    """One per-layer device tensor family of a pool kind.

    :param name: the short name of the part it becomes (``"k"``, ``"v"``, ``"kv"``, ``"row"``).
    :param device_attr: the device pool attribute holding one tensor per owned layer.
    :param host_attr: the host pool attribute of its buffer when it has a buffer of its own.
    :param example: a small row shape for tests and demos: ``(heads, dim)`` for token kinds,
        ``(row_bytes,)`` for page kinds.
    """

    name: str
    device_attr: str
    host_attr: str
    example: tuple[int, ...] = ()


@dataclass(frozen=True)
class PoolKind:
    """What a device pool of one kind holds, as data.

    :param name: the kind's name (``hicache matrix --pool``, ``pool_kind`` on a device pool).
    :param components: its per-layer tensor families, in order.
    :param item: ``"token"`` or ``"page"`` (:data:`ITEM_KINDS`).
    :param stacked_attr: the host attribute of one buffer that stacks equally-shaped
        components on a leading component axis (SGLang's MHA ``kv_buffer``); ``None``:
        one buffer per component.
    :param split_by: the geometry attribute at which an item splits in two for layouts
        that ask for it (MLA: ``"kv_lora_rank"``); ``None``: items do not split.
    :param split_parts: for a split, each half's part name and host attribute.
    :param split_alias: for a split, a host attribute that names the first half too.
    :param extras: integer attributes of the device pool that its geometry keeps.
    :param detect: recognises a device pool of this kind by its attributes (duck typing);
        an explicit ``pool_kind`` attribute on a device pool always wins.
    :param layouts: the layouts this kind allows (``None``: every layout that can be derived).
    :param shape_as: ``((layout, other), ...)``: present ``layout``'s buffers with ``other``'s
        shape (same bytes; SGLang's DSA indexer uses one shape for two layouts).
    :param rank_replicated: every tensor-parallel rank holds the same bytes (MLA), so
        storage keys leave out the TP rank.
    :param example_extras: values of ``extras`` for tests and demos.
    :param description: one line for ``hicache matrix`` and the docs.
    """

    name: str
    components: tuple[ComponentDecl, ...]
    item: str = "token"
    stacked_attr: str | None = None
    split_by: str | None = None
    split_parts: tuple[tuple[str, str], tuple[str, str]] = (("k", "k_buffer"), ("v", "v_buffer"))
    split_alias: str | None = None
    extras: tuple[str, ...] = ()
    detect: Callable[[Any], bool] | None = field(default=None, compare=False, repr=False)
    layouts: frozenset[str] | None = None
    shape_as: tuple[tuple[str, str], ...] = ()
    rank_replicated: bool = False
    example_extras: tuple[tuple[str, int], ...] = ()
    description: str = ""
    #: ``shape_as`` with each other layout's declaration, bound by the registry that holds this kind.
    shape_layouts: tuple[tuple[str, Any], ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        problems = pool_kind_problems(self)
        if problems:
            raise ValueError(f"invalid pool kind {self.name!r}: " + "; ".join(problems))

    @property
    def items_are_pages(self) -> bool:
        return self.item == "page"

    def shape_layout(self, layout: str) -> str:
        """The layout whose shape ``layout``'s buffers are presented with for this kind."""
        for name, other in self.shape_as:
            if name == layout:
                return other
        return layout

    def resolved(self, layouts: Mapping[str, Any]) -> tuple[PoolKind, list[str]]:
        """This kind with its ``shape_as`` names bound to the declarations in ``layouts``, and the names missing."""
        bound = tuple((name, layouts[other]) for name, other in self.shape_as if other in layouts)
        missing = [other for _, other in self.shape_as if other not in layouts]
        if bound == self.shape_layouts and all(a[1] is b[1] for a, b in zip(bound, self.shape_layouts)):
            return self, missing
        return replace(self, shape_layouts=bound), missing

    def presented_as(self, layout: Any) -> Any:
        """The layout declaration whose shape ``layout``'s buffers take for this kind (``layout`` itself if none)."""
        other = self.shape_layout(layout.name)
        if other == layout.name:
            return layout
        for name, decl in self.shape_layouts:
            if name == layout.name:
                return decl
        raise ValueError(
            f"pool kind {self.name!r} presents layout {layout.name!r} with layout {other!r}'s shape, but {other!r} "
            "is not bound: take the kind from a registry that holds that layout (registry.pool_kinds)"
        )


def pool_kind_problems(kind: PoolKind) -> list[str]:
    """Why a pool kind declaration is malformed (empty when it is fine)."""
    problems = []
    if not isinstance(kind.name, str) or not kind.name.isidentifier():
        problems.append(f"name must be an identifier, got {kind.name!r}")
    if not kind.components or not all(isinstance(c, ComponentDecl) for c in kind.components):
        problems.append("components must be a non-empty tuple of ComponentDecl")
        return problems
    names = [c.name for c in kind.components]
    if len(set(names)) != len(names):
        problems.append(f"component names must differ, got {names}")
    if len({c.device_attr for c in kind.components}) != len(kind.components):
        problems.append("component device attributes must differ")
    if kind.item not in ITEM_KINDS:
        problems.append(f"item must be one of {ITEM_KINDS}, got {kind.item!r}")
    for c in kind.components:
        want = 1 if kind.item == "page" else 2
        if c.example and (len(c.example) != want or min(c.example) < 1):
            problems.append(f"component {c.name!r}: example must be {want} positive ints for {kind.item} items")
    if kind.split_by is not None and len(kind.components) != 1:
        problems.append("split_by needs exactly one component")
    if kind.split_by is not None and kind.split_by not in kind.extras:
        problems.append(f"split_by {kind.split_by!r} must be one of extras {kind.extras}")
    return problems


# ---- detection helpers, for declarations ---------------------------------------------------------


def _layers(pool: Any, attr: str) -> list | None:
    value = getattr(pool, attr, None)
    if value is None:
        return None
    try:
        return list(value)
    except TypeError:
        return None


def has_layers(*attrs: str) -> Callable[[Any], bool]:
    """A detector: the pool has a non-empty list of per-layer tensors under each attribute."""

    def detect(pool: Any) -> bool:
        return all(bool(_layers(pool, a)) for a in attrs)

    return detect


def lacks(attr: str) -> Callable[[Any], bool]:
    """A detector: the pool has no per-layer tensors under ``attr``."""

    def detect(pool: Any) -> bool:
        return not _layers(pool, attr)

    return detect


def rows_equal(a: str, b: str) -> Callable[[Any], bool]:
    """A detector: the rows of ``a`` and ``b`` have one shape (MHA with ``head_dim == v_head_dim``)."""

    def detect(pool: Any) -> bool:
        return tuple(_layers(pool, a)[0].shape[1:]) == tuple(_layers(pool, b)[0].shape[1:])

    return detect


def all_of(*detectors: Callable[[Any], bool]) -> Callable[[Any], bool]:
    def detect(pool: Any) -> bool:
        return all(d(pool) for d in detectors)

    return detect


def none_of(detector: Callable[[Any], bool]) -> Callable[[Any], bool]:
    def detect(pool: Any) -> bool:
        return not detector(pool)

    return detect


# ---- the built-in kinds (registered by the core through the same hook as a plugin's) --------------

_K = ComponentDecl("k", "k_buffer", "k_buffer", (2, 8))
_V = ComponentDecl("v", "v_buffer", "v_buffer", (2, 8))
_SAME_KV = all_of(has_layers("k_buffer", "v_buffer"))

MHA = PoolKind(
    "mha",
    (_K, _V),
    stacked_attr="kv_buffer",
    detect=lambda pool: _SAME_KV(pool) and rows_equal("k_buffer", "v_buffer")(pool),
    description="multi-head attention: K and V of equal shape, one stacked kv_buffer on the host",
)
MHA_ASYM = PoolKind(
    "mha_asym",
    (_K, ComponentDecl("v", "v_buffer", "v_buffer", (2, 4))),
    detect=lambda pool: _SAME_KV(pool) and not rows_equal("k_buffer", "v_buffer")(pool),
    description="MHA with head_dim != v_head_dim (MiMo-V2): separate k_buffer and v_buffer",
)
MHA_K_ONLY = PoolKind(
    "mha_k_only",
    (_K,),
    detect=all_of(has_layers("k_buffer"), lacks("v_buffer")),
    layouts=frozenset({"layer_first", "page_first", "page_first_direct"}),
    description="K only (MiniMax's sparse index-K pool): one k_buffer",
)
MLA = PoolKind(
    "mla",
    (ComponentDecl("kv", "kv_buffer", "kv_buffer", (1, 24)),),
    split_by="kv_lora_rank",
    split_alias="kv_buffer",
    extras=("kv_lora_rank", "qk_rope_head_dim"),
    example_extras=(("kv_lora_rank", 16), ("qk_rope_head_dim", 8)),
    detect=has_layers("kv_buffer"),
    rank_replicated=True,
    description="multi-head latent attention: one latent+rope row per token (kv_buffer)",
)
PAGE_ROWS = PoolKind(
    "page_rows",
    (ComponentDecl("row", "index_k_with_scale_buffer", "index_k_with_scale_buffer", (24,)),),
    item="page",
    detect=has_layers("index_k_with_scale_buffer"),
    layouts=frozenset({"layer_first", "page_first", "page_first_direct"}),
    shape_as=(("page_first", "page_first_direct"),),
    description="DSA indexer: one uint8 row per page (index_k_with_scale_buffer)",
)
DSV4_PAGED = PoolKind(
    "dsv4_paged",
    (ComponentDecl("row", "device_buffers", "kv_buffer", (40,)),),
    item="page",
    detect=has_layers("device_buffers"),
    layouts=frozenset({"layer_first", "page_first", "page_first_direct"}),
    description="DeepSeek-V4 paged sub-pool (C4/C128 KV, C4 indexer): one uint8 row per page",
)
DSV4_STATE = PoolKind(
    "dsv4_state",
    (ComponentDecl("state", "device_page_views", "kv_buffer", (48,)),),
    item="page",
    detect=has_layers("device_page_views"),
    layouts=frozenset({"layer_first", "page_first", "page_first_direct"}),
    description="DeepSeek-V4 compress-state ring: one state page (ring_size slots) per SWA page",
)

MAMBA = PoolKind(
    "mamba",
    (
        ComponentDecl("temporal", "temporal_layers", "temporal_buffer", (64,)),
        ComponentDecl("conv", "conv_layers", "conv_buffer", (32,)),
    ),
    item="page",
    detect=has_layers("temporal_layers", "conv_layers"),
    # SGLang's MambaPoolHost: page size 1 (an item is one request slot), page-first layouts only,
    # both with the shape (slots, layers, 1, *state).
    layouts=frozenset({"page_first", "page_first_direct"}),
    shape_as=(("page_first", "page_first_direct"),),
    description="Mamba / linear-attention state per request slot: SSM (temporal) and conv state rows, page size 1",
)

NVFP4_PAGE_ROWS = PoolKind(
    "nvfp4_page_rows",
    (ComponentDecl("row", "rows", "kv_buffer", (48,)),),
    item="page",
    detect=has_layers("rows"),
    # SGLang's MiniMaxM3Nvfp4*PoolHost: layer_first (layers, pages, row); page_first and
    # page_first_direct both (pages, layers, 1, row).
    layouts=frozenset({"layer_first", "page_first", "page_first_direct"}),
    shape_as=(("page_first", "page_first_direct"),),
    description="NVFP4 page rows with their block scales inside (MiniMax-M3 NVFP4 main K/V and index K): "
    "one uint8 row per (layer, page)",
)
KV_SCALE_PAGES = PoolKind(
    "kv_scale_pages",
    (
        ComponentDecl("k_scale", "k_scale_device_rows", "k_scale_host", (32,)),
        ComponentDecl("v_scale", "v_scale_device_rows", "v_scale_host", (32,)),
    ),
    item="page",
    detect=has_layers("k_scale_device_rows", "v_scale_device_rows"),
    # SGLang's MHATokenToKVPoolMXFP8Host: a page's interleaved UE8M0 scales are one block, kept
    # (pages, layers, bytes) beside the page_first FP8 payload; no other layout.
    layouts=frozenset({"page_first"}),
    description="MXFP8 K/V scale sidecar: one interleaved E8M0 scale block per (layer, page) for K and for V",
)

BUILTIN_POOL_KINDS: tuple[PoolKind, ...] = (MHA, MHA_ASYM, MHA_K_ONLY, MLA, PAGE_ROWS, DSV4_PAGED, DSV4_STATE, MAMBA,
                                            NVFP4_PAGE_ROWS, KV_SCALE_PAGES)  # fmt: skip

#: The names of the built-in pool kinds (plugins may register more: ``get_registry().pool_kinds``).
POOL_KINDS: tuple[str, ...] = tuple(k.name for k in BUILTIN_POOL_KINDS)
