"""The transfer plan: a host pool's tensors and byte strides, bound once.

Implementations receive a :class:`TransferPlan` when a host pool is made and
derive everything their hot path needs from it. All strides here are in bytes
and all tensors are ``uint8`` views, because transfers move bytes whatever the
dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .drops import DropReport
from .geometry import PoolGeometry
from .host_layout import HostLayoutSpec, HostPart


@dataclass(frozen=True)
class BoundPart:
    """One part of an item (K, V, the MLA row, a split half, a page row), with both sides bound.

    Host address of (item ``t``, host layer ``l``, head ``h``), in bytes from ``host.data_ptr()``:
    ``host_offset + (t // tokens_per_page) * page_stride + (t % tokens_per_page) * token_stride
    + l * layer_stride + h * head_stride``. Device address: row ``r`` of ``device_layers[l]``
    plus ``device_offset + h * device_head_stride``. Each head moves ``piece_bytes``.
    """

    spec: HostPart
    host: torch.Tensor
    host_offset: int
    page_stride: int
    token_stride: int
    layer_stride: int
    head_stride: int
    heads: int
    piece_bytes: int
    device_offset: int
    device_head_stride: int
    device_row_bytes: int
    device_layers: tuple[torch.Tensor, ...]
    num_pages: int
    tokens_per_page: int

    @property
    def item_bytes(self) -> int:
        return self.heads * self.piece_bytes

    @property
    def host_item_contiguous(self) -> bool:
        return self.heads == 1 or self.head_stride == self.piece_bytes

    @property
    def device_item_contiguous(self) -> bool:
        return self.heads == 1 or self.device_head_stride == self.piece_bytes

    def host_layer_view(self, layer: int) -> torch.Tensor:
        """``(pages, tokens_per_page, heads, piece_bytes)`` strided view of one host layer."""
        return self.host.as_strided(
            (self.num_pages, self.tokens_per_page, self.heads, self.piece_bytes),
            (self.page_stride, self.token_stride, self.head_stride, 1),
            self.host_offset + layer * self.layer_stride,
        )

    def device_layer_view(self, layer: int) -> torch.Tensor:
        """``(rows, heads, piece_bytes)`` view of this part in one device layer."""
        rows = self.device_layers[layer]
        per_head = rows.view(rows.shape[0], self.heads, self.device_head_stride)
        return per_head[:, :, self.device_offset : self.device_offset + self.piece_bytes]


class TransferPlan:
    """A host pool's buffers and its device pool's layers, bound for transfers."""

    def __init__(
        self,
        geometry: PoolGeometry,
        spec: HostLayoutSpec,
        host_buffers: dict[str, torch.Tensor],
        device_layers: dict[str, list[torch.Tensor]],
        drop_report: DropReport | None = None,
    ) -> None:
        self.geometry = geometry
        self.spec = spec
        self.layout = spec.layout
        self.num_layers = spec.num_layers
        self.tokens_per_page = spec.tokens_per_page
        self.num_items = spec.num_items
        self.host_buffers = host_buffers
        self.device = next(iter(device_layers.values()))[0].device
        #: Where an implementation that masks out-of-range indices reports them (see :mod:`hicache_core.pool.drops`);
        #: pinned for CUDA pools, so that kernels can reach it through UVA.
        self.drop_report = drop_report if drop_report is not None else DropReport(pinned=self.device.type == "cuda")
        it = geometry.itemsize
        parts = []
        for part in spec.parts:
            comp = geometry.components[part.component]
            host = host_buffers[spec.buffers[part.buffer].attr]
            host_bytes = host.view(-1).view(torch.uint8) if host.dtype != torch.uint8 else host.view(-1)
            layers = tuple(t.view(t.shape[0], -1).view(torch.uint8) for t in device_layers[comp.attr])
            bound = BoundPart(
                spec=part,
                host=host_bytes,
                host_offset=part.offset * it,
                page_stride=part.page_stride * it,
                token_stride=part.token_stride * it,
                layer_stride=part.layer_stride * it,
                head_stride=part.head_stride * it,
                heads=part.heads,
                piece_bytes=part.dim * it,
                device_offset=part.dim_start * it,
                device_head_stride=comp.dim * it,
                device_row_bytes=(comp.heads or 1) * comp.dim * it,
                device_layers=layers,
                num_pages=spec.num_pages,
                tokens_per_page=spec.tokens_per_page,
            )
            parts.append(bound)
        self.parts: tuple[BoundPart, ...] = tuple(parts)
        self.device_rows = self.parts[0].device_layers[0].shape[0]
        #: Device rows of each host layer (a draft layer may have fewer than the target's).
        self.device_rows_per_layer: tuple[int, ...] = tuple(
            min(part.device_layers[layer].shape[0] for part in self.parts) for layer in range(self.num_layers)
        )
        self.min_device_rows = min(self.device_rows_per_layer)
