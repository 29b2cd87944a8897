"""What a page read or write comes to, and what a backend returns or raises to say so.

The vocabulary shared by the storage plugin's contract (``backend.py``, which re-exports it) and the
core's page store (``page_store.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class PageStatus(str, Enum):
    """The outcome of one page of a read or a write."""

    OK = "ok"
    MISSING = "missing"  # the store has no object under the key
    CORRUPT = "corrupt"  # header or payload checksum wrong
    MISMATCH = "mismatch"  # a sound page, but another format version, geometry, key or size
    AUTH_FAILED = "auth_failed"  # the cluster key does not authenticate it (written without it, with another, changed)
    FULL = "full"  # the store refused the write for lack of space
    ERROR = "error"  # the backend raised or reported an error
    TIMEOUT = "timeout"  # not done within the time the caller allowed
    CANCELLED = "cancelled"  # the caller cancelled before it ran
    SKIPPED = "skipped"  # not attempted (e.g. already stored, or an earlier page of the prefix failed)


@dataclass(frozen=True)
class PageResult:
    """One page's outcome; ``detail`` says why when it is not ``ok``."""

    key: str
    status: PageStatus
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status is PageStatus.OK


class StorageError(RuntimeError):
    """A storage backend could not do what was asked (connect, reach its server, ...)."""


class StorageFull(StorageError):
    """A backend refuses a write because the store is full; the page reports ``full``."""


class ObjectMissing(KeyError):
    """Returned (not raised) by ``get_objects_into`` for a key the store does not hold."""


class SizeMismatch(ValueError):
    """Returned by ``get_objects_into`` when the stored object's size differs from the targets'."""


class NotAPage(ValueError):
    """Returned (not raised) for a key whose stored value is not a hicache page (e.g. a Redis list): ``mismatch``."""
