"""The host pool SGLang gets: a hicache ``HostPool`` with SGLang 0.5.23's host-pool members.

SGLang's controller, radix tree, transfer engine and storage backends talk to a host pool
through the members of its ``HostKVCache`` and ``MHATokenToKVPoolHost`` /
``MLATokenToKVPoolHost``. :class:`SGLangHostPool` gives them those members, with SGLang's
meaning, on top of a pool made by :func:`hicache_core.make_host_pool`; the bytes move
through hicache's dispatcher and plugins.

Layer ids are SGLang's: local to the device pool (``0 .. layer_num - 1`` on a pipeline-parallel rank whose
device pool starts at ``start_layer``; packed MTP draft layers at ``layer_num + depth`` with ``is_draft=True``).
The core reads them through the pool's layer map (:mod:`hicache_sglang.layers`), the one place a layer id is
translated: a load on a rank with ``start_layer > 0`` addresses the right host layer, never a silent no-op.
"""

from __future__ import annotations

from typing import Any

import torch

from hicache_core.pool.host_pool import HostPool

from . import pool_api


class DeviceView:
    """A SGLang device pool's buffers as hicache reads a device pool (its attribute names, absolute layers).

    ``start_layer``/``end_layer`` are absolute and exclusive; ``layer_num`` is the end of the
    stage (``start_layer`` of the SGLang pool plus its device layers), so that a packed draft
    layer's hicache id equals SGLang's local id plus the stage's first layer.
    """

    def __init__(self, *, kind: str, buffers: dict[str, list[torch.Tensor]], page_size: int, size: int,
                 first_layer: int, owned: range, device_layer_num: int, extras: dict[str, int]) -> None:  # fmt: skip
        self.pool_kind = kind
        for attr, tensors in buffers.items():
            setattr(self, attr, list(tensors))
        self.page_size = page_size
        self.size = size
        self.start_layer = first_layer + owned.start
        self.end_layer = first_layer + owned.stop
        self.layer_num = first_layer + device_layer_num
        for name, value in extras.items():
            setattr(self, name, value)


class SGLangHostPool(pool_api.HostPoolMembers):
    """hicache's host pool, speaking SGLang 0.5.23's host-pool API (``HostKVCache``).

    Attributes SGLang reads: ``kv_buffer`` (``k_buffer``/``v_buffer``), ``layout``,
    ``page_size``, ``page_num``, ``size``, ``logical_size``, ``layer_num`` (host layers,
    drafts included), ``target_layer_num``, ``start_layer``/``end_layer`` (the SGLang device
    pool's), ``dtype``, ``device``, ``pin_memory``, ``size_per_token``, ``pool_label``,
    ``can_use_write_back_jit``, ``shared_allocation_domain``, ``storage_format_tag``.
    ``core`` is the hicache pool underneath.
    """

    def __init__(self, core: HostPool, *, sglang_start_layer: int, sglang_end_layer: int,
                 device_capacity_tokens: int, pool_label: str, layer_shard: bool = False) -> None:  # fmt: skip
        self._take_core(core, pool_label)
        # Context-parallel LayerSplit pools: this rank keeps a share of the device pool's layers (the core's
        # layer map says which), and a backup runs per kept layer, as SGLang's does.
        self.layer_shard_enabled = bool(layer_shard)
        self.page_num = core.page_num
        self.size = core.size
        self.target_layer_num = core.layer_num - len(core.layer_map.draft_pools)
        self.start_layer = sglang_start_layer
        self.end_layer = sglang_end_layer
        self.device_capacity_tokens = device_capacity_tokens

    # ---- buffers (read through the core: destroy() empties them) ----------------------------------

    @property
    def kv_buffer(self) -> torch.Tensor | None:
        return self.core.kv_buffer

    @property
    def k_buffer(self) -> torch.Tensor | None:
        return self.core.k_buffer

    @property
    def v_buffer(self) -> torch.Tensor | None:
        return self.core.v_buffer

    # ---- allocator --------------------------------------------------------------------------------

    @property
    def logical_page_size(self) -> int:
        return self.page_size

    # ---- transfers --------------------------------------------------------------------------------

    @pool_api.copies_only
    def load_to_device_per_layer(
        self,
        device_pool: Any,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str,
        *,
        is_draft: bool = False,
    ) -> None:
        """Copy one layer host -> device. ``layer_id`` is SGLang's, local to the device pool."""
        self.core.load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend,
                                           is_draft=is_draft)  # fmt: skip

    def backup_from_device_all_layer(
        self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str
    ) -> None:
        """Copy every kept layer and every packed draft layer device -> host.

        A layer-split pool loops over its kept layers, then its drafts, one layer per call
        (SGLang's order); any other pool moves all of them in one call.
        """
        pool_api.backup_all(self, device_pool, host_indices, device_indices, io_backend)

    # ---- pages, for L3 storage backends -----------------------------------------------------------

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The page holding slot ``index`` (flat: SGLang's byte order, so storage stays compatible)."""
        return self.core.get_data_page(index, flat)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.core.set_from_flat_data_page(index, data_page)

    def get_split_heads_page_buffer_meta(self, indices: torch.Tensor, split_factor: int) -> tuple[list[int], list[int]]:
        """Per page and head group, the K and V runs (storage shared by ranks of different TP sizes)."""
        return self.core.get_split_heads_page_buffer_meta(indices, split_factor)

    def get_ksize_per_token(self) -> int:
        return self.core.get_ksize_per_token()


class SGLangMHAHostPool(SGLangHostPool):
    """MHA: ``k_buffer``/``v_buffer``, with SGLang's ``head_num``, ``head_dim`` and ``v_head_dim``."""

    def __init__(self, core: HostPool, **kw: Any) -> None:
        super().__init__(core, **kw)
        self.head_num, self.head_dim, self.v_head_dim = pool_api.head_geometry(core)
        if self.head_dim == self.v_head_dim:
            # SGLang leaves these unset for head_dim != v_head_dim, so that nothing uses one stride for both.
            self.token_stride_size = self.head_num * self.head_dim * self.dtype.itemsize
            self.layout_dim = self.token_stride_size * self.layer_num

    @property
    def host_kv_data_refs(self) -> list[torch.Tensor]:
        """Per-layer K views, then per-layer V views, each ``[size, head_num, dim]`` (``layer_first`` only)."""
        out = []
        for part, _layer, view in pool_api.layer_slabs(self.core):
            out.append(view.view(self.dtype).view(self.size, part.heads, -1))
        return out


class SGLangMLAHostPool(SGLangHostPool):
    """MLA: one row per token (``kv_buffer``), or latent and rope parts (``page_first_kv_split``)."""

    def __init__(self, core: HostPool, *, kv_lora_rank: int, qk_rope_head_dim: int, kv_cache_dim: int,
                 packed_fp8: bool, **kw: Any) -> None:  # fmt: skip
        super().__init__(core, **kw)
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_cache_dim = kv_cache_dim
        self.dsa_kv_cache_store_fp8 = packed_fp8
        self.token_stride_size = kv_cache_dim * self.dtype.itemsize
        self.layout_dim = self.token_stride_size * self.layer_num

    def get_ksize_per_token(self) -> int:
        # SGLang's MLA pool counts the whole row (latent and rope) as its "K" size.
        return self.size_per_token
