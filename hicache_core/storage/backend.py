"""The ``StorageBackend`` base class: SGLang's ``HiCacheStorage`` contract on top of a few byte primitives.

A storage plugin subclasses :class:`StorageBackend`, declares its URL ``scheme`` and
:class:`Capabilities`, and implements the object primitives (``exists_objects``,
``put_objects``, and ``get_objects_into`` or ``get_objects``). Everything page-shaped
lives here, once, for every backend: keys in the pool's namespace, the self-describing
header, checksums, batches of :data:`STORAGE_BATCH_SIZE`, validation of host indices
before any byte moves, per-page results and the statistics.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .. import metrics as _metrics
from .keys import Namespace, fingerprint, geometry_description
from .page_format import (
    CHECKSUM_DEVICE,
    CHECKSUM_XXH3_64,
    HEADER_SIZE,
    HeaderError,
    VersionError,
    address_of,
    checksum_runs,
    pack_header,
    stored_algorithm,
    unpack_header,
)
from .pages import PageMap, Span
from .url import redact_text, scrub_exception, secrets_of

if TYPE_CHECKING:
    from .url import StorageURL

#: The methods a plugin writes (its primitives and ``__init__``): every exception that leaves one is
#: redacted (:func:`~hicache_core.storage.url.scrub_exception`), so no plugin has to remember to.
_PLUGIN_METHODS = ("__init__", "exists_objects", "put_objects", "get_objects_into", "get_objects", "ping",
                   "register_memory", "remove_objects", "clear", "close", "backend_stats", "raw_put_from",
                   "raw_get_into", "bind")  # fmt: skip


def _scrubbing(method: Any) -> Any:
    """``method``, with every exception it raises redacted of the backend's secrets before it propagates."""
    if getattr(method, "_hicache_scrubbing", False):
        return method

    @functools.wraps(method)
    def scrubbed(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except BaseException as exc:
            # __init__ may fail before the base class stored the secrets: take them from its arguments.
            url = getattr(self, "url", None) or (args[0] if args else None)
            options = getattr(self, "options", None) or kwargs
            scrub_exception(exc, secrets_of(url if hasattr(url, "secrets") else None, options))
            raise

    scrubbed._hicache_scrubbing = True  # type: ignore[attr-defined]
    return scrubbed

#: The most pages one backend call moves (SGLang's ``STORAGE_BATCH_SIZE``).
STORAGE_BATCH_SIZE = 128


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared as data.

    :param zero_copy: reads land straight in the host pool's pages and writes leave from
        them (``get_objects_into``); without it the core copies each page out of the
        bytes ``get_objects`` returns.
    :param durable: stored pages survive a restart of the store (and of this process).
    :param shared: other processes, or other machines, see the same pages.
    """

    zero_copy: bool = False
    durable: bool = False
    shared: bool = False


class PageStatus(str, Enum):
    """The outcome of one page of a read or a write."""

    OK = "ok"
    MISSING = "missing"  # the store has no object under the key
    CORRUPT = "corrupt"  # header or payload checksum wrong
    MISMATCH = "mismatch"  # a sound page, but another format version, geometry, key or size
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


@dataclass
class StorageStats:
    """Counters of one backend instance; ``get_stats()`` returns a copy. Nothing fails uncounted."""

    exists_queries: int = 0
    exists_hits: int = 0
    pages_written: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0
    write_failed: int = 0
    write_refused_full: int = 0
    pages_read: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    read_missing: int = 0
    read_corrupt: int = 0
    read_mismatch: int = 0
    read_failed: int = 0
    backend: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["write_gbps"] = self.bytes_written / self.write_seconds / 1e9 if self.write_seconds else 0.0
        out["read_gbps"] = self.bytes_read / self.read_seconds / 1e9 if self.read_seconds else 0.0
        return out


_READ_COUNTER = {
    PageStatus.MISSING: "read_missing",
    PageStatus.CORRUPT: "read_corrupt",
    PageStatus.MISMATCH: "read_mismatch",
}


#: A URL scheme (RFC 3986): a letter, then letters, digits, ``+``, ``-`` or ``.``, lower case here.
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*$")


class StorageBackend:
    """Base class of every L3 storage backend (SGLang's ``HiCacheStorage`` contract).

    Subclasses set :attr:`scheme` and :attr:`capabilities`, take ``(url, **options)`` in
    ``__init__`` (calling ``super().__init__(url, **options)``), and implement:

    * :meth:`exists_objects` (required),
    * :meth:`put_objects` (required),
    * :meth:`get_objects_into` when ``capabilities.zero_copy``, else :meth:`get_objects`,
    * optionally :meth:`register_memory`, :meth:`remove_objects`, :meth:`clear`,
      :meth:`close`, :meth:`backend_stats`.

    The primitives see whole objects (header and payload) under full keys; they are
    called from several threads at once and must be thread-safe. :func:`make_storage`
    builds the backend and binds it to a host pool and a :class:`Namespace`; the contract
    methods (:meth:`batch_exists`, :meth:`batch_get_into`, :meth:`batch_set_from`,
    :meth:`get`, :meth:`set`, ...) then take page hashes and host slots.
    """

    scheme: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities] = Capabilities()
    description: ClassVar[str] = ""
    #: Pages go to the primitives in groups of at most this many payload bytes (at least one page):
    #: a page's checksum is then taken while its bytes are still in the CPU cache from the copy
    #: that moved them, instead of a second pass over DRAM (it cost a third of the read speed).
    io_chunk_bytes: ClassVar[int] = 8 << 20
    #: Options this backend accepts (URL query or keyword), with a one-line meaning each.
    options_help: ClassVar[Mapping[str, str]] = {}
    #: How to start the store's server, for messages when it cannot be reached ("" for serverless stores).
    server_hint: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in _PLUGIN_METHODS:
            if name in cls.__dict__ and callable(cls.__dict__[name]):
                setattr(cls, name, _scrubbing(cls.__dict__[name]))

    @property
    def secrets(self) -> tuple[str, ...]:
        """The secret values this backend was given (URL password, secret options): never shown."""
        return secrets_of(self.url, self.options)

    def redact(self, text: str) -> str:
        """``text`` as it may be shown: this backend's secrets, and any URL's credentials, replaced by ``***``."""
        return redact_text(text, self.secrets)

    @classmethod
    def declaration_problems(cls) -> list[str]:
        """What is malformed in the class declaration (checked when a plugin registers it)."""
        problems = []
        if not isinstance(cls.scheme, str) or not _SCHEME.match(cls.scheme):
            problems.append(f"scheme must be a URL scheme such as 'file' or 'redis', got {cls.scheme!r}")
        if not isinstance(cls.capabilities, Capabilities):
            problems.append("capabilities must be a hicache_core.storage.Capabilities")
        else:
            reader = "get_objects_into" if cls.capabilities.zero_copy else "get_objects"
            for name in ("exists_objects", "put_objects", reader):
                if getattr(cls, name) is getattr(StorageBackend, name):
                    problems.append(f"does not implement {name}")
        return problems

    def __init__(self, url: StorageURL, **options: Any) -> None:
        unknown = sorted(set(options) - set(self.options_help))
        if unknown:
            known = ", ".join(sorted(self.options_help)) or "none"
            raise ValueError(f"{self.scheme}:// storage does not take option(s) {', '.join(unknown)}; options: {known}")
        self.url = url
        self.options = dict(options)
        self.host_pool: Any = None
        self.namespace: Namespace | None = None
        self._pages: PageMap | None = None
        self._fingerprint = b""
        self._stats = StorageStats()
        self._stats_lock = threading.Lock()

    # ---- the plugin's primitives ---------------------------------------------------------------

    def exists_objects(self, keys: Sequence[str]) -> list[bool]:
        """Whether each full key is stored."""
        raise NotImplementedError(f"{type(self).__name__} does not implement exists_objects")

    def put_objects(self, keys: Sequence[str], values: Sequence[Sequence[Span]]) -> list[BaseException | None]:
        """Store each object: the concatenation of its spans (the header first, then the page's runs).

        Return one entry per key: ``None`` when stored, else the exception that says why
        (:class:`StorageFull` when the store refused it for space). A store must never hold a
        partly written object under a key: write atomically, or under a temporary name.
        Raise only when the whole batch failed (the core marks every page with the error).
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement put_objects")

    def get_objects_into(self, keys: Sequence[str], targets: Sequence[Sequence[Span]]) -> list[BaseException | None]:
        """Read each object into its target spans (zero-copy backends).

        Return ``None`` when the object filled the targets exactly, an :class:`ObjectMissing`
        for a missing key, a :class:`SizeMismatch` when the object's size differs from the
        targets' total, or another exception. Raise only when the whole batch failed.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement get_objects_into")

    def get_objects(self, keys: Sequence[str]) -> list[bytes | bytearray | memoryview | BaseException | None]:
        """Read each whole object (backends without zero-copy): its bytes, ``None`` if missing, or an exception."""
        raise NotImplementedError(f"{type(self).__name__} does not implement get_objects")

    def ping(self) -> None:
        """Raise :class:`StorageError` when the store cannot be reached (saying how to start it); default: nothing."""

    def register_memory(self, spans: Sequence[Span]) -> None:
        """Called once when bound to a host pool, with every host buffer (zero-copy backends register them)."""

    def remove_objects(self, keys: Sequence[str]) -> None:
        """Delete objects (missing keys are fine)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement remove_objects")

    def clear(self) -> None:
        """Delete every object this backend can see under its URL."""
        raise NotImplementedError(f"{type(self).__name__} does not implement clear")

    def close(self) -> None:
        """Release connections and registrations; the backend is unusable after."""

    def backend_stats(self) -> dict[str, Any]:
        """The store's own figures (capacity, bytes used, evictions, refusals, ...), as far as it knows them."""
        return {}

    # ---- the raw client, for ``hicache bench --storage`` only -----------------------------------

    def raw_put_from(self, keys: Sequence[str], spans: Sequence[Span]) -> None:
        """Store each contiguous buffer as plainly as the store's own client can (no header, no checksum).

        The benchmark's ceiling: ``hicache bench --storage`` compares the tier against it on the same bytes.
        """
        raise NotImplementedError(f"{type(self).__name__} has no raw client benchmark")

    def raw_get_into(self, keys: Sequence[str], spans: Sequence[Span]) -> None:
        """Read what :meth:`raw_put_from` stored back into the same buffers, as plainly as the client can."""
        raise NotImplementedError(f"{type(self).__name__} has no raw client benchmark")

    # ---- binding ---------------------------------------------------------------------------------

    def bind(self, host_pool: Any, namespace: Namespace) -> None:
        """Tie the backend to the host pool whose pages it moves and the namespace of their keys."""
        self.host_pool = host_pool
        self.namespace = namespace
        self._pages = PageMap(host_pool)
        # From the pool itself, not the namespace: a page is checked against the geometry it
        # would land in, even if a caller forced a namespace that does not describe this pool.
        self._fingerprint = bytes.fromhex(fingerprint(geometry_description(host_pool)))
        self.register_memory(self._pages.buffer_spans())

    @property
    def page_bytes(self) -> int:
        """Payload bytes of one page of the bound host pool."""
        return self._bound().page_bytes

    def _bound(self) -> PageMap:
        if self._pages is None:
            raise RuntimeError(
                f"{type(self).__name__} is not bound to a host pool: make it with make_storage(url, host_pool, ...)"
            )
        return self._pages

    # ---- SGLang's HiCacheStorage contract --------------------------------------------------------

    def batch_exists(self, keys: Sequence[str], extra_info: Any = None) -> int:
        """How many leading page hashes of ``keys`` are stored (a prefix length, as SGLang's)."""
        hashes = check_keys(keys)
        if self.namespace is None:
            self._bound()
        full = self.namespace.keys(hashes)
        hits = 0
        for start in range(0, len(full), STORAGE_BATCH_SIZE):
            chunk = full[start : start + STORAGE_BATCH_SIZE]
            found = self.exists_objects(chunk)
            if len(found) != len(chunk):
                raise StorageError(f"{type(self).__name__}.exists_objects answered {len(found)} of {len(chunk)} keys")
            n = next((i for i, f in enumerate(found) if not f), len(found))
            hits += n
            if n < len(chunk):
                break
        with self._stats_lock:
            self._stats.exists_queries += 1
            self._stats.exists_hits += hits
        return hits

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_set_from(self, keys: Sequence[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` (token slots, whole pages) under ``keys``."""
        return [r.ok for r in self.write_pages(keys, host_indices)]

    def batch_get_into(self, keys: Sequence[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Load the pages ``keys`` into the host pool at ``host_indices``; one bool per page."""
        return [r.ok for r in self.read_pages(keys, host_indices)]

    # SGLang's names for the same zero-copy calls, so its controller can drive a hicache backend.
    batch_set_v1 = batch_set_from
    batch_get_v1 = batch_get_into

    def write_pages(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[PageResult]:
        """Store pages; one :class:`PageResult` per key. Checks every argument before a byte moves."""
        hashes = check_keys(keys)
        pages = self._pages_of(hashes, host_indices)
        pm = self._bound()
        refused: dict[int, PageResult] = {}
        if pm.verifier is not None:  # a page that failed host-tier verification never reaches the store
            pm.verifier.collect()
            for i, page in enumerate(pages):
                if page in pm.verifier.quarantine:
                    refused[i] = PageResult(
                        hashes[i],
                        PageStatus.CORRUPT,
                        f"host page {page} failed host-tier "
                        "verification (quarantined until its slots are freed): not written",
                    )
            if refused:
                keep = [i for i in range(len(pages)) if i not in refused]
                written = iter(self.write_pages([hashes[i] for i in keep], _page_slots(
                    [pages[i] for i in keep], pm.page_size)))  # fmt: skip
                return [refused[i] if i in refused else next(written) for i in range(len(pages))]
        work = [(hashes[a:b], self.namespace.keys(hashes[a:b]), [pm.object_spans(p) for p in pages[a:b]])
                for a, b in self._chunks(len(hashes))]  # fmt: skip
        # Two stages in flight: the next chunk's checksums are taken while the store writes this one.
        return self._pipelined(work, lambda w: (w[0], w[1], self._stage_headers(w[1], w[2])), self._stage_put)

    def read_pages(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[PageResult]:
        """Load pages; one :class:`PageResult` per key. A page that is not ``ok`` is never reported loaded.

        Without zero-copy the pool's page is written only after its checksum passed. With
        zero-copy the bytes land in the page first and are checked there, so the slots of a
        page that failed hold unspecified bytes: they were reserved for it, nothing else is touched.
        """
        hashes = check_keys(keys)
        pages = self._pages_of(hashes, host_indices)
        pm = self._bound()
        work = [(hashes[a:b], self.namespace.keys(hashes[a:b]), [pm.object_spans(p) for p in pages[a:b]])
                for a, b in self._chunks(len(hashes))]  # fmt: skip
        # Two stages in flight: the store reads the next chunk while this one's checksums are checked.
        return self._pipelined(work, self._stage_fetch, self._stage_check, fetch_first=True)

    def set(self, key: str, value: torch.Tensor | None = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:  # fmt: skip
        """Store one flat page (as ``host_pool.get_data_page(i, flat=True)`` returns it)."""
        pages = self._bound()
        flat = _flat_bytes(value, pages.page_bytes)
        (h,) = check_keys([key])
        full = self.namespace.key(h)
        ptr = flat.data_ptr()
        span = Span(ptr, pages.page_bytes, memoryview(flat.numpy()).cast("B"))
        return self._put([h], [full], [[span]])[0].ok

    def get(
        self, key: str, target_location: torch.Tensor | None = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        """Load one flat page into ``target_location`` (default: a new dummy flat page); ``None`` on any miss."""
        pages = self._bound()
        (h,) = check_keys([key])
        target = target_location if target_location is not None else self.host_pool.get_dummy_flat_data_page()
        flat = _flat_bytes(target, pages.page_bytes)
        span = Span(flat.data_ptr(), pages.page_bytes, memoryview(flat.numpy()).cast("B"))
        full = self.namespace.key(h)
        if pages.trailer_bytes:
            # A verifying pool's pages carry their checksum row; a flat page has no place for it (the caller's
            # set_from_flat_data_page takes the checksums from the bytes): read it into scratch. A page stored
            # by set() has none: read again without.
            scratch = bytearray(pages.trailer_bytes)
            result = self._get([h], [full], [[span, Span(address_of(scratch), len(scratch), memoryview(scratch))]])[0]
            if result.status is PageStatus.MISMATCH:
                result = self._get([h], [full], [[span]])[0]
        else:
            result = self._get([h], [full], [[span]])[0]
        return target if result.ok else None

    def batch_set(self, keys: Sequence[str], values: Sequence[torch.Tensor] | None = None, **_: Any) -> bool:
        """Store flat pages (SGLang's generic path); true when every page was stored.

        Every key and every value is checked before the first page is written.
        """
        pages = self._bound()
        hashes = check_keys(keys)
        if values is None or isinstance(values, torch.Tensor) or not isinstance(values, Sequence):
            raise TypeError(f"batch_set needs one flat page tensor per key, got {type(values).__name__}")
        if len(values) != len(hashes):
            raise ValueError(f"batch_set got {len(hashes)} keys and {len(values)} values")
        flats = [_flat_bytes(v, pages.page_bytes) for v in values]
        spans = [[Span(f.data_ptr(), pages.page_bytes, memoryview(f.numpy()).cast("B"))] for f in flats]
        return all(r.ok for r in self._put(hashes, self.namespace.keys(hashes), spans))

    def batch_get(self, keys: Sequence[str], target_locations: Sequence[torch.Tensor] | None = None,
                  **_: Any) -> list[torch.Tensor | None]:  # fmt: skip
        """Load flat pages (SGLang's generic path); every key and target is checked before the first read."""
        pages = self._bound()
        hashes = check_keys(keys)
        if target_locations is None:
            targets = [self.host_pool.get_dummy_flat_data_page() for _ in hashes]
        else:
            if isinstance(target_locations, torch.Tensor) or not isinstance(target_locations, Sequence):
                raise TypeError(f"target_locations must be one tensor per key, got {type(target_locations).__name__}")
            if len(target_locations) != len(hashes):
                raise ValueError(f"batch_get got {len(hashes)} keys and {len(target_locations)} targets")
            targets = list(target_locations)
        flats = [_flat_bytes(t, pages.page_bytes) for t in targets]
        spans = [[Span(f.data_ptr(), pages.page_bytes, memoryview(f.numpy()).cast("B"))] for f in flats]
        results = self._get(hashes, self.namespace.keys(hashes), spans)
        return [t if r.ok else None for t, r in zip(targets, results)]

    def get_stats(self) -> StorageStats:
        """A copy of the counters, with the store's own figures under ``backend``."""
        with self._stats_lock:
            snapshot = StorageStats(**{f.name: getattr(self._stats, f.name) for f in fields(self._stats)})
        try:
            snapshot.backend = dict(self.backend_stats())
        except Exception as exc:  # noqa: BLE001 - stats must not fail because the store is down
            snapshot.backend = {"error": self.redact(f"{type(exc).__name__}: {exc}")}
        return snapshot

    # ---- the page machinery ----------------------------------------------------------------------

    def _pages_of(self, hashes: list[str], host_indices: torch.Tensor) -> list[int]:
        pages = self._bound()
        if not isinstance(host_indices, torch.Tensor):
            raise TypeError(f"host_indices must be a torch tensor of token slots, got {type(host_indices).__name__}")
        if host_indices.dtype not in (torch.int32, torch.int64) or host_indices.dim() != 1:
            raise TypeError(
                f"host_indices must be 1-D int32/int64, got {host_indices.dtype} {tuple(host_indices.shape)}"
            )
        p = pages.page_size
        if host_indices.numel() != len(hashes) * p:
            raise ValueError(
                f"{len(hashes)} keys need {len(hashes) * p} host slots (page_size {p}), got {host_indices.numel()}"
            )
        if not hashes:
            return []
        slots = host_indices.to("cpu", torch.int64).reshape(-1, p)
        starts = slots[:, 0]
        if bool((starts % p).any()) or not bool((slots - starts[:, None] == torch.arange(p)).all()):
            raise ValueError(f"host_indices must be whole pages: runs of {p} consecutive slots from a page start")
        page_ids = (starts // p).tolist()
        bad = [q for q in page_ids if not 0 <= q < pages.num_pages]
        if bad:
            raise IndexError(f"host slots of page {bad[0]} are outside the host pool ({pages.num_pages} pages)")
        if len(set(page_ids)) != len(page_ids):
            raise ValueError("host_indices name the same page twice")
        return page_ids

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        """Batches of at most STORAGE_BATCH_SIZE pages and io_chunk_bytes of payload (at least one page)."""
        if self._device_checked() and self.capabilities.zero_copy:
            # No payload is hashed or copied on the host: nothing to overlap or keep cache-hot, one call per batch.
            per = STORAGE_BATCH_SIZE
        else:
            per = max(1, min(STORAGE_BATCH_SIZE, self.io_chunk_bytes // max(1, self._bound().page_bytes)))
        return [(start, min(n, start + per)) for start in range(0, n, per)]

    def _key_digest(self, full_key: str) -> bytes:
        return hashlib.sha256(full_key.encode()).digest()

    def _pipelined(self, work: list, first: Any, second: Any, fetch_first: bool = False) -> list[PageResult]:
        """Run ``second(first(w))`` over ``work``, the store's stage on the I/O thread, overlapped with ours."""
        if len(work) <= 1:
            return [r for w in work for r in second(first(w))]
        io = self._stage_thread()
        results: list[PageResult] = []
        if fetch_first:  # first = the store's read (I/O thread), second = our checks (this thread)
            pending = io.submit(first, work[0])
            for i in range(len(work)):
                fetched = pending.result()
                if i + 1 < len(work):
                    pending = io.submit(first, work[i + 1])
                results += second(fetched)
        else:  # first = our checksums (this thread), second = the store's write (I/O thread)
            prepared = first(work[0])
            for i in range(len(work)):
                pending = io.submit(second, prepared)
                if i + 1 < len(work):
                    prepared = first(work[i + 1])
                results += pending.result()
        return results

    def _stage_thread(self) -> Any:
        """The thread that runs the store's half of a pipelined read or write (made on first use)."""
        with self._stats_lock:
            if getattr(self, "_io_pool", None) is None:
                from concurrent.futures import ThreadPoolExecutor

                self._io_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hicache-{self.scheme}-io")
            return self._io_pool

    def _stage_headers(self, full: list[str], payloads: list[list[Span]]) -> list[list[Span]]:
        size = self._bound().page_bytes
        values = []
        device_checked = self._device_checked()
        hashed = [_hashed_runs(spans, size, device_checked) for spans in payloads]
        digests = parallel_checksums(hashed)
        for key, spans, checksum, runs in zip(full, payloads, digests, hashed):
            words = (sum(s.nbytes for s in spans) - size) // 8  # the checksum row after the payload, if any
            algorithm = CHECKSUM_DEVICE if words and len(runs) == 1 and device_checked else CHECKSUM_XXH3_64
            header = bytearray(pack_header(payload_bytes=size, checksum=checksum, fingerprint=self._fingerprint,
                                           key_digest=self._key_digest(key), verify_words=words,
                                           algorithm=algorithm))  # fmt: skip
            values.append([Span(address_of(header), HEADER_SIZE, memoryview(header)), *spans])
        return values

    def _put(self, hashes: list[str], full: list[str], payloads: list[list[Span]]) -> list[PageResult]:
        return self._stage_put((hashes, full, self._stage_headers(full, payloads)))

    def _stage_put(self, prepared: tuple[list[str], list[str], list[list[Span]]]) -> list[PageResult]:
        hashes, full, values = prepared
        size = self._bound().page_bytes
        t0 = time.perf_counter()
        try:
            outcome = list(self.put_objects(full, values))
            if len(outcome) != len(full):
                raise StorageError(f"{type(self).__name__}.put_objects answered {len(outcome)} of {len(full)} keys")
        except Exception as exc:  # noqa: BLE001 - the whole batch failed: every page says why
            outcome = [exc] * len(full)
        elapsed = time.perf_counter() - t0
        results = []
        for h, err in zip(hashes, outcome):
            if err is None:
                results.append(PageResult(h, PageStatus.OK))
            elif isinstance(err, StorageFull):
                results.append(PageResult(h, PageStatus.FULL, self.redact(_describe(err))))
            else:
                results.append(PageResult(h, PageStatus.ERROR, self.redact(_describe(err))))
        with self._stats_lock:
            ok = sum(r.ok for r in results)
            self._stats.pages_written += ok
            self._stats.bytes_written += ok * (size + HEADER_SIZE)
            self._stats.write_seconds += elapsed
            self._stats.write_refused_full += sum(r.status is PageStatus.FULL for r in results)
            self._stats.write_failed += sum(r.status is PageStatus.ERROR for r in results)
        _record_l3("write", results, size + HEADER_SIZE)
        return results

    def _get(self, hashes: list[str], full: list[str], targets: list[list[Span]]) -> list[PageResult]:
        return self._stage_check(self._stage_fetch((hashes, full, targets)))

    def _stage_fetch(self, work: tuple[list[str], list[str], list[list[Span]]]) -> tuple:
        """The store's half of a read: the primitive call, and how long it took."""
        hashes, full, targets = work
        t0 = time.perf_counter()
        headers: list[bytearray] = []
        if self.capabilities.zero_copy:
            headers = [bytearray(HEADER_SIZE) for _ in full]
            spans = [[Span(address_of(h), HEADER_SIZE, memoryview(h)), *t] for h, t in zip(headers, targets)]
            try:
                outcome = list(self.get_objects_into(full, spans))
                if len(outcome) != len(full):
                    raise StorageError(f"{type(self).__name__}.get_objects_into answered {len(outcome)} of {len(full)}")
            except Exception as exc:  # noqa: BLE001 - the whole batch failed
                outcome = [exc] * len(full)
        else:
            try:
                outcome = list(self.get_objects(full))
                if len(outcome) != len(full):
                    raise StorageError(f"{type(self).__name__}.get_objects answered {len(outcome)} of {len(full)} keys")
            except Exception as exc:  # noqa: BLE001
                outcome = [exc] * len(full)
        return work, headers, outcome, time.perf_counter() - t0

    def _stage_check(self, fetched: tuple) -> list[PageResult]:
        """Our half of a read: check each page; without zero-copy, copy the checked ones into the pool."""
        (hashes, full, targets), headers, outcome, elapsed = fetched
        size = self._bound().page_bytes
        t0 = time.perf_counter()
        results = []
        if self.capabilities.zero_copy:
            arrived = [[(s.ptr, s.nbytes) for s in t] if e is None else [] for t, e in zip(targets, outcome)]
            # A device-checked page (algorithm 2) is hashed here only in its checksum row: its payload is
            # checked on the device after load, against that row.
            digests = parallel_checksums([
                r[-1:] if r and stored_algorithm(hd) == CHECKSUM_DEVICE else r for r, hd in zip(arrived, headers)
            ])  # fmt: skip
            for h, key, header, runs, err, digest in zip(hashes, full, headers, arrived, outcome, digests):
                if err is not None:
                    results.append(_failed_read(h, err, self.redact))
                    continue
                results.append(self._verify(h, key, header, runs, size, digest))
        else:
            for h, key, target, blob in zip(hashes, full, targets, outcome):
                if blob is None or isinstance(blob, BaseException):
                    results.append(_failed_read(h, ObjectMissing(key) if blob is None else blob, self.redact))
                    continue
                view = memoryview(blob).cast("B")
                total = sum(s.nbytes for s in target)  # the payload, and the checksum row of a verifying pool
                if len(view) != HEADER_SIZE + total:
                    detail = f"object is {len(view)} bytes, a page here is {HEADER_SIZE + total}"
                    results.append(PageResult(h, PageStatus.MISMATCH, detail))
                    continue
                base = address_of(view)
                runs = [(base + HEADER_SIZE, total)]
                digest = None
                if stored_algorithm(view[:HEADER_SIZE]) == CHECKSUM_DEVICE and total > size:
                    digest = checksum_runs([(base + HEADER_SIZE + size, total - size)])
                result = self._verify(h, key, view[:HEADER_SIZE], runs, size, digest)
                if result.ok:  # only a verified page reaches the pool
                    offset = base + HEADER_SIZE
                    for s in target:
                        ctypes.memmove(s.ptr, offset, s.nbytes)
                        offset += s.nbytes
                results.append(result)
        elapsed += time.perf_counter() - t0
        with self._stats_lock:
            ok = sum(r.ok for r in results)
            self._stats.pages_read += ok
            self._stats.bytes_read += ok * (size + HEADER_SIZE)
            self._stats.read_seconds += elapsed
            for r in results:
                if not r.ok:
                    counter = _READ_COUNTER.get(r.status, "read_failed")
                    setattr(self._stats, counter, getattr(self._stats, counter) + 1)
        _record_l3("read", results, size + HEADER_SIZE)
        return results

    def _device_checked(self) -> bool:
        """Whether pages are written device-checked (algorithm 2): the pool verifies, and no host check was asked."""
        import os

        return self._bound().verifier is not None and os.environ.get("HICACHE_L3_HOST_CHECK", "") in ("", "0")

    def _verify(self, h: str, key: str, header_bytes: Any, runs: list[tuple[int, int]], size: int,
                digest: int | None = None) -> PageResult:  # fmt: skip
        try:
            header = unpack_header(header_bytes)
        except VersionError as exc:
            return PageResult(h, PageStatus.MISMATCH, str(exc))
        except HeaderError as exc:
            return PageResult(h, PageStatus.CORRUPT, str(exc))
        if header.fingerprint != self._fingerprint:
            return PageResult(h, PageStatus.MISMATCH, "stored for another pool geometry (fingerprint differs)")
        if header.key_digest != self._key_digest(key):
            return PageResult(h, PageStatus.MISMATCH, "the object carries another key")
        if header.payload_bytes != size:
            return PageResult(h, PageStatus.MISMATCH, f"payload is {header.payload_bytes} bytes, a page here is {size}")
        words = (sum(n for _, n in runs) - size) // 8
        if header.verify_words != words:
            return PageResult(
                h,
                PageStatus.MISMATCH,
                f"stored with {header.verify_words} host-tier verification "
                f"words, a page here has {words} (written by a pool with verify set differently)",
            )
        if header.checksum_algorithm == CHECKSUM_DEVICE and digest is None:
            digest = checksum_runs(_row_of(runs, size))
        if (checksum_runs(runs) if digest is None else digest) != header.checksum:
            return PageResult(h, PageStatus.CORRUPT, "payload checksum mismatch")
        return PageResult(h, PageStatus.OK)

    def __repr__(self) -> str:
        bound = f" namespace={self.namespace.prefix}" if self.namespace else " (unbound)"
        return f"<{type(self).__name__} {self.url.redacted}{bound}>"


#: What a page hash may be: every backend can store it as a name (a file, a Redis key, a Mooncake key).
_PAGE_HASH = re.compile(r"[0-9A-Za-z_-]{1,200}")


def _record_l3(op: str, results: list[PageResult], object_bytes: int) -> None:
    """Pages by outcome, bytes moved, and checksum failures (hicache_core.metrics), once per batch."""
    by: dict[str, int] = {}
    for r in results:
        by[r.status.value] = by.get(r.status.value, 0) + 1
    for outcome, n in by.items():
        _metrics.L3_PAGES.labels(op=op, outcome=outcome).inc(n)
    if by.get("ok"):
        _metrics.L3_BYTES.labels(op=op).inc(by["ok"] * object_bytes)
    if by.get("corrupt"):
        _metrics.record_checksum_failure("l3", by["corrupt"])


def _hashed_runs(spans: list[Span], size: int, device_checked: bool) -> list[tuple[int, int]]:
    """What the store's checksum covers: payload and checksum row, or only the row of a device-checked page."""
    runs = [(s.ptr, s.nbytes) for s in spans]
    if device_checked and sum(n for _, n in runs) > size:
        return runs[-1:]  # the row is the last span (PageMap.object_spans)
    return runs


def _row_of(runs: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The bytes after the first ``size`` bytes of ``runs`` (the checksum row after the payload)."""
    out, skip = [], size
    for ptr, n in runs:
        if skip >= n:
            skip -= n
            continue
        out.append((ptr + skip, n - skip))
        skip = 0
    return out


_HASHERS: Any = None
_HASHERS_LOCK = threading.Lock()


def _hash_workers() -> int:
    """Threads that checksum a batch's pages at once (``HICACHE_L3_HASH_THREADS``; default the cores, at most 8)."""
    import os

    raw = os.environ.get("HICACHE_L3_HASH_THREADS", "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"HICACHE_L3_HASH_THREADS={raw!r} must be an integer >= 1")
        return int(raw)
    return max(1, min(8, os.cpu_count() or 1))


def parallel_checksums(pages: list[list[tuple[int, int]]]) -> list[int]:
    """The payload checksum of each page (its runs), pages spread over threads.

    XXH3 releases the GIL while it hashes, so the pages of a batch are checksummed on several
    cores at once instead of one: that second pass over the bytes was what held the tier below its
    store's own client. An empty run list gives 0 (nothing to check).
    """
    global _HASHERS
    if len(pages) < 2 or _hash_workers() == 1:
        return [checksum_runs(r) if r else 0 for r in pages]
    with _HASHERS_LOCK:
        if _HASHERS is None:
            from concurrent.futures import ThreadPoolExecutor

            _HASHERS = ThreadPoolExecutor(max_workers=_hash_workers(), thread_name_prefix="hicache-l3-hash")
    return list(_HASHERS.map(lambda r: checksum_runs(r) if r else 0, pages))


def _page_slots(pages: list[int], page_size: int) -> torch.Tensor:
    if not pages:
        return torch.empty(0, dtype=torch.int64)
    return (torch.tensor(pages, dtype=torch.int64)[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def check_keys(keys: Sequence[str]) -> list[str]:
    """Every key checked before any byte of the batch moves (one bad key never leaves half a batch written)."""
    if isinstance(keys, str) or not isinstance(keys, Sequence):
        raise TypeError(f"keys must be a list of page hashes (str), got {type(keys).__name__}")
    out = list(keys)
    for i, k in enumerate(out):
        if not isinstance(k, str) or not k:
            raise TypeError(f"every key must be a non-empty str (a page hash), got {k!r} at position {i}")
        if not _PAGE_HASH.fullmatch(k):
            raise ValueError(
                f"key {k[:80]!r} at position {i} is not a page hash (1-200 of A-Z a-z 0-9 _ -); nothing was moved"
            )
    if len(set(out)) != len(out):
        dup = next(k for i, k in enumerate(out) if k in out[:i])
        raise ValueError(f"key {dup[:80]!r} appears twice in one batch; nothing was moved")
    return out


def _flat_bytes(value: torch.Tensor | None, page_bytes: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"a flat page must be a torch tensor, got {type(value).__name__}")
    if value.device.type != "cpu" or not value.is_contiguous():
        raise ValueError("a flat page must be a contiguous CPU tensor")
    flat = value.reshape(-1)
    flat = flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
    if flat.numel() != page_bytes:
        raise ValueError(f"a flat page here is {page_bytes} bytes, got {flat.numel()}")
    return flat


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _failed_read(h: str, err: BaseException, redact: Any = str) -> PageResult:
    if isinstance(err, ObjectMissing):
        return PageResult(h, PageStatus.MISSING, "not in the store")
    if isinstance(err, (SizeMismatch, NotAPage)):
        return PageResult(h, PageStatus.MISMATCH, redact(str(err)))
    if isinstance(err, TimeoutError):
        return PageResult(h, PageStatus.TIMEOUT, redact(_describe(err)))
    return PageResult(h, PageStatus.ERROR, redact(_describe(err)))
