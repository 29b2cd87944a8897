"""The copy-engine implementation: one raw-pointer copy per contiguous run, layer and part.

Runs are maximal sequences of items where host and device slots both advance by
one and the host bytes stay contiguous (within a page, or across pages where the
layout keeps pages adjacent, as ``layer_first`` does). Pairs are sorted by host
slot first, so scattered radix-tree pages still merge where they can.
"""

from __future__ import annotations

import torch

from hicache_core import OPERATIONS, Implementation, TransferPlan, TransferRequest

from .memcpy import copier_for


class DirectCopy(Implementation):
    """Copy engine only: one ``cudaMemcpyAsync`` per contiguous run, layer and part, on the current stream."""

    name = "direct.copy_engine"
    io_backend = "direct"
    priority = 10
    operations = frozenset(OPERATIONS)
    device_types = frozenset({"cpu", "cuda"})
    index_dtypes = frozenset({torch.int64})
    index_device = "cpu"
    description = "copy engine: one cudaMemcpyAsync per contiguous run, layer and part"

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
        self.non_blocking = plan.device.type == "cuda"
        self.tokens_per_page = plan.tokens_per_page
        self.host_items = plan.num_items
        self.rows_per_layer = plan.device_rows_per_layer
        self.parts = [_PartAddresses(part) for part in plan.parts]
        self.copier = copier_for(plan.device)
        # Items of a page are adjacent (the claim guarantees it); runs may also cross a page
        # boundary only where every part keeps whole pages adjacent too.
        self.pages_adjacent = all(p.page_stride == plan.tokens_per_page * p.item_bytes for p in plan.parts)

    def load_to_device_per_layer(self, host_indices, device_indices, layer):
        self._copy(host_indices, device_indices, (layer,), to_device=True)

    def backup_from_device_per_layer(self, host_indices, device_indices, layer):
        self._copy(host_indices, device_indices, (layer,), to_device=False)

    def backup_from_device_all_layer(self, host_indices, device_indices):
        self._copy(host_indices, device_indices, range(self.plan.num_layers), to_device=False)

    def runs(self, host: torch.Tensor, device: torch.Tensor, device_rows: int) -> list[tuple[int, int, int]]:
        """``(host start, device start, length)`` of each contiguous run, after sorting by host slot."""
        lo_h, hi_h = int(host.min()), int(host.max())
        lo_d, hi_d = int(device.min()), int(device.max())
        if lo_h < 0 or hi_h >= self.host_items or lo_d < 0 or hi_d >= device_rows:
            raise IndexError(
                f"indices out of range: host [{lo_h}, {hi_h}] of [0, {self.host_items}), "
                f"device [{lo_d}, {hi_d}] of [0, {device_rows}); nothing was copied"
            )
        if host.numel() > 1 and not bool((host[1:] >= host[:-1]).all()):
            host, order = torch.sort(host)
            device = device[order]
        brk = (host[1:] - host[:-1] != 1) | (device[1:] - device[:-1] != 1)
        if not self.pages_adjacent:
            brk |= host[1:] % self.tokens_per_page == 0
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.nonzero(brk).reshape(-1) + 1])
        lengths = torch.diff(starts, append=torch.tensor([host.numel()]))
        return list(zip(host[starts].tolist(), device[starts].tolist(), lengths.tolist()))

    def _copy(self, host_indices, device_indices, layers, *, to_device: bool) -> None:
        # Every layer moves the same rows: bound them by the layer with the fewest (a small draft layer).
        runs = self.runs(host_indices, device_indices, min(self.rows_per_layer[layer] for layer in layers))
        copier = self.copier
        stream = copier.begin()
        for layer in layers:
            for part in self.parts:
                host_base = part.host_base + layer * part.layer_stride
                dev_base = part.device_bases[layer]
                for h0, d0, n in runs:
                    page, token = divmod(h0, self.tokens_per_page)
                    host = host_base + page * part.page_stride + token * part.token_stride
                    dev = dev_base + d0 * part.row_bytes
                    if part.whole_row:
                        if to_device:
                            copier.copy(dev, host, n * part.item_bytes, stream)
                        else:
                            copier.copy(host, dev, n * part.item_bytes, stream)
                    elif to_device:
                        copier.copy2d(dev, part.row_bytes, host, part.item_bytes, part.item_bytes, n, stream)
                    else:
                        copier.copy2d(host, part.item_bytes, dev, part.row_bytes, part.item_bytes, n, stream)


class _PartAddresses:
    """Base addresses and byte strides of one part, computed once per pool."""

    def __init__(self, part) -> None:
        self.host_base = part.host.data_ptr() + part.host_offset
        self.page_stride = part.page_stride
        self.token_stride = part.token_stride
        self.layer_stride = part.layer_stride
        self.item_bytes = part.item_bytes
        self.row_bytes = part.device_row_bytes
        self.device_bases = [t.data_ptr() + part.device_offset for t in part.device_layers]
        # A part that is a whole device row is one linear run; a slice of each row (the MLA
        # latent or rope half) is a 2-D copy: rows of item_bytes at the device row pitch.
        self.whole_row = part.device_offset == 0 and part.item_bytes == part.device_row_bytes
