"""Host pools that ride on another's slots (SGLang's sidecars): a hicache pool plus SGLang's layer map.

SGLang 0.5.23 keeps some host pools beside the KV anchor of a ``HostPoolGroup``: the DSA
indexer (and its draft), the DeepSeek-V4 sub-pools. Their host layers are compact (only
the device layers that hold buffers, then one layer per packed draft) and their indices
are the anchor's token slots, moved as whole page rows. :class:`SGLangSidecarHostPool`
gives SGLang those semantics over a :class:`hicache_core.HostPool` whose device view owns
exactly the compact host layers ``0 .. n-1`` (drafts after them), so the one translation
is SGLang's local device layer id to the compact host index.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hicache_core import BACKUP_LAYER
from hicache_core.host_pool import ENV_VALIDATE, HostPool

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

    :param core: the hicache pool over ``view`` (and one view per draft).
    :param host_layer_of: SGLang's local device layer id -> compact host layer, for the target layers.
    :param draft_layer_base: the layer id SGLang's controller passes for draft 0 (``device_pool.layer_num``).
    :param layer_shard: back up one layer per call (SGLang's loop for context-parallel LayerSplit pools).
    """

    # alloc, free, available_size, clear: CoreSlots (a sidecar reuses its anchor's slots; SGLang's keeps one anyway).

    can_use_jit = False

    def __init__(
        self,
        core: HostPool,
        *,
        view: SidecarView,
        draft_views: Sequence[SidecarView],
        device_pool: Any,
        draft_device_pools: Sequence[Any],
        host_layer_of: dict[int, int],
        draft_layer_base: int,
        layer_shard: bool,
        pool_label: str,
        size: int,
        page_num: int,
    ) -> None:
        self._take_core(core, pool_label)
        self._view = view
        self._draft_views = tuple(draft_views)
        self.device_pool = device_pool
        self.mtp_draft_device_pools = tuple(draft_device_pools)
        self._host_layer_of = dict(host_layer_of)
        self._draft_layer_base = draft_layer_base
        self.layer_shard_enabled = bool(layer_shard)
        # Slots follow the anchor: SGLang reports the anchor's size and page count, whatever
        # spare page rows the buffer keeps.
        self.size = size
        self.page_num = page_num
        self.target_layer_num = core.layer_num - len(self._draft_views)
        self.start_layer = getattr(device_pool, "start_layer", 0)
        self.end_layer = getattr(device_pool, "end_layer", None)

    # ---- transfers ----------------------------------------------------------------------------

    def _target(self, device_pool: Any, layer_id: int, is_draft: bool) -> tuple[SidecarView, int] | None:
        if is_draft:
            depth = int(layer_id) - self._draft_layer_base
            if not 0 <= depth < len(self._draft_views):
                raise IndexError(
                    f"draft layer_id {layer_id} is out of range: this {self.pool_label!r} pool's draft layers are "
                    f"[{self._draft_layer_base}, {self._draft_layer_base + len(self._draft_views)})"
                )
            if device_pool is not self.mtp_draft_device_pools[depth]:
                raise ValueError(f"device_pool is not the draft pool of depth {depth} this host pool was built with")
            return self._draft_views[depth], self.target_layer_num + depth
        if device_pool is not self.device_pool:
            raise ValueError(
                f"device_pool {type(device_pool).__name__} is not the device pool this {self.pool_label!r} host "
                "pool was built for"
            )
        host = self._host_layer_of.get(int(layer_id))
        if host is None:
            # SGLang's sidecars skip a layer they keep nothing for (shared-topk, another rank's shard).
            if self.core.validate and not 0 <= int(layer_id) < getattr(device_pool, "layer_num", 0):
                raise ValueError(
                    f"layer_id {layer_id} is outside the device pool's layers; the call would do nothing. "
                    f"Reported because {ENV_VALIDATE} is set."
                )
            return None
        return self._view, host

    @pool_api.copies_only
    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend, *,
                                 is_draft: bool = False) -> None:  # fmt: skip
        """Copy one layer host -> device; ``layer_id`` is SGLang's local device layer id."""
        target = self._target(device_pool, layer_id, is_draft)
        if target is None:
            return
        view, host = target
        self.core.load_to_device_per_layer(view, host_indices, device_indices, host, io_backend,
                                           is_draft=view is not self._view)  # fmt: skip

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend) -> None:
        """Copy every kept layer and every draft device -> host (per layer under LayerSplit, as SGLang)."""
        if device_pool is not self.device_pool:
            raise ValueError(
                f"device_pool {type(device_pool).__name__} is not the device pool this {self.pool_label!r} host "
                "pool was built for"
            )
        if not self.layer_shard_enabled:
            self.core.backup_from_device_all_layer(self._view, host_indices, device_indices, io_backend)
            return
        for host in sorted(self._host_layer_of.values()):
            self.core.backup_from_device_per_layer(self._view, host_indices, device_indices, host, io_backend)
        for depth, view in enumerate(self._draft_views):
            self.core.backup_from_device_per_layer(view, host_indices, device_indices, self.target_layer_num + depth,
                                                   io_backend, is_draft=True)  # fmt: skip

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
