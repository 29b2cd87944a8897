"""``jit.one_layer``: one-layer transfers with kernels specialised for each pool shape.

It serves the two one-layer operations (``load_to_device_per_layer`` and
``backup_from_device_per_layer``) of io backend ``"kernel"``, at a higher priority than
hicache-kernel's generic kernel, for every layout whose per-layer host view is rows of
one item. A row is addressed as ``base + (item // tokens_per_page) * page_stride +
(item % tokens_per_page) * token_stride``; where ``page_stride == tokens_per_page *
token_stride`` (or pages hold one item) that folds into one uniform stride.

The item size, strides, word size and tile shape are Triton ``constexpr`` values, so each
pool shape gets its own compiled kernel: compiled on the first call that needs it, kept in
a process-wide table keyed by the specialisation (:func:`compiled_keys`,
:func:`compile_count`, :func:`compile_seconds`), never at import. Later calls go straight
to the compiled kernel's launcher with argument tuples built when the host pool was made.

This module does not import triton; the kernels live in :mod:`hicache_jit._kernels`,
imported on the first transfer.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache_core import BACKUP_ALL, BACKUP_LAYER, LOAD, TransferPlan, TransferRequest
from hicache_core.gpu import uva
from hicache_core.gpu.knobs import Knob, checked, int_at_least
from hicache_core.gpu.triton_base import (
    CALL_PARAMS,
    LaunchGroup,
    TritonImplementation,
    check_kernel_params,
    compiled_entries,
    load_triton_runtime,
    max_items_for,
)

ENV_VARIANT = "HICACHE_JIT_VARIANT"
ENV_MAX_CTAS = "HICACHE_JIT_MAX_CTAS"
ENV_TILE_BYTES = "HICACHE_JIT_TILE_BYTES"
ENV_NUM_WARPS = "HICACHE_JIT_NUM_WARPS"
ENV_HINTS = "HICACHE_JIT_HINTS"
ENV_PREFETCH = "HICACHE_JIT_PREFETCH"
ENV_STAGES = "HICACHE_JIT_STAGES"
ENV_FAST_LAUNCH = "HICACHE_JIT_FAST_LAUNCH"

DEFAULT_MAX_CTAS = 8
#: Items wider than this many words are moved by the flat kernel (the row kernel keeps a
#: whole item per row of its tile, which would not fit in registers).
ROW_KERNEL_MAX_WORDS = 1024
#: Most rows per tile, and most words per flat tile (register budget).
MAX_TILE_ROWS = 1024
MAX_FLAT_BLOCK = 4096
#: Row indices are int32 in the row kernel, and its prefetch looks up to a grid's worth of tiles ahead.
_MAX_ROW_ITEMS = 2**30

#: Host-side cache hints: none; loads ``.cg`` (L2 only) and stores ``.cs`` (streaming);
#: ``evict_first`` on loads and stores. (ptxas refuses ``.cg`` together with ``evict_first``.)
HINTS = {"none": 0, "cg": 1, "evict_first": 2}
#: Row kernel prefetch: none; the next tile's indices; the next tile's indices and data.
PREFETCH = {"none": 0, "indices": 1, "data": 2}
KERNELS = ("rows", "flat")


@dataclass(frozen=True)
class Variant:
    """A preset of the launch configuration (select with ``HICACHE_JIT_VARIANT`` or ``impl.variant``)."""

    name: str
    kernel: str  # one of KERNELS
    tile_bytes: int
    num_warps: int
    hints: int
    prefetch: int
    stages: int
    description: str


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("rows", "rows", 32 * 1024, 8, HINTS["cg"], 0, 0, "tiles of whole items (~32 KB), load then store"),
        Variant(
            "rows_pipelined", "rows", 32 * 1024, 8, HINTS["cg"], 2, 0,
            "tiles of whole items (~32 KB), the next tile's loads issued before this tile's stores",
        ),
        Variant(
            "rows_wide", "rows", 64 * 1024, 16, HINTS["cg"], 2, 0,
            "tiles of whole items (~64 KB), 16 warps, two tiles in flight",
        ),
        Variant("flat", "flat", 32 * 1024, 8, HINTS["cg"], 0, 0, "tiles of 32 KB of consecutive words, any item size"),
        Variant(
            "rows_prefetch", "rows", 32 * 1024, 8, HINTS["cg"], 1, 0,
            "tiles of whole items (~32 KB); the next tile's indices load while this tile's host accesses fly",
        ),
        Variant(
            "rows_deep", "rows", 128 * 1024, 8, HINTS["cg"], 1, 0,
            "tiles of ~128 KB with 8 warps: 4x the 16-byte loads in flight per thread; indices prefetched",
        ),
        Variant(
            "rows_async", "rows", 32 * 1024, 8, HINTS["cg"], 0, 4,
            "Triton's software pipelining over 4 stages: 3 tiles (~96 KB) of host reads in flight per CTA, as "
            "asynchronous copies into shared memory",
        ),
        Variant(
            "rows_async_small", "rows", 16 * 1024, 8, HINTS["cg"], 0, 6,
            "software pipelining over 6 stages of ~16 KB tiles (~80 KB in flight per CTA)",
        ),
    )
}  # fmt: skip
#: Chosen on the H200 (benchmarks/results/jit-variants-h200.json): "rows" was within 0.01 of the best variant
#: at 8 CTAs on 16 of 20 (shape, layout, operation) rows; the pipelined variant gained nothing measurable.
DEFAULT_VARIANT = "rows"


# ---- the process-wide table of specialisations ----------------------------------------------------


@dataclass(frozen=True)
class KernelKey:
    """One specialisation: which kernel, direction, index dtypes, element type, constexprs, warps, device."""

    kernel: str
    to_device: bool
    host_index_dtype: str
    device_index_dtype: str
    element: str
    constexprs: tuple[tuple[str, int], ...]
    num_warps: int
    device: str

    def __str__(self) -> str:
        consts = ",".join(f"{k}={int(v)}" for k, v in self.constexprs)
        way = "h2d" if self.to_device else "d2h"
        return (
            f"{self.kernel}/{way}/{self.host_index_dtype},{self.device_index_dtype}/{self.element}/w{self.num_warps}/"
            f"{self.device}[{consts}]"
        )


def compiled_keys() -> list[KernelKey]:
    """Every specialisation built in this process, in the order they were first used."""
    return list(compiled_entries(JitOneLayer.name))


def compile_count() -> int:
    """How many specialisations were built in this process (a repeated key builds nothing)."""
    return len(compiled_entries(JitOneLayer.name))


def compile_seconds() -> dict[KernelKey, float]:
    """Seconds the first call of each specialisation took (compiling, or loading from Triton's disk cache)."""
    return {key: entry.seconds for key, entry in compiled_entries(JitOneLayer.name).items()}  # type: ignore[misc]


def triton_cache_entries() -> int:
    """Compiled kernels held in Triton's own in-memory caches for this plugin's kernels (0 before first use)."""
    module = _kernels_module
    if module is None:
        return 0
    total = 0
    for kernel in (module.rows_kernel, module.flat_kernel):
        for cache in getattr(kernel, "device_caches", {}).values():
            total += len(cache[0])
    return total


#: The kernels' parameters after :data:`~hicache_core.gpu.triton_base.CALL_PARAMS`: the layer's
#: addresses, then the constexprs of each kernel. The argument tuples are built in this order
#: (checked when the kernels load).
LAYER_PARAMS = ("host_a", "dev_a", "host_b", "dev_b", "dev_rows", "host_items")
ROWS_CONSTEXPRS = ("TO_DEVICE", "HINTS", "VEC", "TPP", "A_PAGE", "A_TOKEN", "A_ROW", "A_MAIN", "A_TAIL", "A_TAILPAD",
                   "B_PAGE", "B_TOKEN", "B_ROW", "B_MAIN", "B_TAIL", "B_TAILPAD",
                   "ROWS", "PREFETCH", "STAGES")  # fmt: skip
FLAT_CONSTEXPRS = ("TO_DEVICE", "HINTS", "VEC", "TPP", "A_PAGE", "A_TOKEN", "A_ROW", "A_WORDS",
                   "B_PAGE", "B_TOKEN", "B_ROW", "B_WORDS", "BLOCK")  # fmt: skip
CONSTEXPRS = {"rows": ROWS_CONSTEXPRS, "flat": FLAT_CONSTEXPRS}

_kernels_module: Any = None


def _kernels() -> Any:
    """Import the kernels (and triton) on first use."""
    global _kernels_module
    if _kernels_module is None:
        from . import _kernels as module

        for kind, constexprs in CONSTEXPRS.items():
            check_kernel_params(getattr(module, f"{kind}_kernel"), CALL_PARAMS + LAYER_PARAMS + constexprs)
        load_triton_runtime()
        _kernels_module = module
    return _kernels_module


# ---- configuration helpers ----------------------------------------------------------------------


def _pow2_near(x: float) -> int:
    """The power of two nearest to ``x`` on a log scale (at least 1)."""
    if x <= 1:
        return 1
    low = 1 << (int(x).bit_length() - 1)
    return low * 2 if x * x > 2 * low * low else low


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def _split_words(words: int) -> tuple[int, int, int]:
    """``(main, tail, padded tail)``: a power-of-two block plus the rest padded to a power of two."""
    main = _pow2_floor(words)
    tail = words - main
    return main, tail, (1 << (tail - 1).bit_length()) if tail else 0


def _known_variant(name: str) -> str:
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r} ({ENV_VARIANT}); variants: {', '.join(VARIANTS)}")
    return name


