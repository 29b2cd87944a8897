"""``memory://name``: a store in this process's memory (built in; for tests, demos and single-process use).

Backends made with the same name in one process share their objects, as two servers
would share a real store; nothing survives the process. ``?capacity=64MiB`` bounds it:
a write that does not fit is refused (``full``), never silently dropped.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

from .backend import Capabilities, ObjectMissing, SizeMismatch, StorageBackend, StorageFull
from .pages import Span
from .url import StorageURL, option_bytes

_STORES: dict[str, _Store] = {}
_STORES_LOCK = threading.Lock()


class _Store:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: dict[str, bytearray] = {}
        self.used = 0
        self.refused = 0


class MemoryStorage(StorageBackend):
    """Objects in a dict of this process, shared by every backend of the same ``memory://name``."""

    scheme: ClassVar[str] = "memory"
    capabilities: ClassVar[Capabilities] = Capabilities(zero_copy=True, durable=False, shared=False)
    description: ClassVar[str] = "this process's memory (tests, demos)"
    options_help: ClassVar[dict[str, str]] = {"capacity": "bytes this store may hold (default: unbounded)"}

    def __init__(self, url: StorageURL, **options: Any) -> None:
        super().__init__(url, **options)
        if url.username or url.password:
            raise ValueError(f"memory:// takes no credentials (it is this process's memory); got {url.redacted!r}")
        self.capacity = option_bytes(options["capacity"], "capacity") if "capacity" in options else None
        name = (url.host or "") + url.path
        with _STORES_LOCK:
            self._store = _STORES.setdefault(name, _Store())

    def exists_objects(self, keys: Sequence[str]) -> list[bool]:
        with self._store.lock:
            return [k in self._store.objects for k in keys]

    def put_objects(self, keys: Sequence[str], values: Sequence[Sequence[Span]]) -> list[BaseException | None]:
        out: list[BaseException | None] = []
        for key, spans in zip(keys, values):
            blob = bytearray(b"".join(bytes(s.view) for s in spans))
            with self._store.lock:
                old = len(self._store.objects.get(key, b""))
                if self.capacity is not None and self._store.used - old + len(blob) > self.capacity:
                    self._store.refused += 1
                    out.append(StorageFull(f"memory://{self.url.host or ''}{self.url.path} holds "
                                           f"{self._store.used} of {self.capacity} bytes"))  # fmt: skip
                    continue
                self._store.objects[key] = blob
                self._store.used += len(blob) - old
            out.append(None)
        return out

    def get_objects_into(self, keys: Sequence[str], targets: Sequence[Sequence[Span]]) -> list[BaseException | None]:
        out: list[BaseException | None] = []
        for key, spans in zip(keys, targets):
            with self._store.lock:
                blob = self._store.objects.get(key)
            if blob is None:
                out.append(ObjectMissing(key))
                continue
            total = sum(s.nbytes for s in spans)
            if len(blob) != total:
                out.append(SizeMismatch(f"stored object is {len(blob)} bytes, the targets take {total}"))
                continue
            src = (ctypes.c_char * len(blob)).from_buffer(blob)
            offset = 0
            for s in spans:
                ctypes.memmove(s.ptr, ctypes.addressof(src) + offset, s.nbytes)
                offset += s.nbytes
            out.append(None)
        return out

    def get_objects(self, keys: Sequence[str]) -> list[bytes | None]:
        with self._store.lock:
            return [bytes(self._store.objects[k]) if k in self._store.objects else None for k in keys]

    def attach_leases(self, book: Any) -> str:
        return "never"  # a full memory:// refuses writes: it evicts nothing

    def remove_objects(self, keys: Sequence[str]) -> None:
        with self._store.lock:
            for k in keys:
                blob = self._store.objects.pop(k, None)
                if blob is not None:
                    self._store.used -= len(blob)

    def clear(self) -> None:
        with self._store.lock:
            self._store.objects.clear()
            self._store.used = 0

    def backend_stats(self) -> dict[str, Any]:
        with self._store.lock:
            return {"objects": len(self._store.objects), "used_bytes": self._store.used,
                    "capacity_bytes": self.capacity, "refused_full": self._store.refused}  # fmt: skip

    def corrupt(self, full_key: str, offset: int) -> None:
        """Flip one byte of a stored object (tests of the checksum path)."""
        with self._store.lock:
            self._store.objects[full_key][offset] ^= 0xFF
