"""io backend ``"blob"``: gather and scatter bytes at addresses computed from the layout declaration.

It never looks at a layout's name. Every host address comes from the strides the
core derives from the layout's axes (:class:`hicache_core.BoundPart`), so it
serves the built-in layouts and ``page_blob_direct`` alike, and any layout a
plugin declares later. It is written for clarity, not speed: it builds an index
tensor per call, which a production backend would not do on its hot path.
"""

from __future__ import annotations

import torch

from hicache_core import OPERATIONS, BoundPart, Implementation, TransferPlan


class PageBlobGather(Implementation):
    """Byte gather/scatter from layout strides, on CPU or CUDA devices; the host side runs on the CPU."""

    name = "pageblob.gather"
    io_backend = "blob"
    priority = 5
    operations = frozenset(OPERATIONS)
    device_types = frozenset({"cpu", "cuda"})
    index_dtypes = frozenset({torch.int32, torch.int64})
    index_device = "cpu"
    description = "byte gather/scatter at addresses computed from the layout declaration"

    def __init__(self, plan: TransferPlan) -> None:
        super().__init__(plan)
        self.tokens_per_page = plan.tokens_per_page
        self.parts = plan.parts
        # Byte offsets of one item inside its slot, per part: heads x bytes of a head.
        self.inner = [
            (torch.arange(p.heads)[:, None] * p.head_stride + torch.arange(p.piece_bytes)[None, :]) for p in plan.parts
        ]

    def load_to_device_per_layer(self, host_indices, device_indices, layer):
        self._move(host_indices, device_indices, (layer,), to_device=True)

    def backup_from_device_per_layer(self, host_indices, device_indices, layer):
        self._move(host_indices, device_indices, (layer,), to_device=False)

    def backup_from_device_all_layer(self, host_indices, device_indices):
        self._move(host_indices, device_indices, range(self.plan.num_layers), to_device=False)

    def _check(self, items: torch.Tensor, rows: torch.Tensor) -> None:
        """Guard every address before the first byte moves (negative indices would wrap around)."""
        if int(items.min()) < 0 or int(items.max()) >= self.plan.num_items:
            raise IndexError(
                f"host indices out of range: [{int(items.min())}, {int(items.max())}] of [0, {self.plan.num_items})"
            )
        if int(rows.min()) < 0 or int(rows.max()) >= self.plan.device_rows:
            raise IndexError(
                f"device indices out of range: [{int(rows.min())}, {int(rows.max())}] of [0, {self.plan.device_rows})"
            )

    def _offsets(self, part: BoundPart, inner: torch.Tensor, items: torch.Tensor, layer: int) -> torch.Tensor:
        page, token = items // self.tokens_per_page, items % self.tokens_per_page
        base = part.host_offset + page * part.page_stride + token * part.token_stride + layer * part.layer_stride
        return base[:, None, None] + inner

    def _move(self, host_indices, device_indices, layers, *, to_device: bool) -> None:
        items = host_indices.to(torch.int64)
        rows = device_indices.to(torch.int64)
        self._check(items, rows)
        rows_on_device = rows.to(self.plan.device)
        for layer in layers:
            for part, inner in zip(self.parts, self.inner):
                offsets = self._offsets(part, inner, items, layer)
                device = part.device_layer_view(layer)
                if to_device:
                    device[rows_on_device] = part.host[offsets].to(device.device)
                else:
                    part.host[offsets] = device[rows_on_device].to("cpu")
