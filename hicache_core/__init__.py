"""hicache: move KV-cache pages between GPU memory and pinned host memory, through plugins.

The core owns pools, layouts, hook specs and the dispatcher; every transfer
implementation is a plugin found through the ``hicache`` entry point group.

Names are loaded on first use, so that importing a submodule (the conformance
kit's pytest plugin, the hook markers) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import lazy_face

if TYPE_CHECKING:
    from .device_pools import MHADevicePool, MLADevicePool, PageRowsDevicePool
    from .dispatch import UnsupportedCombinationError, explain_refusal, resolve
    from .drops import DroppedIndicesError, DropReport
    from .geometry import PoolGeometry
    from .hookspecs import hookimpl
    from .host_pool import HostPool, TransferError, geometry_of, make_host_pool
    from .implementation import BACKUP_ALL, BACKUP_LAYER, LOAD, OPERATIONS, Implementation, TransferRequest
    from .layouts import AXES, Layout
    from .plan import BoundPart, TransferPlan
    from .pool_events import PoolObserver
    from .pool_kinds import POOL_KINDS, ComponentDecl, PoolKind
    from .reference import reference_copy
    from .registry import Registry, get_registry, reset_registry

_EXPORTS = {
    "MHADevicePool": "device_pools",
    "MLADevicePool": "device_pools",
    "PageRowsDevicePool": "device_pools",
    "UnsupportedCombinationError": "dispatch",
    "explain_refusal": "dispatch",
    "resolve": "dispatch",
    "PoolGeometry": "geometry",
    "geometry_of": "host_pool",
    "hookimpl": "hookspecs",
    "HostPool": "host_pool",
    "PoolObserver": "pool_events",
    "TransferError": "host_pool",
    "make_host_pool": "host_pool",
    "BACKUP_ALL": "implementation",
    "BACKUP_LAYER": "implementation",
    "LOAD": "implementation",
    "OPERATIONS": "implementation",
    "Implementation": "implementation",
    "TransferRequest": "implementation",
    "AXES": "layouts",
    "Layout": "layouts",
    "POOL_KINDS": "pool_kinds",
    "ComponentDecl": "pool_kinds",
    "PoolKind": "pool_kinds",
    "DroppedIndicesError": "drops",
    "DropReport": "drops",
    "BoundPart": "plan",
    "TransferPlan": "plan",
    "reference_copy": "reference",
    "Registry": "registry",
    "get_registry": "registry",
    "reset_registry": "registry",
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
