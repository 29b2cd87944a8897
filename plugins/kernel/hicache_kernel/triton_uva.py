"""io backend ``"kernel"``: Triton kernels that read and write the pinned host pool in place through UVA.

GPU threads address pinned host memory at its host virtual address, so one generic
kernel computes both sides of every item from the layout declaration (the strides in
the plan) and claims every layout, pool kind and operation. This module does not
import triton: the kernels live in :mod:`hicache_kernel._kernels`, imported on first
use, so importing the plugin stays cheap and never touches CUDA.

Per call, the hot path does integer arithmetic on Python ints and one launch through
the compiled kernel's launcher, with argument tuples built once in ``__init__``; it
allocates no tensor and never synchronises.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache_core import OPERATIONS, Implementation, TransferPlan, TransferRequest, uva
from hicache_core.triton_support import CudaOrInterpreter, SMBudget, bind_uva_device, interpreting, triton_available
from hicache_core.triton_support import cuda_current_functions as _cuda_current_functions
from hicache_core.triton_support import env_int as _env_int

ENV_MAX_CTAS = "HICACHE_KERNEL_MAX_CTAS"
ENV_TILE_WORDS = "HICACHE_KERNEL_TILE_WORDS"
ENV_NUM_WARPS = "HICACHE_KERNEL_NUM_WARPS"
ENV_FAST_LAUNCH = "HICACHE_KERNEL_FAST_LAUNCH"
DEFAULT_MAX_CTAS = 8
DEFAULT_NUM_WARPS = 8
#: Bytes one CTA keeps in flight per loop iteration. PCIe round trips take 1-2 us, so ~80 KB
#: must be outstanding to fill 55 GB/s; 32 KB per CTA gives 8 CTAs plenty of headroom.
TILE_BYTES = 32 * 1024
#: Lanes per tile are capped so that narrow words (odd item sizes) do not exhaust registers.
MAX_TILE_WORDS = 4096
#: CTAs for "unlimited" where there are no SMs to count (the interpreter runs them in turn).
_CPU_PROGRAMS = 4
_INT32_MAX = 2**31 - 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Group:
    """Up to two parts moved by one launch, with everything a call needs precomputed."""

    parts: tuple[int, ...]
    table: torch.Tensor
    table_ptr: int
    words_a: int
    words_b: int
    strides: tuple[int, ...]
    constexprs: tuple[int, ...]
    # Per direction (True: to device): the arguments after the per-call ones, in kernel order.
    tail: dict[bool, tuple] = field(default_factory=dict)
    # (to_device, host index dtype, device index dtype) -> (launcher, function, packed metadata).
    fast: dict[tuple, tuple] = field(default_factory=dict)


class TritonUVA(SMBudget, Implementation):
    """One generic Triton kernel family over UVA-mapped pinned host memory; claims every layout.

    Tuning, per instance (``host.implementation_for(op)``): ``max_ctas`` (the SM budget:
    at most this many CTAs per launch; ``0``/``None``: one per tile up to the SM count;
    default 8 or ``HICACHE_KERNEL_MAX_CTAS``), ``tile_words`` (words per tile; default
    32 KB worth, or ``HICACHE_KERNEL_TILE_WORDS``) and ``num_warps`` (default 8, or
    ``HICACHE_KERNEL_NUM_WARPS``). Pieces of any byte size are moved, in the widest word
    (16/8/4/2/1 bytes) that divides every size, stride, offset and base address.
    """

    name = "kernel.triton_uva"
    io_backend = "kernel"
    priority = 50
    pool_kinds = None
    layouts = None
    operations = frozenset(OPERATIONS)
    device_types = CudaOrInterpreter()  # type: ignore[assignment]
    sharded = True
    draft = True
    item_alignment = 1  # any byte size: narrower words for odd sizes
    index_dtypes = frozenset({torch.int32, torch.int64})
    index_device = "device"
    needs_pinned_host = False  # only on CUDA; see not_supported_reasons
    description = "Triton kernels over UVA-mapped pinned memory; any layout, any item size, SM budget max_ctas"

    @classmethod
    def not_supported_reasons(cls, request: TransferRequest) -> list[str]:
        reasons = super().not_supported_reasons(request)
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
        return reasons

    def __init__(self, plan: TransferPlan) -> None:
        super().__init__(plan)
        device = plan.device
        self._cuda, self._dev_index, self._sm_count = bind_uva_device(self.name, plan, _CPU_PROGRAMS)

        self.word_bytes = uva.plan_word_bytes(plan)
        elem_dtype, self._vec = uva.word_element(self.word_bytes)
        self._elem_bytes = self.word_bytes // self._vec
        self._anchor = uva.make_anchor(device, elem_dtype)
        if self._anchor.data_ptr() % self.word_bytes:
            raise RuntimeError(f"the anchor tensor is not {self.word_bytes}-byte aligned")
        self._anchor_ptr = self._anchor.data_ptr()
        self.uva_parts = tuple(uva.uva_part(p, self.word_bytes) for p in plan.parts)
        self._tokens_per_page = plan.tokens_per_page
        self._all_layers = plan.num_layers

        self._groups: list[_Group] = []
        for first in range(0, len(plan.parts), 2):
            chosen = tuple(range(first, min(first + 2, len(plan.parts))))
            table = uva.layer_offset_table(plan, self._anchor, self._elem_bytes, parts=chosen)
            a = self.uva_parts[chosen[0]]
            b = self.uva_parts[chosen[-1]]
            strides = tuple(
                v
                for p in (a, b)
                for v in (
                    p.host_page_stride,
                    p.host_token_stride,
                    p.host_head_stride,
                    p.device_row_stride,
                    p.device_head_stride,
                )
            )
            # In the kernel's parameter order (checked against it when the kernel is loaded).
            constexprs = (self._tokens_per_page, a.heads, a.piece_words, b.heads, b.piece_words, len(chosen), self._vec)
            words_b = b.words_per_item if len(chosen) == 2 else 0
            self._groups.append(_Group(chosen, table, table.data_ptr(), a.words_per_item, words_b, strides, constexprs))

        self._fast_launch = self._cuda and os.environ.get(ENV_FAST_LAUNCH, "1") != "0"
        self._kernel: Any = None
        self._get_device = self._get_stream = None
        self._max_ctas: int | None = None
        self._cap = self._sm_count
        self._tile_words = min(MAX_TILE_WORDS, max(1, TILE_BYTES // self.word_bytes))
        self._num_warps = DEFAULT_NUM_WARPS
        # Through the setters, so values from the environment are checked like values set later.
        self.max_ctas = _env_int(ENV_MAX_CTAS, DEFAULT_MAX_CTAS, minimum=0)
        self.num_warps = _env_int(ENV_NUM_WARPS, self._num_warps, minimum=1)
        self.tile_words = _env_int(ENV_TILE_WORDS, self._tile_words, minimum=1)

    # ---- tuning ------------------------------------------------------------------------------

    @property
    def tile_words(self) -> int:
        """Words one CTA moves per loop iteration (a power of two; rounded up when set)."""
        return self._tile_words

    @tile_words.setter
    def tile_words(self, value: int) -> None:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"tile_words must be an int >= 1, got {value!r}")
        self._tile_words = value
        self._configure()

    @property
    def num_warps(self) -> int:
        return self._num_warps

    @num_warps.setter
    def num_warps(self, value: int) -> None:
        if not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"num_warps must be a power of two >= 1, got {value!r}")
        self._num_warps = value
        self._configure()

    def _configure(self) -> None:
        """Rebuild the per-direction argument tails (and forget compiled launchers) after a tuning change."""
        self._tile_words = 1 << (self._tile_words - 1).bit_length()
        block = self._tile_words
        widest = max(max(g.words_a, g.words_b) for g in self._groups)
        # Word indices inside a (layer, part) are int32 in the kernel.
        self._max_items = max(1, (_INT32_MAX - block) // widest)
        for group in self._groups:
            group.fast.clear()
            for to_device in (True, False):
                group.tail[to_device] = (*group.strides, to_device, *group.constexprs, block)

    # ---- operations ---------------------------------------------------------------------------

    def load_to_device_per_layer(self, host_indices: torch.Tensor, device_indices: torch.Tensor, layer: int) -> None:
        self._run(host_indices, device_indices, layer, 1, True)

    def backup_from_device_per_layer(
        self, host_indices: torch.Tensor, device_indices: torch.Tensor, layer: int
    ) -> None:
        self._run(host_indices, device_indices, layer, 1, False)

    def backup_from_device_all_layer(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        self._run(host_indices, device_indices, 0, self._all_layers, False)

    def warmup(self, index_dtypes: tuple[torch.dtype, ...] = (torch.int64,)) -> None:
        """Compile (and, on CUDA, cache the launcher of) both directions now, instead of at the first call.

        Launches kernels that move nothing, on the current stream.
        """
        for dtype in index_dtypes:
            empty = torch.empty(0, dtype=dtype, device=self.plan.device)
            for to_device in (True, False):
                for group in self._groups:
                    self._launch(group, 1, empty, empty, 1, 1, 0, 0, 1, to_device)

    def _run(self, h: torch.Tensor, d: torch.Tensor, layer0: int, num_layers: int, to_device: bool) -> None:
        n = h.shape[0]
        if d.shape[0] != n:  # the kernel reads device_indices[i] for every host index i
            raise ValueError(f"host_indices has {n} entries but device_indices has {d.shape[0]}")
        if n == 0:
            return
        if n > self._max_items:
            raise ValueError(f"{n} items in one call is more than {self.name} addresses ({self._max_items}); split it")
        block, cap = self._tile_words, self._cap
        hs, ds = h.stride(0), d.stride(0)
        for group in self._groups:
            tiles = num_layers * (_cdiv(n * group.words_a, block) + _cdiv(n * group.words_b, block))
            self._launch(group, tiles if tiles < cap else cap, h, d, hs, ds, n, layer0, num_layers, to_device)

    def _launch(self, group: _Group, grid: int, h, d, hs: int, ds: int, n: int, layer0: int, nl: int, to_device):
        fast = group.fast.get((to_device, h.dtype, d.dtype))
        if fast is not None and self._get_device() == self._dev_index and _no_launch_hooks():
            launcher, function, metadata = fast
            launcher(
                grid, 1, 1, self._get_stream(self._dev_index), function, metadata, None, None, None,
                self._anchor_ptr, group.table_ptr, h.data_ptr(), d.data_ptr(), hs, ds, n, layer0, nl,
                *group.tail[to_device],
            )  # fmt: skip
            return
        self._launch_slow(group, grid, h, d, hs, ds, n, layer0, nl, to_device)

    def _launch_slow(self, group: _Group, grid: int, h, d, hs, ds, n, layer0, nl, to_device) -> None:
        """Triton's own launch path: compiles on first use; afterwards used only when the fast path cannot be."""
        kernel = self._kernel
        if kernel is None:
            kernel = self._kernel = _load_kernel()
        args = (self._anchor, group.table, h, d, hs, ds, n, layer0, nl, *group.tail[to_device])
        if self._cuda:
            with torch.cuda.device(self._dev_index):
                compiled = kernel[(grid,)](*args, num_warps=self._num_warps)
            if self._fast_launch:
                self._remember(group, (to_device, h.dtype, d.dtype), compiled)
        else:
            kernel[(grid,)](*args, num_warps=self._num_warps)

    def _remember(self, group: _Group, key: tuple, compiled: Any) -> None:
        """Keep the compiled kernel's launcher so later calls skip Triton's argument binding and cache lookup."""
        try:
            if hasattr(compiled, "result"):  # an async compile's future
                compiled = compiled.result()
            launcher, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
        except Exception:  # noqa: BLE001 - another Triton version: the normal launch path still works
            return
        if function is None:
            return
        if self._get_device is None:
            self._get_device, self._get_stream = _cuda_current_functions()
        group.fast[key] = (launcher, function, metadata)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.name} word={self.word_bytes}B max_ctas={self._max_ctas} "
            f"tile_words={self._tile_words} num_warps={self._num_warps}>"
        )


