"""DeepSeek-V4's host pools (``memory_pool_host.py`` of SGLang 0.5.23), built by hicache with the same arguments.

``build_deepseek_v4_hicache_stack`` and ``build_swa_draft_pools`` call three constructors
from the assembler's namespace; the adapter puts these classes there:

- :class:`SGLangLogicalHostPool` for ``LogicalHostPool``: the FULL anchor, page-aligned
  token slots and no bytes (every transfer is a no-op, as in SGLang);
- :class:`SGLangDeepSeekV4PagedHostPool` for ``DeepSeekV4PagedHostPool``: one paged
  sub-pool (SWA, C4 and C128 KV, the C4 indexer), hicache's ``dsv4_paged`` kind, one item
  per page row of ``item_bytes``;
- :class:`SGLangDeepSeekV4StateHostPool` for ``DeepSeekV4StateHostPool``: the
  compress-state rings, hicache's ``dsv4_state`` kind, one item per SWA page
  (``ring_size`` state slots), indices SWA-page-aligned.

In these pools SGLang's ``layer_id`` is the host layer (the stack's layer mappers already
compacted it, drafts' SWA layers included), and the device buffers are the constructor's.
hicache moves whole page rows only: SGLang's token-granular C4 copy (its
``transfer_cache_dsv4_mla`` kernel, for unaligned indices) is not served, and an unaligned
call raises before any byte moves.
"""

from __future__ import annotations

from typing import Any

import torch

import hicache_core as hc
from hicache_core.pool.host_pool import SlotAllocator

from ..errors import NotServedError
from ..host_memory import sglang_budget
from ..layers import own_layers
from ..sidecar import SGLangSidecarHostPool, SidecarView


class SGLangLogicalHostPool:
    """``LogicalHostPool``: page-aligned token slots (hicache's allocator) and no bytes."""

    shared_allocation_domain = None
    stores_page_envelope = False
    storage_format_tag = None
    can_use_write_back_jit = True

    def __init__(self, size: int, page_size: int, layout: str = "layer_first") -> None:
        if size % page_size != 0:
            raise ValueError(f"LogicalHostPool size must be page-aligned, got size={size}, page_size={page_size}")
        self.size = self.logical_size = size
        self.page_size = page_size
        self.device = "cpu"
        self.layout = layout
        self.dtype = torch.uint8
        self.layer_num = self.start_layer = self.end_layer = 0
        self.kv_buffer = None
        self.size_per_token = 0
        self.allocator = SlotAllocator(size, page_size)

    def clear(self) -> None:
        self.allocator.clear()

    def destroy(self) -> None:
        return None

    def available_size(self) -> int:
        return self.allocator.available_size()

    def alloc(self, need_size: int) -> torch.Tensor | None:
        return self.allocator.alloc(need_size)

    def free(self, indices: torch.Tensor) -> int:
        return self.allocator.free(indices)

    def prepare_transfer_indices(self, host_indices, device_indices, io_backend):
        return host_indices, device_indices

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend) -> None:
        return None

    backup_from_device_all_layer_physical = backup_from_device_all_layer

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend, *,
                                 is_draft: bool = False) -> None:  # fmt: skip
        return None

    load_to_device_per_layer_physical = load_to_device_per_layer

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_from_flat_data_page(self, index, data_page) -> None:
        return None

    def get_page_buffer_meta(self, indices):
        return None

    def get_page_buffer_element_size(self, split_factor: int = 1):
        return None

    def get_ksize_per_token(self) -> int:
        return 0


class _PageRowHostPool(SGLangSidecarHostPool):
    """A V4 page-row pool: ``layer_id`` is the host layer; the device pool argument is SGLang's, unused."""

    def __init__(self, core, *, pool_name: str, layers: int, **kw: Any) -> None:
        super().__init__(core, layer_shard=False, pool_label=pool_name, device_pool=None, **kw)
        self.pool_name = pool_name
        self.start_layer, self.end_layer = 0, layers

    @property
    def kv_buffer(self):
        buf = self.core.kv_buffer
        # SGLang keeps layer_first as a list of per-layer tensors; the same views, in the same order.
        return list(buf) if self.layout == "layer_first" else buf

    @property
    def data_refs(self) -> list[torch.Tensor]:
        return list(self.core.kv_buffer) if self.layout == "layer_first" else []

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        buf = self.kv_buffer
        return buf if isinstance(buf, list) else [buf]

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return self.core.get_dummy_flat_data_page()


