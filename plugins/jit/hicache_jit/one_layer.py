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

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache_core import BACKUP_ALL, BACKUP_LAYER, LOAD, Implementation, TransferPlan, TransferRequest, uva
from hicache_core.triton_support import CudaOrInterpreter, SMBudget, bind_uva_device, interpreting, triton_available
from hicache_core.triton_support import cuda_current_functions as _cuda_current_functions
from hicache_core.triton_support import env_int as _env_int

ENV_VARIANT = "HICACHE_JIT_VARIANT"
ENV_MAX_CTAS = "HICACHE_JIT_MAX_CTAS"
ENV_TILE_BYTES = "HICACHE_JIT_TILE_BYTES"
ENV_NUM_WARPS = "HICACHE_JIT_NUM_WARPS"
ENV_HINTS = "HICACHE_JIT_HINTS"
ENV_PIPELINE = "HICACHE_JIT_PIPELINE"
ENV_FAST_LAUNCH = "HICACHE_JIT_FAST_LAUNCH"

DEFAULT_MAX_CTAS = 8
#: Items wider than this many words are moved by the flat kernel (the row kernel keeps a
#: whole item per row of its tile, which would not fit in registers).
ROW_KERNEL_MAX_WORDS = 1024
#: Most rows per tile, and most words per flat tile (register budget).
MAX_TILE_ROWS = 1024
MAX_FLAT_BLOCK = 4096
_CPU_PROGRAMS = 4  # "unlimited" CTAs where there are no SMs to count (the interpreter)
_INT32_MAX = 2**31 - 1
#: Row indices are int32 in the row kernel, and its prefetch looks up to a grid's worth of tiles ahead.
_MAX_ROW_ITEMS = 2**30

#: Host-side cache hints: none; loads ``.cg`` (L2 only) and stores ``.cs`` (streaming);
#: ``evict_first`` on loads and stores. (ptxas refuses ``.cg`` together with ``evict_first``.)
HINTS = {"none": 0, "cg": 1, "evict_first": 2}


@dataclass(frozen=True)
class Variant:
    """A preset of the launch configuration (select with ``HICACHE_JIT_VARIANT`` or ``impl.variant``)."""

    name: str
    kernel: str  # "rows" or "flat"
    tile_bytes: int
    num_warps: int
    hints: int
    pipeline: bool
    description: str


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant(
            "rows_pipelined", "rows", 32 * 1024, 8, HINTS["cg"], True,
            "tiles of whole items (~32 KB), the next tile's loads issued before this tile's stores",
        ),
        Variant("rows", "rows", 32 * 1024, 8, HINTS["cg"], False, "tiles of whole items (~32 KB), load then store"),
        Variant(
            "rows_wide", "rows", 64 * 1024, 16, HINTS["cg"], True,
            "tiles of whole items (~64 KB), 16 warps, two tiles in flight",
        ),
        Variant("flat", "flat", 32 * 1024, 8, HINTS["cg"], False, "tiles of 32 KB of consecutive words, any item size"),
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


@dataclass
class _Compiled:
    seconds: float
    # Launch mode -> (callable, arguments between the stream and the kernel's arguments); filled on CUDA.
    launchers: dict[int, tuple[Any, tuple]] = field(default_factory=dict)


_compiled: dict[KernelKey, _Compiled] = {}
_compiled_lock = threading.Lock()


def compiled_keys() -> list[KernelKey]:
    """Every specialisation built in this process, in the order they were first used."""
    return list(_compiled)


def compile_count() -> int:
    """How many specialisations were built in this process (a repeated key builds nothing)."""
    return len(_compiled)


def compile_seconds() -> dict[KernelKey, float]:
    """Seconds the first call of each specialisation took (compiling, or loading from Triton's disk cache)."""
    return {key: entry.seconds for key, entry in _compiled.items()}


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


#: The kernels' parameters, in order: per-call arguments, then the constexprs of each kernel.
#: The argument tuples of the launch path are built in this order (checked when the kernels load).
CALL_PARAMS = ("anchor", "hidx", "didx", "h_stride", "d_stride", "n",
               "host_a", "dev_a", "host_b", "dev_b", "dev_rows", "host_items")  # fmt: skip
