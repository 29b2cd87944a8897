"""hicache-storage-file: the ``file:///dir`` L3 backend."""

from __future__ import annotations

from hicache_core import hookimpl


@hookimpl
def hicache_register_storage_backends(register):
    from .backend import FileStorage

    register(FileStorage)