def _make_core(kind: str, attr: str, buffers: list[torch.Tensor], *, pages: int, page_size: int, layout: str,
               pin_memory: bool, label: str):  # fmt: skip
    from sglang.srt.runtime_context import get_memory

    io_backend = get_memory().hicache_io_backend
    view = SidecarView(kind=kind, attr=attr, buffers=buffers, page_size=page_size, size=pages * page_size)
    try:
        # SGLang's V4 pools address host layer ``layer_id`` of their own buffers whatever pool is passed
        # (the SWA pool's packed draft buffers come as plain layers after the target's).
        core = hc.make_host_pool(view, layout=layout, io_backend=io_backend, page_size=page_size,
                                 size=pages * page_size, pin_memory=pin_memory, label=label,
                                 host_memory_check=sglang_budget(label),
                                 layer_map=own_layers(len(buffers), what=label))  # fmt: skip
    except hc.UnsupportedCombinationError as exc:
        exc.add_note(f"(SGLang asked for the {label} with --hicache-mem-layout {layout} "
                     f"--hicache-io-backend {io_backend})")  # fmt: skip
        raise
    return core


def _device_rows(buffers: list[torch.Tensor], row_bytes: int, label: str) -> list[torch.Tensor]:
    """Each device buffer as ``(rows, row_bytes)`` bytes (SGLang's kernels address it so)."""
    out = []
    for layer, t in enumerate(buffers):
        if not t.is_contiguous() or t.dim() < 1 or t[0].nbytes != row_bytes:
            raise NotServedError(
                f"{label}: device buffer {layer} (shape {tuple(t.shape)}, dtype {t.dtype}) is not contiguous rows of "
                f"{row_bytes} bytes; hicache moves whole page rows"
            )
        out.append(t.view(torch.uint8).reshape(t.shape[0], row_bytes))
    return out


class SGLangDeepSeekV4PagedHostPool(_PageRowHostPool):
    """``DeepSeekV4PagedHostPool`` (same constructor), served by hicache's ``dsv4_paged`` kind."""

    def __init__(self, pool_name: str, device_buffers: list[torch.Tensor], item_bytes: int, num_host_pages: int,
                 slot_page_size: int, layout: str = "layer_first", device: str = "cpu", pin_memory: bool = True,
                 allocator_type: str = "default", page_aligned_only: bool = False) -> None:  # fmt: skip
        label = f"DeepSeek-V4 paged host pool {pool_name!r}"
        if allocator_type != "default":
            raise NotServedError(f"{label}: the {allocator_type!r} host allocator is SGLang's; hicache allocates")
        if not device_buffers:
            raise NotServedError(f"{label}: no device buffers to mirror")
        rows = _device_rows(list(device_buffers), item_bytes, label)
        core = _make_core("dsv4_paged", "device_buffers", rows, pages=num_host_pages, page_size=slot_page_size,
                                layout=layout, pin_memory=pin_memory, label=label)  # fmt: skip
        super().__init__(core, pool_name=pool_name, layers=len(rows),
                         size=num_host_pages * slot_page_size, page_num=num_host_pages)  # fmt: skip
        self.item_bytes = item_bytes
        self.num_host_pages = num_host_pages
        self.slot_page_size = slot_page_size
        self.page_aligned_only = page_aligned_only
        self.device_buffers = list(device_buffers)
        self.size_per_token = item_bytes

    def _check_aligned(self, host_indices, device_indices) -> bool:
        if host_indices is None or device_indices is None:
            return False
        if host_indices.numel() != device_indices.numel():
            raise ValueError(f"{self.pool_name} transfer index size mismatch: host={host_indices.numel()}, "
                             f"device={device_indices.numel()}")  # fmt: skip
        if host_indices.numel() % self.slot_page_size:
            raise ValueError(
                f"{self.pool_name} expects page-aligned indices: got {host_indices.numel()} host and "
                f"{device_indices.numel()} device indices for page size {self.slot_page_size} (hicache moves whole "
                "page rows; SGLang's token-granular DSv4 C4 copy is not served)"
            )
        return host_indices.numel() > 0

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend, *,
                                 is_draft: bool = False) -> None:  # fmt: skip
        if self._check_aligned(host_indices, device_indices):
            super().load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend)

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend) -> None:
        if self._check_aligned(host_indices, device_indices):
            super().backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)

    def get_size_per_token(self) -> int:
        return self.item_bytes

    def get_ksize_per_token(self) -> int:
        return self.item_bytes