#: The kernel's parameters, in order; the argument tuples above are built in this order.
KERNEL_PARAMS = (
    "anchor", "table", "hidx", "didx", "h_stride", "d_stride", "n", "layer0", "num_layers",
    "a_page", "a_token", "a_head", "a_row", "a_dhead", "b_page", "b_token", "b_head", "b_row", "b_dhead",
    "TO_DEVICE", "TOKENS_PER_PAGE", "A_HEADS", "A_WORDS", "B_HEADS", "B_WORDS", "SLOTS", "VEC", "BLOCK",
)  # fmt: skip
_runtime_knobs: Any = None


def _load_kernel():
    global _runtime_knobs
    from . import _kernels

    names = tuple(getattr(_kernels.uva_copy, "arg_names", KERNEL_PARAMS))
    if names != KERNEL_PARAMS:
        raise RuntimeError(f"kernel parameters {names} differ from the argument order {KERNEL_PARAMS}")
    try:
        from triton import knobs

        _runtime_knobs = knobs.runtime
    except ImportError:  # older Triton: no knobs, no launch hooks to honour
        _runtime_knobs = None
    return _kernels.uva_copy


def _no_launch_hooks() -> bool:
    """Whether no profiler hook wants to see launches (the fast path would hide them from it)."""
    knobs = _runtime_knobs
    if knobs is None:
        return True
    for hook in (knobs.launch_enter_hook, knobs.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True
