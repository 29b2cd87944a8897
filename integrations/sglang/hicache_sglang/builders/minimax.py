"""MiniMax-M3's sparse host pools (SGLang 0.5.23), by hicache: the NVFP4 page rows and the K-only index.

``build_minimax_m3_sparse_stack`` (the assembler) builds, for an NVFP4 KV cache
(``MiniMaxM3Nvfp4KVPool``), ``MiniMaxM3Nvfp4MainKVPoolHost`` (the KV anchor: one row per
(layer, page) holding ``[K, K scale, V, V scale]``) and ``MiniMaxM3Nvfp4IndexKPoolHost``
(the index sidecar: ``[index K, index K scale]`` rows on the anchor's slots); otherwise the KV
anchor comes from ``build_kv_host_pool`` and the index sidecar is ``MHATokenToKOnlyPoolHost``.
The classes here take the same arguments:

- :class:`SGLangMiniMaxM3Nvfp4MainKVPoolHost` and :class:`SGLangMiniMaxM3Nvfp4IndexKPoolHost`:
  hicache's ``nvfp4_page_rows`` kind (the scales travel inside their rows, so they move with
  them, on the same pages), SGLang's host shapes (``layer_first`` ``(layers, pages, row)``,
  both page-first layouts ``(pages, layers, 1, row)``), SGLang's flat pages and its storage
  objects (two per page for the main pool: the first and second half of its layers);
- :class:`SGLangKOnlyHostPool`: hicache's ``mha_k_only`` kind, ``(layers, slots, heads, dim)``,
  ``(slots, layers, heads, dim)`` or ``(pages, layers, page, heads, dim)``.

``layer_id`` is the host layer (the group's layer mapping already translated it); drafts are
not packed into these pools (SGLang raises for ``is_draft``, and so do these).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import hicache_core as hc

from ..build import check_layout_io
from ..errors import NotServedError
from ..host_memory import sglang_budget
from ..layers import own_layers
from ..sidecar import SGLangSidecarHostPool, SidecarView

_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def _core(view: SidecarView, *, layout: str, page_size: int, size: int, pin_memory: bool, label: str, what: str):
    from sglang.srt.runtime_context import get_memory

    io_backend = get_memory().hicache_io_backend
    check_layout_io(layout, io_backend, label)
    try:
        return hc.make_host_pool(
            view,
            layout=layout,
            io_backend=io_backend,
            page_size=page_size,
            size=size,
            pin_memory=pin_memory,
            label=label,
            host_memory_check=sglang_budget(label),
            layer_map=own_layers(
                view.layer_num, what=what, drafts_refused=f"{what} HiCache supports only the base model"
            ),
        )
    except hc.UnsupportedCombinationError as exc:
        exc.add_note(f"(SGLang asked for the {label} with --hicache-mem-layout {layout} "
                     f"--hicache-io-backend {io_backend})")  # fmt: skip
        raise


class _HostLayerPool(SGLangSidecarHostPool):
    """A MiniMax host pool: ``layer_id`` is its own host layer, drafts are refused, the device pool is SGLang's."""

    _what = "MiniMax"

    def prepare_layer_loader(self, device_pool, host_indices, device_indices, io_backend):
        """One loader per submission, called per layer (SGLang's page-row pools offer it)."""

        def load_layer(layer_id: int, *, is_draft: bool = False) -> None:
            self.load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend,
                                          is_draft=is_draft)  # fmt: skip

        return load_layer


