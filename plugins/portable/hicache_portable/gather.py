"""``torch.gather``: each (layer, part) moved by one advanced-indexing copy over strided views.

The host side of a part is a strided ``(pages, tokens, heads, piece)`` view of its buffer,
so one indexing expression gathers or scatters every item of a layer whatever the layout;
the device side is ``(rows, heads, piece)``. Bounds are checked before the first byte
moves (a vectorised min/max on the CPU), so bad input never leaves a half-written pool.
"""

from __future__ import annotations

import torch

from hicache_core import OPERATIONS, Implementation, TransferPlan


class TorchGather(Implementation):
    """Vectorised torch copies on the CPU: any pool kind, any layout, every operation; the fallback of last resort."""

    name = "torch.gather"
    io_backend = "torch"
    priority = 1  # below every implementation that claims the same request
    operations = frozenset(OPERATIONS)
    device_types = frozenset({"cpu"})
    engine = "cpu"
    index_dtypes = frozenset({torch.int32, torch.int64})
    index_device = "cpu"
    description = "vectorised torch copies over strided views (CPU; any pool kind and layout)"

    def __init__(self, plan: TransferPlan) -> None:
        super().__init__(plan)
        self._rows = plan.device_rows_per_layer
        self._items = plan.num_items
        self._tpp = plan.tokens_per_page
        # Per part and host layer: (host view, device view), built once.
        self._views = [
            [(part.host_layer_view(layer), part.device_layer_view(layer)) for layer in range(plan.num_layers)]
            for part in plan.parts
        ]

    def load_to_device_per_layer(self, host_indices: torch.Tensor, device_indices: torch.Tensor, layer: int) -> None:
        self._move(host_indices, device_indices, (layer,), to_device=True)

    def backup_from_device_per_layer(
        self, host_indices: torch.Tensor, device_indices: torch.Tensor, layer: int
    ) -> None:
        self._move(host_indices, device_indices, (layer,), to_device=False)

    def backup_from_device_all_layer(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        self._move(host_indices, device_indices, range(self.plan.num_layers), to_device=False)

    def _move(self, h: torch.Tensor, d: torch.Tensor, layers, *, to_device: bool) -> None:
        rows = min(self._rows[layer] for layer in layers)
        lo_h, hi_h = torch.aminmax(h)
        lo_d, hi_d = torch.aminmax(d)
        if int(lo_h) < 0 or int(hi_h) >= self._items or int(lo_d) < 0 or int(hi_d) >= rows:
            raise IndexError(
                f"indices out of range: host [{int(lo_h)}, {int(hi_h)}] of [0, {self._items}), "
                f"device [{int(lo_d)}, {int(hi_d)}] of [0, {rows}); nothing was copied"
            )
        h = h.long()
        d = d.long()
        pages, tokens = (h, torch.zeros_like(h)) if self._tpp == 1 else (h // self._tpp, h % self._tpp)
        for views in self._views:
            for layer in layers:
                host, device = views[layer]
                if to_device:
                    device[d] = host[pages, tokens]
                else:
                    host[pages, tokens] = device[d]