class SGLangDeepSeekV4StateHostPool(_PageRowHostPool):
    """``DeepSeekV4StateHostPool`` (same constructor), served by hicache's ``dsv4_state`` kind.

    It reuses the SWA pool's transfer indices and has no allocator of its own, as SGLang's.
    """

    def __init__(self, pool_name: str, state_pools: list, num_host_pages: int, swa_page_size: int,
                 layout: str = "layer_first", device: str = "cpu", pin_memory: bool = True,
                 allocator_type: str = "default") -> None:  # fmt: skip
        label = f"DeepSeek-V4 state host pool {pool_name!r}"
        if any(pool is None for pool in state_pools):
            raise ValueError(f"{pool_name} state_pools must not contain None")
        if allocator_type != "default":
            raise NotServedError(f"{label}: the {allocator_type!r} host allocator is SGLang's; hicache allocates")
        ring_sizes = {pool.ring_size for pool in state_pools}
        slot_bytes = {pool.kv_score_buffer.kv_score[0].nbytes for pool in state_pools}
        if len(ring_sizes) != 1 or len(slot_bytes) != 1:
            raise ValueError(f"{pool_name} state pools must share ring size and slot bytes")
        self.ring_size = ring_sizes.pop()
        self.state_page_bytes = self.ring_size * slot_bytes.pop()
        # One SWA page of state is ring_size consecutive slots: the device rows are whole rings.
        views = []
        for pool in state_pools:
            state = pool.kv_score_buffer.kv_score
            if not state.is_contiguous():
                raise ValueError(f"{pool_name} state tensor must be contiguous")
            usable = (state.shape[0] // self.ring_size) * self.ring_size
            slots = state.view(torch.uint8).reshape(state.shape[0], -1)[:usable]
            views.append(slots.reshape(-1, self.state_page_bytes))
        self.device_page_views = views
        core = _make_core("dsv4_state", "device_page_views", views, pages=num_host_pages,
                                page_size=swa_page_size, layout=layout, pin_memory=pin_memory,
                                label=label)  # fmt: skip
        super().__init__(core, pool_name=pool_name, layers=len(views),
                         size=num_host_pages * swa_page_size, page_num=num_host_pages)  # fmt: skip
        self.state_pools = list(state_pools)
        self.num_host_pages = num_host_pages
        self.swa_page_size = swa_page_size
        self.size_per_token = self.state_page_bytes

    def _aligned(self, indices) -> None:
        if indices.numel() % self.swa_page_size:
            raise ValueError(
                f"{self.pool_name} transfer indices must be SWA-page-aligned, got numel={indices.numel()}, "
                f"swa_page_size={self.swa_page_size}"
            )

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend, *,
                                 is_draft: bool = False) -> None:  # fmt: skip
        if host_indices is None or device_indices is None:
            return
        self._aligned(host_indices)
        self._aligned(device_indices)
        super().load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend)

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend) -> None:
        if host_indices is None or device_indices is None:
            return
        self._aligned(host_indices)
        self._aligned(device_indices)
        super().backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)

    def get_size_per_token(self) -> int:
        return self.state_page_bytes

    def get_ksize_per_token(self) -> int:
        return self.state_page_bytes

    def clear(self) -> None:
        return None

    def available_size(self) -> int:
        raise NotImplementedError(f"{self.pool_name} reuses SWA transfer indices and has no allocator")

    def alloc(self, need_size: int):
        raise NotImplementedError(f"{self.pool_name} reuses SWA transfer indices and has no allocator")

    def free(self, indices) -> int:
        raise NotImplementedError(f"{self.pool_name} reuses SWA transfer indices and has no allocator")