@dataclass(eq=False)
class _Group(LaunchGroup):
    """Up to two parts of the plan moved by one launch, with what every call needs precomputed."""

    words: tuple[int, int] = (0, 0)  # words per item of part A and part B (0: no part B)
    strides: tuple[int, ...] = ()  # TPP, then per part (page, token, device row) in elements
    layer_args: list[tuple[int, ...]] = field(default_factory=list)  # per host layer: LAYER_PARAMS
    kernel: str = "rows"
    per_tile: int = 1  # rows per tile (rows kernel) or words per tile (flat kernel)
    total_words: int = 0
    max_items: int = 1  # most items one call may address
    tail: dict[bool, tuple] = field(default_factory=dict)  # per direction: the constexpr arguments


def _fold_strides(tokens_per_page: int, parts: list[uva.UVAPart]) -> tuple[int, ...]:
    """``(TPP, page, token, row per part)``; a uniform stride folds into ``TPP = 1`` and one page stride."""
    uniform = tokens_per_page == 1 or all(p.host_page_stride == tokens_per_page * p.host_token_stride for p in parts)
    out: list[int] = [1 if uniform else tokens_per_page]
    for p in parts:
        if tokens_per_page == 1:
            out += [p.host_page_stride, 0, p.device_row_stride]
        elif uniform:
            out += [p.host_token_stride, 0, p.device_row_stride]
        else:
            out += [p.host_page_stride, p.host_token_stride, p.device_row_stride]
    return tuple(out)


