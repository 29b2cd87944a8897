"""The Mamba / linear-attention state host pool (Qwen3-Next, Nemotron-H, Kimi-Linear) of SGLang 0.5.23, by hicache.

``build_hybrid_mamba_stack`` and ``build_hybrid_mamba_swa_stack`` call the assembler's
``build_mamba_host_pool(mamba_pool, pool_info, *, host_size, layout, mtp_draft_device_pools)``;
:func:`build_mamba_host_pool` takes the same arguments and returns
:class:`SGLangMambaHostPool`: hicache's ``mamba`` pool kind (one item per request slot,
page size 1, SGLang's host shapes ``(slots, layers, 1, *state)`` in both page-first
layouts), with ``MambaPoolHost``'s members. Host layers are the mamba layers of the device
pool, then one per packed MTP draft; SGLang's ``layer_id`` is that host layer.

Served: one conv state and one temporal (SSM) state per layer, contiguous per layer.
Refused at construction (:class:`~hicache_sglang.NotServedError`): several conv states,
conv-only models (no temporal state) and registered slot side states.
"""

from __future__ import annotations

import math
from typing import Any

import torch

import hicache_core as hc

from ..errors import NotServedError
from ..host_memory import sglang_budget
from ..layers import own_layers
from ..sidecar import SGLangSidecarHostPool, SidecarView


class _MambaView(SidecarView):
    """The device layers as hicache's ``mamba`` kind reads them: temporal and conv rows of bytes per slot."""

    def __init__(self, temporal: list[torch.Tensor], conv: list[torch.Tensor], size: int) -> None:
        super().__init__(kind="mamba", attr="temporal_layers", buffers=temporal, page_size=1, size=size)
        self.conv_layers = list(conv)


def _rows(layers: list[torch.Tensor], what: str) -> list[torch.Tensor]:
    out = []
    for i, t in enumerate(layers):
        if not t.is_contiguous():
            raise NotServedError(f"Mamba {what} state of layer {i} is strided (shape {tuple(t.shape)}, strides "
                                 f"{t.stride()}); hicache-sglang needs contiguous slots per layer")  # fmt: skip
        out.append(t.view(torch.uint8).reshape(t.shape[0], -1) if t.dim() > 1 else t.view(torch.uint8).reshape(-1, 1))
    return out


class SGLangMambaHostPool(SGLangSidecarHostPool):
    """hicache's Mamba state host pool, with ``MambaPoolHost``'s members."""

    slot_state_device_tensors: tuple = ()
    slot_state_buffers: tuple = ()

    def __init__(self, core, *, buffer_info: Any, drafts: tuple, size: int) -> None:
        layers = core.layer_num
        super().__init__(core, device_pool=None, layer_shard=False, pool_label="mamba", size=size,
                         page_num=size)  # fmt: skip
        self.buffer_info = buffer_info
        self.mtp_draft_buffer_infos = tuple(drafts)
        self.device_pool = None
        self.num_mamba_layers = layers
        self.temporal_state_shape = tuple(buffer_info.temporal.shape[2:])
        self.conv_state_shapes = [tuple(c.shape[2:]) for c in buffer_info.conv]
        self.temporal_state_elem_size = math.prod(self.temporal_state_shape)
        self.conv_state_elem_sizes = [math.prod(s) for s in self.conv_state_shapes]
        self.temporal_dtype = buffer_info.temporal.dtype
        self.conv_dtype = self.dtype = buffer_info.conv[0].dtype
        self.start_layer, self.end_layer = 0, layers

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend="kernel") -> None:
        super().backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend="kernel", *,
                                 is_draft: bool = False) -> None:  # fmt: skip
        super().load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend)

    @property
    def temporal_buffer(self) -> torch.Tensor:
        """``(slots, layers, 1, *temporal_shape)`` in the temporal dtype (SGLang's shape)."""
        buf = self.core.temporal_buffer
        return buf.view(self.temporal_dtype).view(*buf.shape[:3], *self.temporal_state_shape)

    @property
    def conv_buffer(self) -> list[torch.Tensor]:
        """One ``(slots, layers, 1, *conv_shape)`` per conv state, in the conv dtype (SGLang's shapes)."""
        buf = self.core.conv_buffer
        return [buf.view(self.conv_dtype).view(*buf.shape[:3], *self.conv_state_shapes[0])]

    @property
    def kv_buffer(self) -> list[torch.Tensor]:
        return [self.temporal_buffer, *self.conv_buffer]

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        return [self.temporal_buffer, *self.conv_buffer]

    def get_data_page(self, index: int, flat: bool = True):
        return self.core.get_data_page(int(index), True)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.page_size * self.size_per_token, dtype=torch.uint8)

    def get_page_buffer_meta(self, indices: torch.Tensor):
        return self.core.get_page_buffer_meta(indices)


