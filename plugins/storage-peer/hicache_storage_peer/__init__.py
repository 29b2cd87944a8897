"""hicache-storage-peer: the ``peer://host:port/db`` tier, pages read from other instances' host pools (NIXL)."""

from __future__ import annotations

from hicache_core import hookimpl


@hookimpl
def hicache_register_storage_backends(register):
    from .backend import PeerStorage

    register(PeerStorage)
