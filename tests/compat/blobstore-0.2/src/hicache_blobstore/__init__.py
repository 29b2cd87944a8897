"""hicache-blobstore: ``blobstore://name``, objects in a process-wide dict, written against hicache-core 0.2.

In 0.2 a backend was also its page store, so a plugin could answer SGLang's prefix query natively
by overriding ``batch_exists``, and read its own statistics with ``self.get_stats()``. Its pin is a
floor only (``hicache-core>=0.2``), so nothing but the check of the class itself stops it on 0.4.
"""

from __future__ import annotations

import threading

from hicache_core import hookimpl
from hicache_core.storage import Capabilities, StorageBackend

_OBJECTS: dict[str, dict[str, bytes]] = {}
_LOCK = threading.Lock()


class BlobStore(StorageBackend):
    """Objects in a dict shared by every instance of one ``blobstore://name``."""

    scheme = "blobstore"
    capabilities = Capabilities()
    description = "objects in a process-wide dict (a plugin written for hicache-core 0.2)"

    def __init__(self, url, **options):
        super().__init__(url, **options)
        with _LOCK:
            self.objects = _OBJECTS.setdefault(url.host or "", {})

    def exists_objects(self, keys):
        return [k in self.objects for k in keys]

    def put_objects(self, keys, values):
        for key, spans in zip(keys, values):
            self.objects[key] = b"".join(bytes(s.view) for s in spans)
        return [None] * len(keys)

    def get_objects(self, keys):
        return [self.objects.get(k) for k in keys]

    def batch_exists(self, keys, extra_info=None):
        """0.2: one pass over the dict instead of the base class's batches."""
        full = self.namespace.keys(keys)
        return next((i for i, k in enumerate(full) if k not in self.objects), len(full))

    def hit_rate(self):
        stats = self.get_stats()
        return stats.exists_hits / max(stats.exists_queries, 1)


@hookimpl
def hicache_register_storage_backends(register):
    register(BlobStore)
