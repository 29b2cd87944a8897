"""hicache's L3 tier: pages of the host pool in a store (files, Redis, Mooncake Store, ...), as plugins.

* :func:`make_storage` builds the backend of a URL (``file:///dir``, ``redis://host:port/db``,
  ``mooncake://host:port``, ``memory://name``) and returns a :class:`PageStore` bound to a host
  pool: SGLang's ``HiCacheStorage`` page API, keys, page header, checksums, batches and statistics.
* :class:`StorageBackend` is the base class a storage plugin subclasses: byte primitives on whole
  objects; plugins register it through ``hicache_register_storage_backends``.
* :func:`page_hashes` is SGLang's SHA-256 key chain; :class:`Namespace` keeps pages of
  other models, weight versions, geometries and rank shares apart (``PageStore.set_weight_version``
  moves a live store to new weights: ``weights.py``).
* :class:`StorageController` backs pages up and prefetches them on worker threads, and
  makes tensor-parallel ranks agree on what was found.
* :class:`ClusterKey` is the cluster's key (``HICACHE_L3_KEY_FILE``): with it, every page carries a
  keyed MAC and loads only when it checks (:mod:`hicache_core.storage.page_auth`).

``make_storage`` and ``UnknownStorageScheme`` are served by name only, with no typing import here:
``make`` sits above the registry, which imports this package's contract, so an import of it here
would close a circle. Type checkers read them from :mod:`hicache_core.storage.make`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_face

if TYPE_CHECKING:
    from .backend import (
        Capabilities,
        NotAPage,
        ObjectMissing,
        PageResult,
        PageStatus,
        SizeMismatch,
        StorageBackend,
        StorageError,
        StorageFull,
    )
    from .controller import BackupFuture, PrefetchFuture, PrefetchResult, PrefetchTimeout, StorageController
    from .keys import Namespace, hash_page, namespace_for, page_hashes
    from .page_auth import ClusterKey, ClusterKeyError
    from .page_store import STORAGE_BATCH_SIZE, PageStore, StorageStats
    from .pages import PageMap, Span
    from .url import StorageURL

_EXPORTS = {
    "STORAGE_BATCH_SIZE": "page_store",
    "Capabilities": "backend",
    "NotAPage": "backend",
    "ObjectMissing": "backend",
    "PageResult": "backend",
    "PageStatus": "backend",
    "SizeMismatch": "backend",
    "StorageBackend": "backend",
    "StorageError": "backend",
    "StorageFull": "backend",
    "StorageStats": "page_store",
    "PageStore": "page_store",
    "BackupFuture": "controller",
    "PrefetchFuture": "controller",
    "PrefetchResult": "controller",
    "PrefetchTimeout": "controller",
    "StorageController": "controller",
    "Namespace": "keys",
    "hash_page": "keys",
    "namespace_for": "keys",
    "page_hashes": "keys",
    "PageMap": "pages",
    "Span": "pages",
    "StorageURL": "url",
    "UnknownStorageScheme": "make",
    "make_storage": "make",
    "ClusterKey": "page_auth",
    "ClusterKeyError": "page_auth",
}
__all__ = [
    "BackupFuture",
    "Capabilities",
    "ClusterKey",
    "ClusterKeyError",
    "Namespace",
    "NotAPage",
    "ObjectMissing",
    "PageMap",
    "PageResult",
    "PageStatus",
    "PageStore",
    "PrefetchFuture",
    "PrefetchResult",
    "PrefetchTimeout",
    "STORAGE_BATCH_SIZE",
    "SizeMismatch",
    "Span",
    "StorageBackend",
    "StorageController",
    "StorageError",
    "StorageFull",
    "StorageStats",
    "StorageURL",
    "UnknownStorageScheme",
    "hash_page",
    "make_storage",
    "namespace_for",
    "page_hashes",
]

__getattr__, __dir__ = lazy_face(globals(), _EXPORTS)
