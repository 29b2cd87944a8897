"""hicache-storage-mooncake: the ``mooncake://master-host:port`` L3 backend (Mooncake Store over TCP)."""

from __future__ import annotations

from hicache_core import hookimpl


@hookimpl
def hicache_register_storage_backends(register):
    from .backend import MooncakeStorage

    register(MooncakeStorage)
