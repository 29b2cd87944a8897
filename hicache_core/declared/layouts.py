"""Host layouts, declared as data.

A layout is the order of the axes of a host buffer, outermost first. Every
address, shape and stride a transfer needs follows from that order and the
pool's geometry (see :mod:`hicache_core.pool.geometry`), so kernels never special-case
a layout by name and a plugin can add one without touching the core.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .pool_kinds import PoolKind

if TYPE_CHECKING:
    import torch

#: The axes a layout orders. ``component`` is K/V (only present when a pool has
#: several equally-shaped parts stacked in one buffer), ``page`` and ``token``
#: split a token slot into page and position in the page, ``head`` and ``dim``
#: are the item's inner shape (page-row pools have no ``head``).
AXES: tuple[str, ...] = ("component", "layer", "page", "token", "head", "dim")

#: How a layout stores a pool's components: ``"auto"`` stacks equally-shaped components
#: on a ``component`` axis of one buffer where the pool kind names such a buffer (SGLang's
#: MHA ``kv_buffer``) and keeps one buffer per component otherwise; ``"stacked"`` insists
#: on one buffer; ``"separate"`` insists on one buffer per component.
COMPONENT_STORAGE: tuple[str, ...] = ("auto", "stacked", "separate")


#: ``oracle(host_pool, part, layer, item) -> tensor``: where the bytes of one item of one part
#: (``"k"``, ``"v"``, ``"kv"``, ...) of one host layer land, written independently of ``axes``.
Oracle = Callable[[Any, str, int, int], "torch.Tensor"]


@dataclass(frozen=True)
class Layout:
    """One host arrangement of the KV cache.

    :param name: the name servers pass (``layout=...``).
    :param axes: a permutation of :data:`AXES`, outermost first; ``dim`` must be last.
    :param merge_slots: shorthand for ``merge=(("page", "token"),)``: show a buffer's
        pages and tokens as one axis of ``S`` token slots (SGLang's ``layer_first``,
        ``page_first``).
    :param pool_kinds: the pool kinds this layout can store (``None``: any kind whose
        geometry it can be derived for).
    :param split: split each item in two host buffers at the pool kind's split
        attribute (:attr:`hicache_core.declared.pool_kinds.PoolKind.split_by`; MLA's latent and
        rope parts).
    :param merge: groups of adjacent axes that the buffer's shape shows as one
        dimension (e.g. ``(("head", "dim"),)`` for LMCache's ``(2, L, T, H*D)``). Only the
        shape changes; the memory is the same.
    :param components: :data:`COMPONENT_STORAGE`.
    :param oracle: where an item's bytes land, stated independently of ``axes``. A
        layout registers without one, but since hicache-core 0.2.0 the conformance kit
        **fails** every implementation that claims a layout without an oracle
        (docs/plugin-layouts.md, "A worked oracle", has an example).
    :param description: one line for ``hicache matrix`` and the docs.
    :param unsplit_as: for a ``split`` layout, the layout that stores a pool kind with
        nothing to split (one part and no ``split_by``: the DSA indexer's page rows) in
        its place (``page_first_kv_split``: ``page_first``). ``None``: such a kind is
        refused. :meth:`for_kind` applies it.
    """

    name: str
    axes: tuple[str, ...]
    merge_slots: bool = False
    pool_kinds: frozenset[str] | None = None
    split: bool = False
    description: str = ""
    merge: tuple[tuple[str, ...], ...] = ()
    components: str = "auto"
    oracle: Oracle | None = field(default=None, compare=False, repr=False)
    unsplit_as: Layout | None = None

    def __post_init__(self) -> None:
        problems = layout_problems(self)
        if problems:
            raise ValueError(f"invalid layout {self.name!r}: " + "; ".join(problems))

    def allows(self, kind: str) -> bool:
        """Whether this layout's declaration admits pool kind ``kind`` (``pool_kinds`` None: every kind)."""
        return self.pool_kinds is None or kind in self.pool_kinds

    def for_kind(self, kind: PoolKind) -> Layout:
        """The layout that stores ``kind``: this one, or :attr:`unsplit_as` where this layout splits items
        and ``kind`` has nothing to split (a single part and no ``split_by``)."""
        if self.split and self.unsplit_as is not None and kind.split_by is None and len(kind.components) == 1:
            return self.unsplit_as
        return self

    @property
    def merge_groups(self) -> tuple[tuple[str, ...], ...]:
        """Every group of axes shown as one dimension (``merge``, plus page+token for ``merge_slots``)."""
        return (("page", "token"),) + tuple(self.merge) if self.merge_slots else tuple(self.merge)

    def axis_before(self, outer: str, inner: str) -> bool:
        return self.axes.index(outer) < self.axes.index(inner)

    def same_arrangement(self, other: Layout) -> bool:
        """Whether ``other`` lays bytes out and shapes buffers exactly as this one (names aside)."""
        return (
            self.axes == other.axes
            and self.merge_groups == other.merge_groups
            and self.split == other.split
            and self.components == other.components
            and self.pool_kinds == other.pool_kinds
            and self.unsplit_as == other.unsplit_as
        )


def layout_problems(layout: Layout) -> list[str]:
    """Why a declaration is malformed (empty when it is fine)."""
    problems = []
    if not isinstance(layout.name, str) or not layout.name.isidentifier():
        problems.append(f"name must be an identifier, got {layout.name!r}")
    if sorted(layout.axes) != sorted(AXES):
        problems.append(f"axes must be a permutation of {AXES}, got {tuple(layout.axes)}")
        return problems
    if layout.axes[-1] != "dim":
        problems.append("the last axis must be 'dim' (an item's elements are contiguous)")
    seen: set[str] = set()
    for group in layout.merge_groups:
        if len(group) < 2 or any(a not in AXES for a in group):
            problems.append(f"merge group {group} must name two or more axes of {AXES}")
            continue
        if seen & set(group):
            problems.append(f"merge group {group} overlaps another group")
        seen |= set(group)
        first = layout.axes.index(group[0])
        if tuple(layout.axes[first : first + len(group)]) != tuple(group):
            problems.append(f"merge group {group} must be adjacent axes in the layout's order {layout.axes}")
    if layout.components not in COMPONENT_STORAGE:
        problems.append(f"components must be one of {COMPONENT_STORAGE}, got {layout.components!r}")
    if layout.pool_kinds is not None and not isinstance(layout.pool_kinds, frozenset):
        problems.append("pool_kinds must be a frozenset of pool kind names, or None (any)")
    if layout.oracle is not None and not callable(layout.oracle):
        problems.append("oracle must be callable: oracle(host_pool, part, layer, item) -> tensor")
    if layout.unsplit_as is not None and not (layout.split and isinstance(layout.unsplit_as, Layout)
                                              and not layout.unsplit_as.split):  # fmt: skip
        problems.append("unsplit_as must be a layout that does not split, given only for a layout that splits")
    return problems


def _oracle(name: str) -> Oracle:
    # Bound lazily so that this module stays free of torch and the oracles stay in their own module.
    def lookup(host: Any, part: str, layer: int, item: int):
        from .layout_oracles import SGLANG_ORACLES

        return SGLANG_ORACLES[name](host, part, layer, item)

    return lookup


LAYER_FIRST = Layout(
    "layer_first",
    ("component", "layer", "page", "token", "head", "dim"),
    merge_slots=True,
    description="mirrors the device: one [S, H, D] slab per layer",
    oracle=_oracle("layer_first"),
)
PAGE_FIRST = Layout(
    "page_first",
    ("component", "page", "token", "layer", "head", "dim"),
    merge_slots=True,
    description="token-major: a token's layers are contiguous, a page is one blob per K/V",
    oracle=_oracle("page_first"),
)
PAGE_FIRST_DIRECT = Layout(
    "page_first_direct",
    ("component", "page", "layer", "token", "head", "dim"),
    description="per (page, layer) one contiguous run equal to the device slab of the page",
    oracle=_oracle("page_first_direct"),
)
PAGE_HEAD = Layout(
    "page_head",
    ("component", "page", "head", "token", "layer", "dim"),
    pool_kinds=frozenset({"mha", "mha_asym"}),
    description="per (page, head) contiguous, so storage can split heads across TP ranks",
    oracle=_oracle("page_head"),
)
PAGE_FIRST_KV_SPLIT = Layout(
    "page_first_kv_split",
    ("component", "page", "layer", "token", "head", "dim"),
    split=True,
    description="MLA latent and rope parts in two page_first_direct buffers (a one-part kind: page_first)",
    oracle=_oracle("page_first_kv_split"),
    # SGLang raises "Unsupported layout" for the DSA indexer here, mid-construction; a pool with one
    # part has nothing to split, and page_first is SGLang's own layout for it.
    unsplit_as=PAGE_FIRST,
)

BUILTIN_LAYOUTS: tuple[Layout, ...] = (
    LAYER_FIRST,
    PAGE_FIRST,
    PAGE_FIRST_DIRECT,
    PAGE_HEAD,
    PAGE_FIRST_KV_SPLIT,
)
