"""The reference transfer: pure torch, slow, obviously right.

It reads the layout only through :class:`~hicache_core.pool.plan.BoundPart` views
and moves bytes with advanced indexing. Every test, the conformance kit and
``hicache demo`` compare implementations against it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..pool.plan import TransferPlan
from .implementation import OPERATIONS, Implementation


def reference_copy(
    plan: TransferPlan,
    host_items: torch.Tensor,
    device_items: torch.Tensor,
    layers: Iterable[int],
    *,
    to_device: bool,
) -> None:
    """Copy items between host and device for the given host layers."""
    host_items = host_items.to("cpu", torch.int64)
    layers = list(layers)
    rows = min((plan.device_rows_per_layer[layer] for layer in layers), default=plan.device_rows)
    # Checked once, before any layer moves: the oracle must never half-write a pool either.
    for what, idx, limit in (("host", host_items, plan.num_items), ("device", device_items, rows)):
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= limit):
            raise IndexError(f"{what} indices out of range [0, {limit}): min {int(idx.min())}, max {int(idx.max())}")
    pages = host_items // plan.tokens_per_page
    tokens = host_items % plan.tokens_per_page
    for layer in layers:
        for part in plan.parts:
            host = part.host_layer_view(layer)
            device = part.device_layer_view(layer)
            rows = device_items.to(device.device, torch.int64)
            if to_device:
                device[rows] = host[pages, tokens].to(device.device)
            else:
                host[pages, tokens] = device[rows].to("cpu")


class ReferenceImplementation(Implementation):
    """The reference transfer as an implementation, so it can be forced and compared against.

    It claims everything on every device under io backend ``"reference"``, and
    ``"auto"`` never picks it: a silent fall back to a slow path is a bug, not a feature.
    """

    name = "reference"
    io_backend = "reference"
    priority = -1000
    auto_selectable = False
    engine = "cpu"  # torch indexing ops; on CUDA pools its copies run as torch's kernels, but nobody tunes it
    operations = frozenset(OPERATIONS)
    device_types = frozenset({"cpu", "cuda"})
    index_dtypes = frozenset({torch.int32, torch.int64})
    index_device = "cpu"
    description = "pure-torch reference transfer (slow, obviously right)"

    def load_to_device_per_layer(self, host_indices, device_indices, layer):
        reference_copy(self.plan, host_indices, device_indices, [layer], to_device=True)

    def backup_from_device_per_layer(self, host_indices, device_indices, layer):
        reference_copy(self.plan, host_indices, device_indices, [layer], to_device=False)

    def backup_from_device_all_layer(self, host_indices, device_indices):
        reference_copy(self.plan, host_indices, device_indices, range(self.plan.num_layers), to_device=False)