ROWS_CONSTEXPRS = ("TO_DEVICE", "HINTS", "VEC", "TPP", "A_PAGE", "A_TOKEN", "A_ROW", "A_MAIN", "A_TAIL", "A_TAILPAD",
                   "B_PAGE", "B_TOKEN", "B_ROW", "B_MAIN", "B_TAIL", "B_TAILPAD", "ROWS", "PIPELINE")  # fmt: skip
FLAT_CONSTEXPRS = ("TO_DEVICE", "HINTS", "VEC", "TPP", "A_PAGE", "A_TOKEN", "A_ROW", "A_WORDS",
                   "B_PAGE", "B_TOKEN", "B_ROW", "B_WORDS", "BLOCK")  # fmt: skip

_kernels_module: Any = None
_runtime_knobs: Any = None


def _kernels() -> Any:
    """Import the kernels (and triton) on first use."""
    global _kernels_module, _runtime_knobs
    if _kernels_module is None:
        from . import _kernels as module

        for kernel, constexprs in ((module.rows_kernel, ROWS_CONSTEXPRS), (module.flat_kernel, FLAT_CONSTEXPRS)):
            expected = CALL_PARAMS + constexprs
            names = tuple(getattr(kernel, "arg_names", expected))
            if names != expected:
                raise RuntimeError(f"kernel parameters {names} differ from the argument order {expected}")

        try:
            from triton import knobs

            _runtime_knobs = knobs.runtime
        except ImportError:  # older Triton: no launch hooks to honour
            _runtime_knobs = None
        _kernels_module = module
    return _kernels_module


