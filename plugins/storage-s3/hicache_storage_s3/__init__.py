"""hicache-storage-s3: the ``s3://bucket/prefix`` L3 backend (AWS S3, SeaweedFS, MinIO, Ceph RGW, ...)."""

from __future__ import annotations

from hicache_core import hookimpl


@hookimpl
def hicache_register_storage_backends(register):
    from .backend import S3Storage

    register(S3Storage)
