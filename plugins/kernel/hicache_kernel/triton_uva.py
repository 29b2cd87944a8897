"""io backend ``"kernel"``: Triton kernels that read and write the pinned host pool in place through UVA.

GPU threads address pinned host memory at its host virtual address, so one generic
kernel computes both sides of every item from the layout declaration (the strides in
the plan) and claims every layout, pool kind and operation. This module does not
import triton: the kernels live in :mod:`hicache_kernel._kernels`, imported on first
use, so importing the plugin stays cheap and never touches CUDA.

What every Triton implementation shares (claims, UVA binding, the drop word, the knobs
and the launch path) is :class:`hicache_core.gpu.triton_base.TritonImplementation`. Per call,
the hot path picks an argument tuple built when the host pool was made and launches
through the compiled kernel's launcher; it allocates no tensor and never synchronises.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from hicache_core import OPERATIONS, TransferPlan
from hicache_core.gpu import uva
from hicache_core.gpu.knobs import Knob, checked
from hicache_core.gpu.triton_base import (
    CALL_PARAMS,
    LaunchGroup,
    TritonImplementation,
    cdiv,
    check_kernel_params,
    load_triton_runtime,
    max_items_for,
)

ENV_MAX_CTAS = "HICACHE_KERNEL_MAX_CTAS"
ENV_TILE_WORDS = "HICACHE_KERNEL_TILE_WORDS"
ENV_NUM_WARPS = "HICACHE_KERNEL_NUM_WARPS"
ENV_STAGES = "HICACHE_KERNEL_STAGES"
ENV_FAST_LAUNCH = "HICACHE_KERNEL_FAST_LAUNCH"
DEFAULT_MAX_CTAS = 8
DEFAULT_NUM_WARPS = 8
#: Bytes one CTA keeps in flight per loop iteration. PCIe round trips take 1-2 us, so ~80 KB
#: must be outstanding to fill 55 GB/s; 32 KB per CTA gives 8 CTAs plenty of headroom.
TILE_BYTES = 32 * 1024
#: Lanes per tile are capped so that narrow words (odd item sizes) do not exhaust registers.
MAX_TILE_WORDS = 4096


@dataclass(eq=False)
class _Group(LaunchGroup):
    """Up to two parts moved by one launch: their layer table and sizes, precomputed."""

    table: torch.Tensor | None = None
    table_offset: int = 0
    words_a: int = 0
    words_b: int = 0
    strides: tuple[int, ...] = ()
    constexprs: tuple[int, ...] = ()
    #: Per direction: the arguments of an all-layer call.
    all_args: dict[bool, tuple] | None = None


class TritonUVA(TritonImplementation):
    """One generic Triton kernel family over UVA-mapped pinned host memory; claims every layout.

    Tuning, per instance (``host.implementation_for(op)``): the knobs of
    :class:`~hicache_core.gpu.triton_base.TritonImplementation` (``max_ctas``, default 8;
    ``num_warps``, default 8; ``stages``, default 0; ``fast_launch``; each also read from
    ``HICACHE_KERNEL_<KNOB>``) and ``tile_words`` (words per tile; default 32 KB worth, or
    ``HICACHE_KERNEL_TILE_WORDS``). Pieces of any byte size are moved, in the widest word
    (16/8/4/2/1 bytes) that divides every size, stride, offset and base address.
    """

    name = "kernel.triton_uva"
    priority = 50
    pool_kinds = None
    layouts = None
    operations = frozenset(OPERATIONS)
    description = "Triton kernels over UVA-mapped pinned memory; any layout, any item size, SM budget max_ctas"
    env_prefix = "HICACHE_KERNEL"
    default_max_ctas = DEFAULT_MAX_CTAS
    default_num_warps = DEFAULT_NUM_WARPS

    def __init__(self, plan: TransferPlan) -> None:
        super().__init__(plan)
        self._tokens_per_page = plan.tokens_per_page
        self._all_layers = plan.num_layers
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
            self._groups.append(
                _Group(
                    chosen,
                    table=table,
                    table_offset=self._offset(table.data_ptr(), "the layer table"),
                    words_a=a.words_per_item,
                    words_b=b.words_per_item if len(chosen) == 2 else 0,
                    strides=strides,
                    constexprs=constexprs,
                )
            )
        self.tile_words = min(MAX_TILE_WORDS, max(1, TILE_BYTES // self.word_bytes))
        self._read_knobs()
        self._finish_init()

    # ---- tuning ------------------------------------------------------------------------------

    tile_words = Knob(
        checked(lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an int >= 1",
                keep=lambda v: 1 << (v - 1).bit_length()),
        env="TILE_WORDS", minimum=1,
        doc="Words one CTA moves per loop iteration (a power of two; rounded up when set).",
    )  # fmt: skip

    def _configure(self) -> None:
        """Rebuild the argument tuples of every (direction, layer) after a tuning change."""
        block = self._tile_words
        stages = self._loop_stages()
        # Word indices inside a (layer, part) are int32 in the kernel.
        self._max_items = max_items_for(max(max(g.words_a, g.words_b) for g in self._groups), block)
        for group in self._groups:
            group.all_args = {}
            for to_device in (True, False):
                tail = (*group.strides, to_device, *group.constexprs, block, stages)
                head = (self._drop, group.table_offset)
                group.args[to_device] = [(*head, layer, 1, *tail) for layer in range(self._all_layers)]
                group.all_args[to_device] = (*head, 0, self._all_layers, *tail)

    # ---- operations ---------------------------------------------------------------------------

    def load_to_device_per_layer(self, host_indices: torch.Tensor, device_indices: torch.Tensor, layer: int) -> None:
        self._run(host_indices, device_indices, layer, 1, True)

    def backup_from_device_per_layer(
        self, host_indices: torch.Tensor, device_indices: torch.Tensor, layer: int
    ) -> None:
        self._run(host_indices, device_indices, layer, 1, False)

    def backup_from_device_all_layer(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        self._run(host_indices, device_indices, 0, self._all_layers, False)

    def _run(self, h: torch.Tensor, d: torch.Tensor, layer0: int, num_layers: int, to_device: bool) -> None:
        n = self._count(h, d)
        if n == 0:
            return
        block, cap, ready = self._tile_words, self._cap, self._ready(h, d, n)
        for group in self._groups:
            tiles = num_layers * (cdiv(n * group.words_a, block) + cdiv(n * group.words_b, block))
            args = group.args[to_device][layer0] if num_layers == 1 else group.all_args[to_device]
            self._launch(group, tiles if tiles < cap else cap, h, d, n, to_device, args, ready)

    # ---- the kernel ---------------------------------------------------------------------------

    def _kernel_for(self, group: LaunchGroup) -> Any:
        return _load_kernel()

    def _compile_key(self, group: LaunchGroup, to_device: bool, h: torch.Tensor, d: torch.Tensor) -> Hashable:
        assert isinstance(group, _Group)
        # Triton specialises on the strides (divisibility by 16, values of 1), so they are part of the key.
        return (to_device, h.dtype, d.dtype, self._elem_dtype, group.strides, group.constexprs, self._tile_words,
                self._loop_stages(), self._num_warps, self._device_name)  # fmt: skip

    def _knob_repr(self) -> str:
        return f"{super()._knob_repr()} tile_words={self._tile_words}"


#: The kernel's parameters, in order; the argument tuples above are built in this order.
KERNEL_PARAMS = CALL_PARAMS + (
    "table", "layer0", "num_layers",
    "a_page", "a_token", "a_head", "a_row", "a_dhead", "b_page", "b_token", "b_head", "b_row", "b_dhead",
    "TO_DEVICE", "TOKENS_PER_PAGE", "A_HEADS", "A_WORDS", "B_HEADS", "B_WORDS", "SLOTS", "VEC", "BLOCK", "STAGES",
)  # fmt: skip
_kernel: Any = None


def _load_kernel() -> Any:
    """Import the kernel (and triton) on first use."""
    global _kernel
    if _kernel is None:
        from . import _kernels

        check_kernel_params(_kernels.uva_copy, KERNEL_PARAMS)
        load_triton_runtime()
        _kernel = _kernels.uva_copy
    return _kernel