def build_mamba_host_pool(mamba_pool: Any, pool_info: Any, *, host_size: float, layout: str,
                          mtp_draft_device_pools=()) -> SGLangMambaHostPool:  # fmt: skip
    """``build_mamba_host_pool`` of SGLang's assembler (same arguments), building hicache's pool.

    :raises NotServedError: a Mamba state this pool does not carry (see the module docstring).
    :raises hicache_core.UnsupportedCombinationError: no installed plugin serves the layout and io backend.
    """
    from sglang.srt.mem_cache.pool_host.base import sync_fixed_hicache_size
    from sglang.srt.runtime_context import get_memory

    info = pool_info.buffer_info
    info.validate(layer_ids=pool_info.layer_ids)
    drafts = []
    for draft_pool in mtp_draft_device_pools:
        (draft_info,) = draft_pool.get_device_pool_infos()
        draft_info.buffer_info.validate(layer_ids=draft_info.layer_ids)
        drafts.append(draft_info.buffer_info)
    label = f"Mamba state host pool (layout {layout!r}, io backend {get_memory().hicache_io_backend!r})"
    for i, b in enumerate((info, *drafts)):
        if len(b.conv) != 1:
            raise NotServedError(f"{label}: {len(b.conv)} conv states per layer; hicache's mamba kind carries one")
        if math.prod(b.temporal.shape[2:]) == 0:
            raise NotServedError(f"{label}: a conv-only model (no temporal state); hicache's mamba kind carries both")
        if b.extra_checkpoint_buffers:
            raise NotServedError(f"{label}: registered slot side states ride on the slots; not carried by hicache")
        if i and (b.temporal.shape[0] != 1 or b.temporal.shape[2:] != info.temporal.shape[2:]
                  or b.conv[0].shape[2:] != info.conv[0].shape[2:]):  # fmt: skip
            raise NotServedError(f"{label}: draft {i - 1} is not one layer shaped like the target's")
    temporal = _rows([layer for b in (info, *drafts) for layer in b.temporal.unbind(0)], "temporal")
    conv = _rows([layer for b in (info, *drafts) for layer in b.conv[0].unbind(0)], "conv")
    per_slot = sum(t[0].numel() for t in temporal) + sum(c[0].numel() for c in conv)
    capacity = mamba_pool.host_capacity_tokens if mamba_pool.host_capacity_tokens is not None else mamba_pool.size
    if host_size > 0:
        size = sync_fixed_hicache_size(int(host_size * 1e9 // per_slot), host_size)
    else:
        size = int(capacity * get_memory().hicache_ratio)
    size += 1  # SGLang's padding slot (page size 1)
    view = _MambaView(temporal, conv, size)
    # SGLang's MambaPoolHost indexes its own concatenated target+draft layers by layer_id.
    core = hc.make_host_pool(view, layout=layout, io_backend=get_memory().hicache_io_backend, page_size=1, size=size,
                             label=label, host_memory_check=sglang_budget(label),
                             layer_map=own_layers(len(temporal), what="Mamba"))  # fmt: skip
    return SGLangMambaHostPool(core, buffer_info=info, drafts=tuple(drafts), size=size)