class SGLangMiniMaxM3Nvfp4IndexKPoolHost(_HostLayerPool):
    """``MiniMaxM3Nvfp4IndexKPoolHost`` (same constructor): index K rows with their scales, on the anchor's slots."""

    storage_objects_per_page = 1
    _what = "M3.1 NVFP4"

    def __init__(self, buffer_info: Any, anchor_host: Any, layout: str, pin_memory: bool = True, device: str = "cpu",
                 allocator_type: str = "default", *, start_layer: int, end_layer: int) -> None:  # fmt: skip
        self._build(buffer_info, layout=layout, page_size=anchor_host.page_size, size=anchor_host.size,
                    page_num=anchor_host.page_num, pin_memory=pin_memory, allocator_type=allocator_type,
                    label="MiniMax NVFP4 index-K host pool", pool_label="indexer")  # fmt: skip
        self.start_layer, self.end_layer = start_layer, end_layer

    def _build(self, buffer_info: Any, *, layout: str, page_size: int, size: int, page_num: int, pin_memory: bool,
               allocator_type: str, label: str, pool_label: str) -> None:  # fmt: skip
        if layout not in _LAYOUTS:
            raise ValueError(f"MiniMax NVFP4 HiCache supports layer_first, page_first, and page_first_direct "
                             f"layouts, got {layout!r}.")  # fmt: skip
        if page_size != buffer_info.page_size:
            raise ValueError(f"MiniMax NVFP4 host/device page sizes must match, got {page_size} and "
                             f"{buffer_info.page_size}.")  # fmt: skip
        if allocator_type != "default":
            raise NotServedError(f"{label}: the {allocator_type!r} host allocator is SGLang's; hicache allocates")
        buffer_info.validate()
        rows = list(buffer_info.rows)
        if not rows:
            raise NotServedError(f"{label}: the device pool has no layers to mirror")
        self.row_bytes = buffer_info.row_bytes
        self.device_rows = buffer_info.rows
        self.device_slab = buffer_info.slab
        self.device_num_pages = buffer_info.num_pages
        self.device_slots = buffer_info.num_pages * buffer_info.page_size
        view = SidecarView(kind="nvfp4_page_rows", attr="rows", buffers=rows, page_size=page_size,
                           size=self.device_slots)  # fmt: skip
        core = _core(
            view, layout=layout, page_size=page_size, size=size, pin_memory=pin_memory, label=label, what=self._what
        )
        super().__init__(core, device_pool=None, layer_shard=False, pool_label=pool_label, size=size,
                         page_num=page_num)  # fmt: skip
        self.dtype = torch.uint8
        self.size_per_token = self.page_bytes // page_size

    @property
    def page_bytes(self) -> int:
        """Host bytes of one page across all layers."""
        return self.layer_num * self.row_bytes

    @property
    def kv_buffer(self) -> torch.Tensor:
        return self.core.kv_buffer

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        return [self.kv_buffer]

    def get_size_per_token(self) -> int:
        return self.page_bytes // self.page_size

    def get_ksize_per_token(self) -> int:
        return self.get_size_per_token()

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.core.get_data_page(int(index) - int(index) % self.page_size, True)
        return page if flat else page.view(self.layer_num, self.row_bytes)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.core.set_from_flat_data_page(int(index) - int(index) % self.page_size, data_page.reshape(-1))

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """Per page, ``storage_objects_per_page`` runs: its layers split as ``np.array_split`` splits them."""
        if self.layout not in ("page_first", "page_first_direct"):
            raise ValueError(f"Unsupported zero-copy layout: {self.layout}")
        if len(indices) % self.page_size != 0:
            raise ValueError("MiniMax NVFP4 page metadata requires full pages.")
        page_ptrs, page_sizes = self.core.get_page_buffer_meta(indices)
        if len(page_ptrs) != len(indices) // self.page_size or set(page_sizes) - {self.page_bytes}:
            raise ValueError(f"the {self.layout} host pages are not one run of {self.page_bytes} bytes each")
        objects = [(int(rows[0]) * self.row_bytes, len(rows) * self.row_bytes)
                   for rows in np.array_split(np.arange(self.layer_num), self.storage_objects_per_page)]  # fmt: skip
        ptrs, sizes = [], []
        for page_ptr in page_ptrs:
            for offset, size in objects:
                ptrs.append(page_ptr + offset)
                sizes.append(size)
        return ptrs, sizes

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        if self.layout not in ("page_first", "page_first_direct"):
            return False
        return self.kv_buffer.data_ptr() % page_size_bytes == 0 and self.page_bytes % page_size_bytes == 0


