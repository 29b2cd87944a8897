"""hicache-storage-redis: the ``redis://host:port/db`` and ``rediss://`` (TLS) L3 backends (Redis, Valkey)."""

from __future__ import annotations

from hicache_core import hookimpl


@hookimpl
def hicache_register_storage_backends(register):
    from .backend import RedisStorage, RedisTLSStorage

    register(RedisStorage)
    register(RedisTLSStorage)