def _row_problems(request: TransferRequest) -> list[str]:
    """Why the per-layer host view of ``request``'s layout is not rows of one item (empty: it is)."""
    spec = request.host_spec
    comps = request.geometry.components
    for part in spec.parts:
        if part.heads > 1 and part.head_stride != part.dim:
            return [
                f"layout {request.layout.name!r} splits each item across heads on the host (head stride "
                f"{part.head_stride} elements, head size {part.dim}), so a layer's host view is not rows of one "
                "item; hicache-kernel's kernel.triton_uva serves it under the same io backend, or use a layout "
                "with whole-item rows (layer_first, page_first, page_first_direct)"
            ]
        if part.heads > 1 and part.dim != comps[part.component].dim:
            return [
                f"layout {request.layout.name!r} keeps a slice of each head, so an item is not contiguous on the "
                "device; hicache-kernel's kernel.triton_uva serves it under the same io backend"
            ]
    return []


# ---- the implementation -------------------------------------------------------------------------


class JitOneLayer(TritonImplementation):
    """One-layer loads and backups with Triton kernels specialised per pool shape, compiled on first use.

    Claims the one-layer operations of io backend ``"kernel"`` (priority 60, above
    hicache-kernel's 50) for every layout whose per-layer host view is rows of one item.
    Tuning, per instance (``host.implementation_for(op)``): the knobs of
    :class:`~hicache_core.gpu.triton_base.TritonImplementation` (``max_ctas``, default 8 or
    ``HICACHE_JIT_MAX_CTAS``; ``num_warps``; ``stages``; ``fast_launch``), ``variant`` (a
    preset of :data:`VARIANTS`, default ``HICACHE_JIT_VARIANT`` or :data:`DEFAULT_VARIANT`),
    and the knobs a preset sets: ``tile_bytes``, ``num_warps``, ``hints``, ``prefetch``,
    ``stages``.
    """

    name = "jit.one_layer"
    priority = 60
    pool_kinds = None  # every pool kind: the kernels read only the plan's strides
    layouts = None  # any layout whose per-layer host view is rows of one item: see not_supported_reasons
    operations = frozenset({LOAD, BACKUP_LAYER})
    description = "one-layer kernels specialised per pool shape and compiled on first use (Triton, UVA)"
    env_prefix = "HICACHE_JIT"
    default_max_ctas = DEFAULT_MAX_CTAS

    @classmethod
    def not_supported_reasons(cls, request: TransferRequest) -> list[str]:
        reasons = super().not_supported_reasons(request)
        if request.operation == BACKUP_ALL:
            reasons.append(
                "it moves one layer per launch; backup_from_device_all_layer (one launch over every layer) is "
                "served by hicache-kernel (kernel.triton_uva)"
            )
        if request.storable:
            reasons += _row_problems(request)
        return reasons

    def __init__(self, plan: TransferPlan) -> None:
        for part in plan.parts:
            if not (part.host_item_contiguous and part.device_item_contiguous):
                raise ValueError(
                    f"{self.name} moves whole-item rows, but part {part.spec.name!r} of layout {plan.layout.name!r} "
                    "is split across heads; use kernel.triton_uva"
                )
        super().__init__(plan)
        self._num_layers = plan.num_layers
        for first in range(0, len(plan.parts), 2):
            chosen = tuple(range(first, min(first + 2, len(plan.parts))))
            table = uva.layer_offset_table(plan, self._anchor, self._elem_bytes, parts=chosen, device="cpu")
            layer_args = []
            for entries in table.tolist():
                a = entries[0]
                b = entries[1] if len(chosen) == 2 else [0, 0, 0, 0]
                layer_args.append(
                    (a[uva.TABLE_HOST], a[uva.TABLE_DEVICE], b[uva.TABLE_HOST], b[uva.TABLE_DEVICE],
                     a[uva.TABLE_DEVICE_ROWS], a[uva.TABLE_HOST_ITEMS])
                )  # fmt: skip
            parts = [self.uva_parts[i] for i in chosen]
            words = (parts[0].piece_words, parts[1].piece_words if len(parts) == 2 else 0)
            strides = _fold_strides(plan.tokens_per_page, parts)
            self._groups.append(_Group(chosen, words=words, strides=strides, layer_args=layer_args))

        self.variant = DEFAULT_VARIANT
        # The environment's preset, then its overrides of the preset (every knob's variable), checked like
        # values set later.
        self._read_knobs()
        self._finish_init()

    # ---- tuning ------------------------------------------------------------------------------

    variant = Knob(
        lambda _, name: _known_variant(name), env="VARIANT", parse=lambda _, text: text, preset=True,
        changed="_apply_variant",
        doc="The preset last applied (see :data:`VARIANTS`); setting it resets the knobs it sets.",
    )  # fmt: skip

    def _apply_variant(self) -> None:
        preset = VARIANTS[self._variant]
        self._kernel_kind = preset.kernel
        self._tile_bytes = preset.tile_bytes
        self._num_warps = preset.num_warps
        self._hints = preset.hints
        self._prefetch = preset.prefetch
        self._stages = preset.stages
        self._reconfigure()

    tile_bytes = Knob(
        int_at_least(1),
        env="TILE_BYTES", minimum=1,
        doc="Bytes one CTA moves per loop iteration (rounded to whole items, a power of two of them).",
    )  # fmt: skip
    hints = Knob(
        checked(lambda v: v in HINTS.values() and not isinstance(v, bool), f"one of {HINTS}"),
        env="HINTS", parse=lambda _, text: HINTS[text] if text in HINTS else int(text),
        doc="Host-side cache hints: 0 none, 1 ``.cg`` loads / ``.cs`` stores, 2 ``evict_first``.",
    )  # fmt: skip
    prefetch = Knob(
        checked(lambda v: v in PREFETCH.values() and not isinstance(v, bool), f"one of {PREFETCH}"),
        env="PREFETCH", parse=lambda _, text: PREFETCH[text] if text in PREFETCH else int(text),
        doc="Row kernel: 0 none, 1 the next tile's indices, 2 its indices and data (two tiles in flight).",
    )  # fmt: skip

    def launch_config(self) -> list[dict[str, Any]]:
        """Per launch group: the kernel, tile and constexprs a call uses now (for benchmarks and reports)."""
        return [
            {
                "parts": [self.plan.parts[i].spec.name for i in g.parts],
                "kernel": g.kernel,
                "words_per_tile" if g.kernel == "flat" else "rows_per_tile": g.per_tile,
                "tile_bytes": g.per_tile * (1 if g.kernel == "flat" else g.total_words) * self.word_bytes,
                "word_bytes": self.word_bytes,
                "num_warps": self._num_warps,
                "max_ctas": self._max_ctas,
                "constexprs": dict(zip(CONSTEXPRS[g.kernel], g.tail[True])),
            }
            for g in self._groups
        ]

    def _configure(self) -> None:
        """Rebuild the per-direction constexpr tuples and per-layer argument tuples after a tuning change."""
        vec = self._vec
        stages = self._loop_stages()
        threads = 32 * self._num_warps
        for group in self._groups:
            wa, wb = group.words
            group.total_words = wa + wb
            tpp, a_page, a_token, a_row = group.strides[:4]
            b_page, b_token, b_row = group.strides[4:7] if wb else (0, 0, 0)
            kind = self._kernel_kind
            if kind == "rows" and max(wa, wb) > ROW_KERNEL_MAX_WORDS:
                kind = "flat"
            group.kernel = kind
            if kind == "rows":
                am, at, ap = _split_words(wa)
                bm, bt, bp = _split_words(wb) if wb else (0, 0, 0)
                rows = min(_pow2_near(self._tile_bytes / (group.total_words * self.word_bytes)), MAX_TILE_ROWS)
                # Keep the words a thread holds (a [rows, padded words] tile, two when data is prefetched)
                # within its registers, less room for addresses and indices, or the kernel spills.
                budget = (min(255, 65536 // threads) - 48) // 2  # 8-byte elements (two registers each)
                held = (am + ap + bm + bp) * vec * (2 if self._prefetch == 2 else 1)
                while rows > 1 and rows * held > budget * threads:
                    rows //= 2
                group.per_tile = rows
                pipelined = stages if self._prefetch == 0 else 0
                tails = {
                    to_device: (to_device, self._hints, vec, tpp, a_page, a_token, a_row, am, at, ap,
                                b_page, b_token, b_row, bm, bt, bp, rows, self._prefetch, pipelined)
                    for to_device in (True, False)
                }  # fmt: skip
                max_items = _MAX_ROW_ITEMS
            else:
                block = _pow2_near(self._tile_bytes / self.word_bytes)
                group.per_tile = max(threads, min(block, MAX_FLAT_BLOCK))
                tails = {
                    to_device: (to_device, self._hints, vec, tpp, a_page, a_token, a_row, wa, b_page, b_token, b_row,
                                wb, group.per_tile)
                    for to_device in (True, False)
                }  # fmt: skip
                max_items = max_items_for(group.total_words, group.per_tile)
            group.tail = tails
            group.args = {
                to_device: [(self._drop, *layer, *tails[to_device]) for layer in group.layer_args]
                for to_device in (True, False)
            }
            group.max_items = max_items
        self._max_items = min(g.max_items for g in self._groups)  # type: ignore[attr-defined]

    # ---- operations ---------------------------------------------------------------------------

    def load_to_device_per_layer(self, host_indices: torch.Tensor, device_indices: torch.Tensor, layer: int) -> None:
        self._run(host_indices, device_indices, layer, True)

    def backup_from_device_per_layer(
        self, host_indices: torch.Tensor, device_indices: torch.Tensor, layer: int
    ) -> None:
        self._run(host_indices, device_indices, layer, False)

    def _run(self, h: torch.Tensor, d: torch.Tensor, layer: int, to_device: bool) -> None:
        n = self._count(h, d)
        if not 0 <= layer < self._num_layers:
            raise IndexError(f"host layer {layer} is out of range [0, {self._num_layers})")
        if n == 0:
            return
        cap, ready = self._cap, self._ready(h, d, n)
        for group in self._groups:
            per_tile = group.per_tile
            tiles = -(-(n * group.total_words) // per_tile) if group.kernel == "flat" else -(-n // per_tile)
            self._launch(group, tiles if tiles < cap else cap, h, d, n, to_device, group.args[to_device][layer], ready)

    # ---- the kernels ------------------------------------------------------------------------

    def _kernel_for(self, group: LaunchGroup) -> Any:
        assert isinstance(group, _Group)
        return getattr(_kernels(), f"{group.kernel}_kernel")

    def _compile_key(self, group: LaunchGroup, to_device: bool, h: torch.Tensor, d: torch.Tensor) -> Hashable:
        assert isinstance(group, _Group)
        return KernelKey(
            kernel=group.kernel,
            to_device=to_device,
            host_index_dtype=str(h.dtype).removeprefix("torch."),
            device_index_dtype=str(d.dtype).removeprefix("torch."),
            element=self._elem_dtype,
            constexprs=tuple(zip(CONSTEXPRS[group.kernel][1:], (int(v) for v in group.tail[to_device][1:]))),
            num_warps=self._num_warps,
            device=self._device_name,
        )

    def _knob_repr(self) -> str:
        return (
            f"variant={self._variant} {super()._knob_repr()} tile_bytes={self._tile_bytes} hints={self._hints} "
            f"prefetch={self._prefetch}"
        )
