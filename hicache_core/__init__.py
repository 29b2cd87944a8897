"""hicache: move KV-cache pages between GPU memory and pinned host memory, through plugins.

The core owns pools, layouts, hook specs and the dispatcher; every transfer
implementation is a plugin found through the ``hicache`` entry point group.
"""

from .device_pools import MHADevicePool, MLADevicePool, PageRowsDevicePool
from .dispatch import UnsupportedCombinationError, explain_refusal, resolve
from .geometry import PoolGeometry, geometry_of
from .hookspecs import hookimpl
from .host_pool import HostPool, make_host_pool
from .implementation import (
    BACKUP_ALL,
    BACKUP_LAYER,
    LOAD,
    OPERATIONS,
    Implementation,
    TransferRequest,
)
from .layouts import AXES, POOL_KINDS, Layout
from .plan import BoundPart, TransferPlan
from .reference import reference_copy
from .registry import Registry, get_registry, reset_registry

__all__ = [
    "AXES",
    "BACKUP_ALL",
    "BACKUP_LAYER",
    "LOAD",
    "OPERATIONS",
    "POOL_KINDS",
    "BoundPart",
    "HostPool",
    "Implementation",
    "Layout",
    "MHADevicePool",
    "MLADevicePool",
    "PageRowsDevicePool",
    "PoolGeometry",
    "Registry",
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
