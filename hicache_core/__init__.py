"""hicache: move KV-cache pages between GPU memory and pinned host memory, through plugins.

The core owns pools, layouts, hook specs and the dispatcher; every transfer
implementation is a plugin found through the ``hicache`` entry point group.

Names are loaded on first use, so that importing a submodule (the conformance
kit's pytest plugin, the hook markers) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import install_moved_modules, lazy_face

install_moved_modules()  # the modules that moved into rooms, under their old paths for a while

if TYPE_CHECKING:
    from .declared.layouts import AXES, Layout
    from .declared.pool_kinds import POOL_KINDS, ComponentDecl, PoolKind
    from .plugins.dispatch import UnsupportedCombinationError, explain_refusal, resolve
    from .plugins.hookspecs import hookimpl
    from .plugins.implementation import BACKUP_ALL, BACKUP_LAYER, LOAD, OPERATIONS, Implementation, TransferRequest
    from .plugins.reference import reference_copy
    from .plugins.registry import Registry, get_registry, reset_registry
    from .pool.device_pools import MHADevicePool, MLADevicePool, PageRowsDevicePool
    from .pool.drops import DroppedIndicesError, DropReport
    from .pool.geometry import PoolGeometry
    from .pool.host_pool import HostPool, TransferError, geometry_of, make_host_pool
    from .pool.plan import BoundPart, TransferPlan
    from .pool.pool_events import PoolObserver

_EXPORTS = {
    "MHADevicePool": "pool.device_pools",
    "MLADevicePool": "pool.device_pools",
    "PageRowsDevicePool": "pool.device_pools",
    "UnsupportedCombinationError": "plugins.dispatch",
    "explain_refusal": "plugins.dispatch",
    "resolve": "plugins.dispatch",
    "PoolGeometry": "pool.geometry",
    "geometry_of": "pool.host_pool",
    "hookimpl": "plugins.hookspecs",
    "HostPool": "pool.host_pool",
    "PoolObserver": "pool.pool_events",
    "TransferError": "pool.host_pool",
    "make_host_pool": "pool.host_pool",
    "BACKUP_ALL": "plugins.implementation",
    "BACKUP_LAYER": "plugins.implementation",
    "LOAD": "plugins.implementation",
    "OPERATIONS": "plugins.implementation",
    "Implementation": "plugins.implementation",
    "TransferRequest": "plugins.implementation",
    "AXES": "declared.layouts",
    "Layout": "declared.layouts",
    "POOL_KINDS": "declared.pool_kinds",
    "ComponentDecl": "declared.pool_kinds",
    "PoolKind": "declared.pool_kinds",
    "DroppedIndicesError": "pool.drops",
    "DropReport": "pool.drops",
    "BoundPart": "pool.plan",
    "TransferPlan": "pool.plan",
    "reference_copy": "plugins.reference",
    "Registry": "plugins.registry",
    "get_registry": "plugins.registry",
    "reset_registry": "plugins.registry",
}
__all__ = [
    "AXES",
    "BACKUP_ALL",
    "BACKUP_LAYER",
    "BoundPart",
    "ComponentDecl",
    "DropReport",
    "DroppedIndicesError",
    "HostPool",
    "Implementation",
    "LOAD",
    "Layout",
    "MHADevicePool",
    "MLADevicePool",
    "OPERATIONS",
    "POOL_KINDS",
    "PageRowsDevicePool",
    "PoolGeometry",
    "PoolKind",
    "PoolObserver",
    "Registry",
    "TransferError",
    "TransferPlan",
    "TransferRequest",
    "UnsupportedCombinationError",
    "explain_refusal",
    "geometry_of",
    "get_registry",
    "hookimpl",
    "make_host_pool",
    "reference_copy",
    "reset_registry",
    "resolve",
]

__getattr__, __dir__ = lazy_face(globals(), _EXPORTS)
