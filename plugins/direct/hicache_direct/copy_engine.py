"""The copy-engine implementation: each operation is one batched copy of merged runs.

Runs are maximal sequences of items where host and device slots both advance by
one and the host bytes stay contiguous (within a page, or across pages where the
layout keeps pages adjacent, as ``layer_first`` does). Pairs are sorted by host
slot first, so scattered radix-tree pages still merge where they can. Every
(layer, part, run) becomes one descriptor (:mod:`.descriptors`), and the whole
list goes to the driver as one ``cudaMemcpyBatchAsync`` on the caller's current
stream (:mod:`.memcpy`), so the copy engine works through it back to back while
the SMs stay with the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch

from hicache_core import OPERATIONS, Implementation, TransferPlan, TransferRequest
from hicache_core.gpu.knobs import knobs_of

from .descriptors import DescriptorBuilder, PartAddresses
from .memcpy import CudaCopier, copier_for
from .variables import BENCH_BATCH_2D

#: The settings :meth:`DirectCopy.tuned` takes: the CUDA copier's declared knobs.
_COPIER_KNOBS = tuple(knob.name for knob in knobs_of(CudaCopier))


class DirectCopy(Implementation):
    """Copy engine only: one ``cudaMemcpyBatchAsync`` of merged runs per operation, on the current stream.

    Indices: CPU int32 or int64 tensors. The runs and copies found for an index pair are kept
    (per thread) while the same tensor objects come back with the same version counter, which is
    what a server passes layer after layer; an in-place change through torch bumps the counter and
    is seen, but a write through a numpy view of the tensor is not (pass a new tensor instead).

    Tuning, per instance (``host.implementation_for(op).copier``): the knobs
    :class:`hicache_direct.memcpy.CudaCopier` declares (``max_batch``, ``streams``, ``prefer_overlap``,
    ``batch``, ``batch_2d``); :meth:`tuned` sets any of them for a while.
    """

    name = "direct.copy_engine"
    io_backend = "direct"
    priority = 10
    operations = frozenset(OPERATIONS)
    device_types = frozenset({"cpu", "cuda"})
    index_dtypes = frozenset({torch.int32, torch.int64})
    index_device = "cpu"
    engine = "copy_engine"
    description = ("copy engine: one cudaMemcpyBatchAsync of merged contiguous runs per operation, submitted on the "
                   "caller's thread and stream")

    #: Submission settings a benchmark times beside the defaults (knobs of :class:`~hicache_direct.memcpy.CudaCopier`).
    VARIANTS: ClassVar[dict[str, dict[str, Any]]] = {
        "streams2": {"streams": 2},
        "max_batch8": {"max_batch": 8},
        "max_batch16": {"max_batch": 16},
        "max_batch64": {"max_batch": 64},
        "unbounded_batch": {"max_batch": 0},
        "no_overlap_hint": {"prefer_overlap": False},
        "one_by_one": {"batch": False},
    }
    def tuning_variants(self) -> dict[str, dict[str, Any]]:
        # The variants whose knobs this copier has: none for the host copier (CPU pools).
        variants = {name: settings for name, settings in self.VARIANTS.items()
                    if all(hasattr(self.copier, knob) for knob in settings)}  # fmt: skip
        # 2-D copies as one cudaMemcpy3DBatchAsync: only where there are 2-D copies, and only when the
        # bench is asked to (scripts/gpu/direct-check.sh asks once its byte-exact check of that path passed).
        if self.builder.sliced and BENCH_BATCH_2D.read():
            variants["batch_2d"] = {"batch_2d": True}
        return variants

    @contextlib.contextmanager
    def tuned(self, settings: Mapping[str, Any]) -> Iterator[None]:
        unknown = sorted(k for k in settings if k not in _COPIER_KNOBS or not hasattr(self.copier, k))
        if unknown:
            raise ValueError(f"{self.name}: unknown tuning settings {unknown}; knobs: {', '.join(_COPIER_KNOBS)}")
        saved = {key: getattr(self.copier, key) for key in settings}
        try:
            for key, value in settings.items():
                setattr(self.copier, key, value)
            yield
        finally:
            for key, value in saved.items():
                setattr(self.copier, key, value)

    @classmethod
    def not_supported_reasons(cls, request: TransferRequest) -> list[str]:
        reasons = super().not_supported_reasons(request)
        if not request.storable:
            return reasons
        spec = request.host_spec
        for part in spec.parts:
            if part.heads > 1 and part.head_stride != part.dim:
                reasons.append(
                    f"layout {request.layout.name!r} splits each item across heads on the host, so the copy engine "
                    "would need one copy per head and token; use io backend 'kernel'"
                )
                break
            if spec.tokens_per_page > 1 and part.token_stride != part.heads * part.dim:
                reasons.append(
                    f"layout {request.layout.name!r} stores a layer's tokens strided on the host (token-major), so the "
                    "copy engine would need one copy per token and layer; use layout 'page_first_direct', "
                    "or io backend 'kernel'"
                )
                break
        if request.device_type == "cuda" and not request.host_pinned:
            reasons.append("on CUDA it needs pinned host memory to copy asynchronously (pin_memory=True)")
        return reasons

    def __init__(self, plan: TransferPlan) -> None:
        super().__init__(plan)
        self.builder = DescriptorBuilder(
            [PartAddresses.of(part) for part in plan.parts],
            plan.tokens_per_page,
            plan.num_items,
            plan.device_rows_per_layer,
        )
        self.copier = copier_for(plan.device)
        self._all = self.builder.layers_all()
        self._describe = self.builder.describe
        self._parts = len(plan.parts)

    def load_to_device_per_layer(self, host_indices, device_indices, layer):
        self._copy(host_indices, device_indices, (layer,), True)

    def backup_from_device_per_layer(self, host_indices, device_indices, layer):
        self._copy(host_indices, device_indices, (layer,), False)

    def backup_from_device_all_layer(self, host_indices, device_indices):
        self._copy(host_indices, device_indices, self._all, False)

    def _copy(self, host_indices: torch.Tensor, device_indices: torch.Tensor, layers: tuple[int, ...],
              to_device: bool) -> None:  # fmt: skip
        if host_indices.shape[0] == 0:
            return
        builder = self.builder
        # Bounds (checked in runs(), before any byte moves) are those of the layer with the fewest rows.
        runs = builder.runs(host_indices, device_indices, builder.rows_for(layers))
        self.copier.submit(builder.build(runs, layers, to_device), self._describe)

    def plan_for(self, host_indices: torch.Tensor, device_indices: torch.Tensor, layers: tuple[int, ...],
                 to_device: bool):  # fmt: skip
        """The copies one call would submit (for tests and ``hicache bench``); moves nothing."""
        builder = self.builder
        return builder.build(builder.runs(host_indices, device_indices, builder.rows_for(layers)), layers, to_device)

    @property
    def path(self) -> str:
        """How operations are submitted here, in words."""
        return self.copier.path