def _hooks_idle() -> bool:
    """No profiler hook wants to see launches (the direct launch would hide them from it)."""
    knobs = _runtime_knobs
    if knobs is None:
        return True
    for hook in (knobs.launch_enter_hook, knobs.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


def _direct_launchers(compiled: Any) -> dict[int, tuple[Any, tuple]]:
    """Ways to launch a compiled kernel directly: launch mode -> (callable, arguments between stream and kernel's).

    Mode 1: the compiled kernel's launcher (``compiled.run``). Mode 2: the C launch function
    beneath it, where the kernel needs no scratch memory (the Python wrapper only allocates
    scratch). Empty where this Triton's compiled kernel does not look as expected (then every
    call goes through ``kernel[grid](...)``).
    """
    try:
        if hasattr(compiled, "result"):  # an asynchronous compile's future
            compiled = compiled.result()
        run = compiled.run
        function, metadata = compiled.function, compiled.packed_metadata
    except Exception:  # noqa: BLE001 - another Triton version: the normal launch path still works
        return {}
    if function is None:
        return {}
    out = {1: (run, (function, metadata, None, None, None))}
    raw = getattr(run, "launch", None)
    if (
        raw is not None
        and getattr(run, "global_scratch_size", None) == 0
        and getattr(run, "profile_scratch_size", None) == 0
        and hasattr(run, "launch_cooperative_grid")
        and hasattr(run, "launch_pdl")
    ):
        out[2] = (raw, (function, run.launch_cooperative_grid, run.launch_pdl, None, None, metadata, None, None, None))
    return out


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


@dataclass
class _Group:
    """Up to two parts of the plan moved by one launch, with what every call needs precomputed."""

    parts: tuple[int, ...]
    words: tuple[int, int]  # words per item of part A and part B (0: no part B)
    strides: tuple[int, ...]  # TPP, then per part (page, token, device row) in elements
    layer_args: list[tuple[int, ...]]  # per host layer: host_a, dev_a, host_b, dev_b, dev_rows, host_items
    kernel: str = "rows"
    per_tile: int = 1  # rows per tile (rows kernel) or words per tile (flat kernel)
    total_words: int = 0
    max_items: int = 1
    tail: dict[bool, tuple] = field(default_factory=dict)  # per direction: the constexpr arguments
    # (to_device, host index dtype, device index dtype) -> (launch callable, head arguments, constexpr tail)
    fast: dict[tuple, tuple] = field(default_factory=dict)


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


class JitOneLayer(SMBudget, Implementation):
    """One-layer loads and backups with Triton kernels specialised per pool shape, compiled on first use.

    Claims the one-layer operations of io backend ``"kernel"`` (priority 60, above
    hicache-kernel's 50) for every layout whose per-layer host view is rows of one item.
    Tuning, per instance (``host.implementation_for(op)``): ``max_ctas`` (at most this many
    CTAs per launch; ``0``/``None``: up to the SM count; default 8 or
    ``HICACHE_JIT_MAX_CTAS``), ``variant`` (a preset of :data:`VARIANTS`, default
    ``HICACHE_JIT_VARIANT`` or ``"rows_pipelined"``), and the knobs a preset sets:
    ``tile_bytes``, ``num_warps``, ``hints``, ``pipeline``.
    """

    name = "jit.one_layer"
    io_backend = "kernel"
    priority = 60
    pool_kinds = None  # every pool kind: the kernels read only the plan's strides
    layouts = None  # any layout whose per-layer host view is rows of one item: see not_supported_reasons
    operations = frozenset({LOAD, BACKUP_LAYER})
    device_types = CudaOrInterpreter()  # type: ignore[assignment]
    sharded = True
    draft = True
    item_alignment = 1  # any byte size: the word narrows (16/8/4/2/1 bytes) to what sizes and strides allow
    index_dtypes = frozenset({torch.int32, torch.int64})
    index_device = "device"
    needs_pinned_host = False  # only on CUDA; see not_supported_reasons
    description = "one-layer kernels specialised per pool shape and compiled on first use (Triton, UVA)"

    @classmethod
    def not_supported_reasons(cls, request: TransferRequest) -> list[str]:
        reasons = super().not_supported_reasons(request)
        if request.operation == BACKUP_ALL:
            reasons.append(
                "it moves one layer per launch; backup_from_device_all_layer (one launch over every layer) is "
                "served by hicache-kernel (kernel.triton_uva)"
            )
        if not triton_available():
            reasons.append("triton is not installed (pip install triton): these are Triton kernels")
        if request.device_type == "cpu" and not interpreting():
            reasons.append(
                "the CPU is served only by the Triton interpreter, for tests: set TRITON_INTERPRET=1 "
                "before triton is imported"
            )
        if request.device_type == "cuda" and not request.host_pinned:
            reasons.append(
                "needs pinned host memory on CUDA: GPU threads read and write the host pool in place through UVA "
                "(pin_memory=True)"
            )
        if request.storable:
            reasons += _row_problems(request)
        return reasons

    def __init__(self, plan: TransferPlan) -> None:
        super().__init__(plan)
        device = plan.device
        self._cuda, self._dev_index, self._sm_count = bind_uva_device(self.name, plan, _CPU_PROGRAMS)
        self._device_name = f"cuda:{self._dev_index}" if self._cuda else "cpu"
        for part in plan.parts:
            if not (part.host_item_contiguous and part.device_item_contiguous):
                raise ValueError(
                    f"{self.name} moves whole-item rows, but part {part.spec.name!r} of layout {plan.layout.name!r} "
                    "is split across heads; use kernel.triton_uva"
                )

        self.word_bytes = uva.plan_word_bytes(plan)
        elem_dtype, self._vec = uva.word_element(self.word_bytes)
        self._elem_dtype = str(elem_dtype).removeprefix("torch.")
        self._elem_bytes = self.word_bytes // self._vec
        self._anchor = uva.make_anchor(device, elem_dtype)
        if self._anchor.data_ptr() % self.word_bytes:
            raise RuntimeError(f"the anchor tensor is not {self.word_bytes}-byte aligned")
        self._anchor_ptr = self._anchor.data_ptr()
        self.uva_parts = tuple(uva.uva_part(p, self.word_bytes) for p in plan.parts)
        self._num_layers = plan.num_layers

        self._groups: list[_Group] = []
        for first in range(0, len(plan.parts), 2):
            chosen = tuple(range(first, min(first + 2, len(plan.parts))))
            table = uva.layer_offset_table(plan, self._anchor, self._elem_bytes, parts=chosen, device="cpu")
            rows = table.tolist()
            layer_args = []
            for entries in rows:
                a = entries[0]
                b = entries[1] if len(chosen) == 2 else [0, 0, 0, 0]
                layer_args.append(
                    (a[uva.TABLE_HOST], a[uva.TABLE_DEVICE], b[uva.TABLE_HOST], b[uva.TABLE_DEVICE],
                     a[uva.TABLE_DEVICE_ROWS], a[uva.TABLE_HOST_ITEMS])
                )  # fmt: skip
            parts = [self.uva_parts[i] for i in chosen]
            words = (parts[0].piece_words, parts[1].piece_words if len(parts) == 2 else 0)
            strides = _fold_strides(plan.tokens_per_page, parts)
            self._groups.append(_Group(chosen, words, strides, layer_args))

        self._get_device = self._get_stream = None
        if self._cuda:
            self._get_device, self._get_stream = _cuda_current_functions()
        self._fast_launch = 0
        self._max_ctas: int | None = None
        self._cap = self._sm_count
        self._configuring = True
        self.variant = os.environ.get(ENV_VARIANT) or DEFAULT_VARIANT
        # Environment overrides of the preset, checked through the setters like values set later.
        self.tile_bytes = _env_int(ENV_TILE_BYTES, self._tile_bytes, minimum=1)
        self.num_warps = _env_int(ENV_NUM_WARPS, self._num_warps, minimum=1)
        raw_hints = os.environ.get(ENV_HINTS)
        if raw_hints:
            self.hints = HINTS[raw_hints] if raw_hints in HINTS else int(raw_hints)
        raw_pipeline = os.environ.get(ENV_PIPELINE)
        if raw_pipeline:
            self.pipeline = raw_pipeline not in ("0", "false", "no")
        self.max_ctas = _env_int(ENV_MAX_CTAS, DEFAULT_MAX_CTAS, minimum=0)
        self.fast_launch = _env_int(ENV_FAST_LAUNCH, 2, minimum=0)
        self._configuring = False
        self._configure()

    # ---- tuning ------------------------------------------------------------------------------

    @property
    def variant(self) -> str:
        """The preset last applied (see :data:`VARIANTS`); setting it resets the knobs it sets."""
        return self._variant

    @variant.setter
    def variant(self, name: str) -> None:
        preset = VARIANTS.get(name)
        if preset is None:
            raise ValueError(f"unknown variant {name!r} ({ENV_VARIANT}); variants: {', '.join(VARIANTS)}")
        self._variant = name
        self._kernel_kind = preset.kernel
        self._tile_bytes = preset.tile_bytes
        self._num_warps = preset.num_warps
        self._hints = preset.hints
        self._pipeline = preset.pipeline
        self._configure()

    @property
    def tile_bytes(self) -> int:
        """Bytes one CTA moves per loop iteration (rounded to whole items, a power of two of them)."""
        return self._tile_bytes

    @tile_bytes.setter
    def tile_bytes(self, value: int) -> None:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"tile_bytes must be an int >= 1, got {value!r}")
        self._tile_bytes = value
        self._configure()

    @property
    def num_warps(self) -> int:
        return self._num_warps

    @num_warps.setter
    def num_warps(self, value: int) -> None:
        if not isinstance(value, int) or value < 1 or value > 32 or value & (value - 1):
            raise ValueError(f"num_warps must be a power of two in [1, 32], got {value!r}")
        self._num_warps = value
        self._configure()

    @property
    def hints(self) -> int:
        """Host-side cache hints: 0 none, 1 ``.cg`` loads / ``.cs`` stores, 2 ``evict_first``."""
        return self._hints

    @hints.setter
    def hints(self, value: int) -> None:
        if value not in HINTS.values():
            raise ValueError(f"hints must be one of {HINTS}, got {value!r}")
        self._hints = value
        self._configure()

    @property
    def pipeline(self) -> bool:
        """Row kernel: issue the next tile's loads before this tile's stores (two tiles in flight)."""
        return self._pipeline

    @pipeline.setter
    def pipeline(self, value: bool) -> None:
        self._pipeline = bool(value)
        self._configure()

    @property
    def fast_launch(self) -> int:
        """How calls after the first launch: 0 Triton's ``kernel[grid]``, 1 the compiled launcher, 2 its C function."""
        return self._fast_launch

    @fast_launch.setter
    def fast_launch(self, value: int) -> None:
        if value not in (0, 1, 2):
            raise ValueError(f"fast_launch must be 0, 1 or 2, got {value!r}")
        self._fast_launch = value if self._cuda else 0
        for group in self._groups:
            group.fast.clear()

    def launch_config(self) -> list[dict[str, Any]]:
        """Per launch group: the kernel, tile and constexprs a call uses now (for benchmarks and reports)."""
        return [
            {
                "parts": [self.plan.parts[i].spec.name for i in g.parts],
                "kernel": g.kernel,
                "rows_per_tile" if g.kernel == "rows" else "words_per_tile": g.per_tile,
                "tile_bytes": g.per_tile * (g.total_words if g.kernel == "rows" else 1) * self.word_bytes,
                "word_bytes": self.word_bytes,
                "num_warps": self._num_warps,
                "max_ctas": self._max_ctas,
                "constexprs": dict(zip(self._tail_names(g), g.tail[True])),
            }
            for g in self._groups
        ]

    def _tail_names(self, group: _Group) -> tuple[str, ...]:
        return ROWS_CONSTEXPRS if group.kernel == "rows" else FLAT_CONSTEXPRS

    def _configure(self) -> None:
        """Rebuild the per-direction constexpr tuples (and forget cached launchers) after a tuning change."""
        if getattr(self, "_configuring", False):
            return
        vec = self._vec
        for group in self._groups:
            group.fast.clear()
            wa, wb = group.words
            group.total_words = wa + wb
            tpp, a_page, a_token, a_row = group.strides[:4]
            b_page, b_token, b_row = group.strides[4:7] if wb else (0, 0, 0)
            rows_kernel = self._kernel_kind == "rows" and max(wa, wb) <= ROW_KERNEL_MAX_WORDS
            for to_device in (True, False):
                if rows_kernel:
                    group.kernel = "rows"
                    am, at, ap = _split_words(wa)
                    bm, bt, bp = _split_words(wb) if wb else (0, 0, 0)
                    rows = min(_pow2_near(self._tile_bytes / (group.total_words * self.word_bytes)), MAX_TILE_ROWS)
                    # Keep the words a thread holds (a [rows, padded words] tile, two when pipelined) within
                    # its registers, less room for addresses and indices, or the kernel spills.
                    threads = 32 * self._num_warps
                    budget = (min(255, 65536 // threads) - 48) // 2  # 8-byte elements (two registers each)
                    held = (am + ap + bm + bp) * vec * (2 if self._pipeline else 1)
                    while rows > 1 and rows * held > budget * threads:
                        rows //= 2
                    group.per_tile = rows
                    group.tail[to_device] = (
                        to_device, self._hints, vec, tpp, a_page, a_token, a_row, am, at, ap,
                        b_page, b_token, b_row, bm, bt, bp, group.per_tile, self._pipeline,
                    )  # fmt: skip
                    group.max_items = _MAX_ROW_ITEMS
                else:
                    group.kernel = "flat"
                    block = _pow2_near(self._tile_bytes / self.word_bytes)
                    group.per_tile = max(32 * self._num_warps, min(block, MAX_FLAT_BLOCK))
                    group.tail[to_device] = (
                        to_device, self._hints, vec, tpp, a_page, a_token, a_row, wa, b_page, b_token, b_row, wb,
                        group.per_tile,
                    )  # fmt: skip
                    group.max_items = max(1, (_INT32_MAX - group.per_tile) // group.total_words)
        self._max_items = min(g.max_items for g in self._groups)

    # ---- operations ---------------------------------------------------------------------------

    def load_to_device_per_layer(self, host_indices: torch.Tensor, device_indices: torch.Tensor, layer: int) -> None:
        self._run(host_indices, device_indices, layer, True)

    def backup_from_device_per_layer(
        self, host_indices: torch.Tensor, device_indices: torch.Tensor, layer: int
    ) -> None:
        self._run(host_indices, device_indices, layer, False)

    def warmup(self, index_dtypes: tuple[torch.dtype, ...] = (torch.int64,)) -> None:
        """Build (or fetch) the kernels of both directions now instead of at the first call.

        Launches kernels that move nothing, on the current stream.
        """
        for dtype in index_dtypes:
            empty = torch.empty(0, dtype=dtype, device=self.plan.device)
            for to_device in (True, False):
                for group in self._groups:
                    self._launch_slow(group, 1, empty, empty, 1, 1, 0, 0, to_device)

    def _run(self, h: torch.Tensor, d: torch.Tensor, layer: int, to_device: bool) -> None:
        n = h.shape[0]
        if d.shape[0] != n:  # the kernel reads device_indices[i] for every host index i
            raise ValueError(f"host_indices has {n} entries but device_indices has {d.shape[0]} (length mismatch)")
        if not 0 <= layer < self._num_layers:
            raise IndexError(f"host layer {layer} is out of range [0, {self._num_layers})")
        if n == 0:
            return
        if n > self._max_items:
            raise ValueError(f"{n} items in one call is more than {self.name} addresses ({self._max_items}); split it")
        hs, ds = h.stride(0), d.stride(0)
        cap = self._cap
        key = (to_device, h.dtype, d.dtype)
        direct = self._fast_launch and self._get_device() == self._dev_index and _hooks_idle()
        for group in self._groups:
            per_tile = group.per_tile
            tiles = -(-n // per_tile) if group.kernel == "rows" else -(-(n * group.total_words) // per_tile)
            grid = tiles if tiles < cap else cap
            fast = group.fast.get(key) if direct else None
            if fast is not None:
                call, head, tail = fast
                call(grid, 1, 1, self._get_stream(self._dev_index), *head, self._anchor_ptr, h.data_ptr(),
                     d.data_ptr(), hs, ds, n, *group.layer_args[layer], *tail)  # fmt: skip
            else:
                self._launch_slow(group, grid, h, d, hs, ds, n, layer, to_device)

    def _key(self, group: _Group, to_device: bool, h: torch.Tensor, d: torch.Tensor) -> KernelKey:
        return KernelKey(
            kernel=group.kernel,
            to_device=to_device,
            host_index_dtype=str(h.dtype).removeprefix("torch."),
            device_index_dtype=str(d.dtype).removeprefix("torch."),
            element=self._elem_dtype,
            constexprs=tuple(zip(self._tail_names(group)[1:], (int(v) for v in group.tail[to_device][1:]))),
            num_warps=self._num_warps,
            device=self._device_name,
        )

    def _launch_slow(self, group: _Group, grid: int, h, d, hs: int, ds: int, n: int, layer: int, to_device: bool):
        """First use of a key (build it), a key another pool built (reuse its launcher), or Triton's own path."""
        if h.dtype not in self.index_dtypes or d.dtype not in self.index_dtypes:
            raise TypeError(f"indices must be int32 or int64, got {h.dtype} and {d.dtype}")
        module = _kernels()
        kernel = module.rows_kernel if group.kernel == "rows" else module.flat_kernel
        tail = group.tail[to_device]
        key = self._key(group, to_device, h, d)
        entry = _compiled.get(key)
        fast_key = (to_device, h.dtype, d.dtype)
        launcher = self._launcher(entry)
        if launcher is not None and self._get_device() == self._dev_index and _hooks_idle():
            call, head = launcher
            group.fast[fast_key] = (call, head, tail)
            call(grid, 1, 1, self._get_stream(self._dev_index), *head, self._anchor_ptr, h.data_ptr(), d.data_ptr(),
                 hs, ds, n, *group.layer_args[layer], *tail)  # fmt: skip
            return
        args = (self._anchor, h, d, hs, ds, n, *group.layer_args[layer], *tail)
        start = time.perf_counter()
        if self._cuda:
            with torch.cuda.device(self._dev_index):
                compiled = kernel[(grid,)](*args, num_warps=self._num_warps)
        else:
            compiled = kernel[(grid,)](*args, num_warps=self._num_warps)
        seconds = time.perf_counter() - start
        if entry is None:
            with _compiled_lock:
                entry = _compiled.setdefault(key, _Compiled(seconds))
        if self._cuda and not entry.launchers and compiled is not None:
            entry.launchers = _direct_launchers(compiled)
        launcher = self._launcher(entry)
        if launcher is not None:
            call, head = launcher
            group.fast[fast_key] = (call, head, tail)

    def _launcher(self, entry: _Compiled | None) -> tuple[Any, tuple] | None:
        """The direct launch this instance's ``fast_launch`` mode asks for, if the entry has it (or mode 1)."""
        if entry is None or not self._fast_launch or not entry.launchers:
            return None
        return entry.launchers.get(self._fast_launch) or entry.launchers.get(1)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.name} variant={self._variant} word={self.word_bytes}B "
            f"max_ctas={self._max_ctas} tile_bytes={self._tile_bytes} num_warps={self._num_warps} "
            f"hints={self._hints} pipeline={self._pipeline}>"
        )
