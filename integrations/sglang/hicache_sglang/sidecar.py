"""Host pools that ride on another's slots (SGLang's sidecars): a hicache pool plus SGLang's layer map.

SGLang 0.5.23 keeps some host pools beside the KV anchor of a ``HostPoolGroup``: the DSA
indexer (and its draft), the DeepSeek-V4 sub-pools. Their host layers are compact (only
the device layers that hold buffers, then one layer per packed draft) and their indices
are the anchor's token slots, moved as whole page rows. :class:`SGLangSidecarHostPool`
gives SGLang those semantics over a :class:`hicache_core.HostPool` whose device view owns
exactly the compact host layers ``0 .. n-1`` (drafts after them); the core's layer map
(:mod:`hicache_sglang.layers`) translates SGLang's local device layer id to the compact host index.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hicache_core import BACKUP_LAYER
from hicache_core.pool.host_pool import HostPool

from . import pool_api


class SidecarView:
    """The device layers a sidecar's host keeps, as hicache reads a device pool (compact layers ``0..n-1``)."""

    def __init__(self, *, kind: str, attr: str, buffers: Sequence[torch.Tensor], page_size: int, size: int) -> None:
        self.pool_kind = kind
        setattr(self, attr, list(buffers))
        self.page_size = page_size
        self.size = size
        self.start_layer = 0
        self.end_layer = self.layer_num = len(buffers)


class SGLangSidecarHostPool(pool_api.HostPoolMembers):
    """hicache's host pool with a SGLang sidecar's members (layer map, drafts, page-row indices).

    :param core: the hicache pool over the kept layers (and one view per draft), made with SGLang's layer map.
    :param device_pool: SGLang's device pool (``None`` where the pool addresses its own host layers).
    :param layer_shard: back up one layer per call (SGLang's loop for context-parallel LayerSplit pools).
    """

    # alloc, free, available_size, clear: CoreSlots (a sidecar reuses its anchor's slots; SGLang's keeps one anyway).

    can_use_jit = False

    def __init__(self, core: HostPool, *, device_pool: Any, layer_shard: bool, pool_label: str, size: int,
                 page_num: int) -> None:  # fmt: skip
        self._take_core(core, pool_label)
        self.device_pool = device_pool
        self.mtp_draft_device_pools = core.layer_map.draft_pools
        self.layer_shard_enabled = bool(layer_shard)
        # Slots follow the anchor: SGLang reports the anchor's size and page count, whatever
        # spare page rows the buffer keeps.
        self.size = size
        self.page_num = page_num
        self.target_layer_num = core.layer_num - len(self.mtp_draft_device_pools)
        self.start_layer = getattr(device_pool, "start_layer", 0)
        self.end_layer = getattr(device_pool, "end_layer", None)

    # ---- transfers ----------------------------------------------------------------------------

    @pool_api.copies_only
    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend, *,
                                 is_draft: bool = False) -> None:  # fmt: skip
        """Copy one layer host -> device; ``layer_id`` is SGLang's local device layer id."""
        self.core.load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend,
                                           is_draft=is_draft)  # fmt: skip

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend) -> None:
        """Copy every kept layer and every draft device -> host (per layer under LayerSplit, as SGLang)."""
        pool_api.backup_all(self, device_pool, host_indices, device_indices, io_backend)

    # ---- pages, for L3 storage backends -------------------------------------------------------

    def get_data_page(self, index: int, flat: bool = True):
        return self.core.get_data_page(int(index) - int(index) % self.page_size, flat)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.core.set_from_flat_data_page(int(index) - int(index) % self.page_size, data_page)

    def get_ksize_per_token(self) -> int:
        return self.size_per_token


def sidecar_operations(layer_shard: bool) -> tuple[str, ...]:
    """What a sidecar runs: loads, and all-layer backups or (LayerSplit) per-layer ones."""
    from hicache_core import BACKUP_ALL, LOAD

    return (LOAD, BACKUP_LAYER) if layer_shard else (LOAD, BACKUP_ALL)