class SGLangMiniMaxM3Nvfp4MainKVPoolHost(SGLangMiniMaxM3Nvfp4IndexKPoolHost):
    """``MiniMaxM3Nvfp4MainKVPoolHost`` (same constructor): the KV anchor, sized as SGLang's ``HostKVCache``."""

    storage_objects_per_page = 2

    def __init__(self, buffer_info: Any, host_to_device_ratio: float, host_size: float, page_size: int, layout: str,
                 pin_memory: bool = True, device: str = "cpu", allocator_type: str = "default", *,
                 device_capacity_tokens: int, start_layer: int, end_layer: int,
                 pool_label: str = "kv") -> None:  # fmt: skip
        from sglang.srt.mem_cache.pool_host.base import sync_fixed_hicache_size

        if layout not in _LAYOUTS:
            raise ValueError(f"Unsupported MiniMax NVFP4 host layout: {layout}")
        if page_size != buffer_info.page_size:
            raise ValueError(f"MSA-v1 NVFP4 main HiCache requires matching page sizes, got {page_size} and "
                             f"{buffer_info.page_size}.")  # fmt: skip
        per_token = len(buffer_info.rows) * buffer_info.row_bytes // page_size
        if host_size > 0:
            tokens = sync_fixed_hicache_size(int(host_size * 1e9 // per_token), host_size)
        else:
            tokens = int(device_capacity_tokens * host_to_device_ratio)
        page_num = tokens // page_size + 1  # SGLang's padding page
        self._build(buffer_info, layout=layout, page_size=page_size, size=page_num * page_size, page_num=page_num,
                    pin_memory=pin_memory, allocator_type=allocator_type, label="MiniMax NVFP4 main KV host pool",
                    pool_label=pool_label)  # fmt: skip
        self.device_capacity_tokens = device_capacity_tokens
        self.start_layer, self.end_layer = start_layer, end_layer

    def get_ksize_per_token(self) -> int:
        return self.get_size_per_token() // 2


class SGLangKOnlyHostPool(_HostLayerPool):
    """``MHATokenToKOnlyPoolHost`` (same constructor): MiniMax's sparse index K, K only, on the anchor's slots."""

    _what = "MiniMax index-K"

    def __init__(self, device_pool: Any, anchor_host: Any, layout: str, pin_memory: bool = True, device: str = "cpu",
                 allocator_type: str = "default") -> None:  # fmt: skip
        label = f"MiniMax index-K host pool ({type(device_pool).__name__})"
        if allocator_type != "default":
            raise NotServedError(f"{label}: the {allocator_type!r} host allocator is SGLang's; hicache allocates")
        k = list(device_pool.k_buffer)
        if not k:
            raise NotServedError(f"{label}: the device pool has no layers to mirror")
        for i, t in enumerate(k):
            if t.dim() != 3 or not t.is_contiguous():
                raise NotServedError(f"{label}: K of layer {i} is not contiguous [slots, heads, dim] (shape "
                                     f"{tuple(t.shape)}); hicache-sglang needs token-major rows")  # fmt: skip
        self.head_num, self.head_dim = device_pool.head_num, device_pool.head_dim
        self.layer_num = len(k)
        self.element_dim = self.head_num * self.head_dim
        self.token_stride_size = self.element_dim * k[0].element_size()
        self.layout_dim = self.token_stride_size * self.layer_num
        view = SidecarView(kind="mha_k_only", attr="k_buffer", buffers=k, page_size=anchor_host.page_size,
                           size=k[0].shape[0])  # fmt: skip
        core = _core(view, layout=layout, page_size=anchor_host.page_size, size=anchor_host.size,
                     pin_memory=pin_memory, label=label, what=self._what)  # fmt: skip
        super().__init__(core, device_pool=device_pool, layer_shard=False, pool_label="indexer", size=anchor_host.size,
                         page_num=anchor_host.page_num)  # fmt: skip
        self.dtype = device_pool.store_dtype
        self.start_layer, self.end_layer = device_pool.start_layer, device_pool.end_layer
        self.size_per_token = self.layout_dim

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.core.k_buffer.view(self.dtype)

    @property
    def kv_buffer(self) -> torch.Tensor:
        return self.k_buffer

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        return [self.k_buffer]

    def get_size_per_token(self) -> int:
        return self.layout_dim

    def get_ksize_per_token(self) -> int:
        return self.layout_dim

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """One run per page (all layers of its tokens), page-first layouts only, as SGLang's K-only pool."""
        if len(indices) % self.page_size:
            raise ValueError(f"page metadata needs whole pages of {self.page_size} slots, got {len(indices)}")
        if self.layout not in ("page_first", "page_first_direct"):
            raise ValueError(f"Unsupported layout: {self.layout}")
        return self.core.get_page_buffer_meta(indices)
