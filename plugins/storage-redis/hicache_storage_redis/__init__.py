"""hicache-storage-redis: the ``redis://host:port/db`` L3 backend (Redis or Valkey, through redis-py)."""

from __future__ import annotations

from hicache_core import hookimpl


@hookimpl
def hicache_register_storage_backends(register):
    from .backend import RedisStorage

    register(RedisStorage)
