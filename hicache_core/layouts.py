"""Host layouts, declared as data.

A layout is the order of the axes of a host buffer, outermost first. Every
address, shape and stride a transfer needs follows from that order and the
pool's geometry (see :mod:`hicache_core.geometry`), so kernels never special-case
a layout by name and a plugin can add one without touching the core.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: The axes a layout orders. ``component`` is K/V (only present when a pool has
#: several equally-shaped parts stacked in one buffer), ``page`` and ``token``
#: split a token slot into page and position in the page, ``head`` and ``dim``
#: are the item's inner shape (page-row pools have no ``head``).
AXES: tuple[str, ...] = ("component", "layer", "page", "token", "head", "dim")

POOL_KINDS: tuple[str, ...] = ("mha", "mha_asym", "mla", "page_rows")


@dataclass(frozen=True)
class Layout:
    """One host arrangement of the KV cache.

    :param name: the name servers pass (``layout=...``).
    :param axes: a permutation of :data:`AXES`, outermost first; ``dim`` must be last.
    :param merge_slots: show ``page`` and ``token`` as one axis of ``S`` token slots
        in the buffer's shape (SGLang's ``layer_first`` and ``page_first``). Only the
        shape changes; the memory is the same.
    :param pool_kinds: the pool kinds this layout can store.
    :param split_at: name of a geometry attribute (e.g. ``"kv_lora_rank"``); when set,
        each item is split at that many elements into two host buffers ``k_buffer``
        and ``v_buffer`` (MLA latent part and rope part).
    :param description: one line for ``hicache matrix`` and the docs.
    """

    name: str
    axes: tuple[str, ...]
    merge_slots: bool = False
    pool_kinds: frozenset[str] = field(default_factory=lambda: frozenset(POOL_KINDS))
    split_at: str | None = None
    description: str = ""

    def __post_init__(self) -> None:
        problems = layout_problems(self)
        if problems:
            raise ValueError(f"invalid layout {self.name!r}: " + "; ".join(problems))

    def axis_before(self, outer: str, inner: str) -> bool:
        return self.axes.index(outer) < self.axes.index(inner)


def layout_problems(layout: Layout) -> list[str]:
    """Why a declaration is malformed (empty when it is fine)."""
    problems = []
    if not isinstance(layout.name, str) or not layout.name.isidentifier():
        problems.append(f"name must be an identifier, got {layout.name!r}")
    if sorted(layout.axes) != sorted(AXES):
        problems.append(f"axes must be a permutation of {AXES}, got {tuple(layout.axes)}")
    elif layout.axes[-1] != "dim":
        problems.append("the last axis must be 'dim' (an item's elements are contiguous)")
    elif layout.merge_slots and layout.axes.index("token") != layout.axes.index("page") + 1:
        problems.append("merge_slots needs 'token' right after 'page'")
    unknown = set(layout.pool_kinds) - set(POOL_KINDS)
    if unknown:
        problems.append(f"unknown pool kinds {sorted(unknown)}; known: {list(POOL_KINDS)}")
    return problems


LAYER_FIRST = Layout(
    "layer_first",
    ("component", "layer", "page", "token", "head", "dim"),
    merge_slots=True,
    description="mirrors the device: one [S, H, D] slab per layer",
)
PAGE_FIRST = Layout(
    "page_first",
    ("component", "page", "token", "layer", "head", "dim"),
    merge_slots=True,
    description="token-major: a token's layers are contiguous, a page is one blob per K/V",
)
PAGE_FIRST_DIRECT = Layout(
    "page_first_direct",
    ("component", "page", "layer", "token", "head", "dim"),
    description="per (page, layer) one contiguous run equal to the device slab of the page",
)
PAGE_HEAD = Layout(
    "page_head",
    ("component", "page", "head", "token", "layer", "dim"),
    pool_kinds=frozenset({"mha", "mha_asym"}),
    description="per (page, head) contiguous, so storage can split heads across TP ranks",
)
PAGE_FIRST_KV_SPLIT = Layout(
    "page_first_kv_split",
    ("component", "page", "layer", "token", "head", "dim"),
    pool_kinds=frozenset({"mla"}),
    split_at="kv_lora_rank",
    description="MLA latent and rope parts in two page_first_direct buffers",
)

BUILTIN_LAYOUTS: tuple[Layout, ...] = (
    LAYER_FIRST,
    PAGE_FIRST,
    PAGE_FIRST_DIRECT,
    PAGE_HEAD,
    PAGE_FIRST_KV_SPLIT,
)
