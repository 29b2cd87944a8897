"""The core's side of a storage backend: :class:`PageStore`, pages in and out of a store.

A :class:`~hicache_core.storage.StorageBackend` (a plugin) moves whole objects under full keys.
:func:`~hicache_core.storage.make_storage` wraps it in a :class:`PageStore` bound to a host pool,
and everything page-shaped lives here, once, for every backend: keys in the pool's namespace, the
self-describing header and checksums (``page_format.py``), batches of :data:`STORAGE_BATCH_SIZE`
pipelined against the store, validation of keys and host indices before any byte moves, per-page
results and the statistics, and SGLang's ``HiCacheStorage`` page API.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import logging
import re
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .. import metrics as _metrics
from ..settings.variables import L3_HOST_CHECK
from ..verification.page_checksum import NO_CHECKSUM
from .backend import StorageBackend
from .keys import Namespace, fingerprint, geometry_description
from .legacy import backend_member, page_api_problems
from .outcomes import NotAPage, ObjectMissing, PageResult, PageStatus, SizeMismatch, StorageError, StorageFull
from .page_auth import FROM_ENVIRONMENT, TAG_BYTES, ClusterKey, resolve_key, warn_unauthenticated
from .page_format import (
    CHECKSUM_DEVICE,
    CHECKSUM_KEYED,
    CHECKSUM_XXH3_64,
    HEADER_SIZE,
    KEY_ID_AT,
    MAC_HEADER_BYTES,
    HeaderError,
    VersionError,
    address_of,
    checksum_runs,
    checksum_threads,
    hashed_runs,
    pack_header,
    parallel_checksums,
    parallel_map,
    row_of,
    stored_algorithm,
    unpack_header,
)
from .pages import PageMap, Span
from .weights import WeightVersions

_log = logging.getLogger("hicache_core.storage")

#: The most pages one backend call moves (SGLang's ``STORAGE_BATCH_SIZE``).
STORAGE_BATCH_SIZE = 128


@dataclass
class StorageStats:
    """Counters of one page store; ``get_stats()`` returns a copy. Nothing fails uncounted."""

    exists_queries: int = 0
    exists_hits: int = 0
    pages_written: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0
    write_failed: int = 0
    write_refused_full: int = 0
    write_held_old_weights: int = 0  # pages not written: the host pool held pages of replaced weights
    pages_read: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    read_missing: int = 0
    read_corrupt: int = 0
    read_mismatch: int = 0
    read_auth_failed: int = 0
    read_failed: int = 0
    backend: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["write_gbps"] = self.bytes_written / self.write_seconds / 1e9 if self.write_seconds else 0.0
        out["read_gbps"] = self.bytes_read / self.read_seconds / 1e9 if self.read_seconds else 0.0
        return out


#: A read that found a page no reader may use: it is announced removed.
_REFUSED = (PageStatus.CORRUPT, PageStatus.MISMATCH, PageStatus.AUTH_FAILED)

_READ_COUNTER = {
    PageStatus.MISSING: "read_missing",
    PageStatus.CORRUPT: "read_corrupt",
    PageStatus.MISMATCH: "read_mismatch",
    PageStatus.AUTH_FAILED: "read_auth_failed",
}


class PageStore:
    """A storage backend bound to a host pool: SGLang's ``HiCacheStorage`` page API over the backend's primitives.

    :param backend: the plugin's :class:`StorageBackend`; :attr:`backend` keeps it, for what only
        that store has (its client, its paths). :meth:`close` closes it.
    :param host_pool: the host pool whose pages move; ``None`` makes an unbound store (statistics
        and administration only: :meth:`get_stats`, :meth:`clear`, :meth:`ping`, :meth:`close`).
    :param namespace: the keys' :class:`Namespace` (required with a host pool).
    :param cluster_key: the cluster's :class:`~hicache_core.storage.page_auth.ClusterKey`: every page
        is written with its MAC and read only when the MAC checks (``auth_failed`` otherwise);
        ``None``: unauthenticated pages, as without a key; the default reads ``HICACHE_L3_KEY_FILE`` or
        ``HICACHE_L3_KEY``.

    Binding sets the backend's ``namespace``, ``page_bytes``, ``trailer_bytes`` and ``cluster_key``
    and then calls its ``register_memory`` with the pool's buffers. ``HICACHE_L3_HOST_CHECK`` and
    ``HICACHE_L3_HASH_THREADS`` are read here, once.
    """

    def __init__(self, backend: StorageBackend, host_pool: Any = None, namespace: Namespace | None = None,
                 cluster_key: ClusterKey | None | str = FROM_ENVIRONMENT) -> None:  # fmt: skip
        if not callable(getattr(backend, "exists_objects", None)) or not hasattr(backend, "url"):
            raise TypeError(f"PageStore wraps a hicache_core.storage.StorageBackend, got {type(backend).__name__}")
        legacy = page_api_problems(type(backend), StorageBackend)  # registered classes were checked; by hand too
        if legacy:
            raise TypeError(f"{type(backend).__name__} is written for 0.2's page API: " + "; ".join(legacy))
        if host_pool is not None and namespace is None:
            raise ValueError("PageStore needs the namespace of its keys with a host pool (make_storage makes both)")
        key = resolve_key(cluster_key)
        own = self.__dict__
        #: The cluster's key (pages carry its MAC), or ``None``: unauthenticated pages.
        own["cluster_key"] = key
        own["backend"] = backend
        own["url"] = backend.url
        own["_backend_name"] = type(backend).__name__
        own["host_pool"] = host_pool
        own["namespace"] = namespace
        own["_pages"] = None
        own["weights"] = None
        own["_fingerprint"] = b""
        own["_stats"] = StorageStats()
        own["_stats_lock"] = threading.Lock()
        own["_io_pool"] = None
        own["_feed"] = None  # the KV events' feed (publish_events), or None
        own["_leases"] = None  # the store's LeaseBook (made on first use), or None
        own["_eviction"] = ""  # how the backend's evictions meet the leases (attach_leases)
        own["checksum_threads"] = checksum_threads()
        host_check = L3_HOST_CHECK.read()  # read before any byte moves, with or without a pool
        own["device_checked"] = False
        if host_pool is None:
            return
        pages = PageMap(host_pool)
        own["_pages"] = pages
        own["weights"] = WeightVersions(host_pool)
        # From the pool itself, not the namespace: a page is checked against the geometry it
        # would land in, even if a caller forced a namespace that does not describe this pool.
        own["_fingerprint"] = bytes.fromhex(fingerprint(geometry_description(host_pool)))
        #: Pages written device-checked (format algorithm 2): the pool verifies, and no host check was asked.
        #: A keyed store never is: a device checksum is no MAC, so the host authenticates every byte.
        own["device_checked"] = key is None and pages.table is not None and not host_check
        backend.namespace = namespace
        backend.page_bytes = pages.page_bytes
        backend.trailer_bytes = pages.trailer_bytes
        backend.cluster_key = key
        backend.register_memory(pages.buffer_spans())
        observer_of = getattr(backend, "observer_of", None)
        if observer_of is not None:  # a backend serving the pool's pages to others hears the pool's events
            own["_observer"] = observer_of(host_pool)
            host_pool.observe(own["_observer"])
        if key is None:  # once bound: a store that refused to bind (peer:// without a key) opened nothing
            warn_unauthenticated(backend)

    @property
    def pages(self) -> PageMap:
        """Where each page of the bound host pool lives in memory (its runs)."""
        if self._pages is None:
            raise self._unbound()
        return self._pages

    @property
    def authenticated(self) -> bool:
        """Whether pages are written and read with the cluster key's MAC."""
        return self.cluster_key is not None

    @property
    def page_bytes(self) -> int:
        """Payload bytes of one page of the bound host pool."""
        return self.pages.page_bytes

    # ---- weight versions (weights.py) ------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        """The weight version of this store's keys (``""``: unversioned)."""
        if self.namespace is None:
            raise self._unbound()
        return self.namespace.weight_version

    def set_weight_version(self, version: str) -> bool:
        """Serve the pages of the weights ``version`` names from now on; false when it is the current one.

        Every key moves to the new version's namespace, so no page of the old weights is read again
        (a miss, reason ``old_weight_version``). While the host pool still holds pages it held before
        (computed with the old weights), nothing is written (each page reports ``skipped``) until the
        pool is cleared. Call it on every rank, where the server's weights changed.
        """
        if not isinstance(version, str):
            raise TypeError(f"a weight version is a str, got {type(version).__name__}")
        if self.namespace is None:
            raise self._unbound()
        old = self.namespace
        if version == old.weight_version:
            return False
        new = old.with_weight_version(version)
        self.weights.switch(old, new)
        self.__dict__["namespace"] = new
        self.backend.namespace = new
        if self._feed is not None:  # no page of the old weights is read again
            self._feed.everything_gone("weight_version")
        if self._leases is not None:  # a lease on the old weights' pages would keep what is never read again
            self._leases.release_all()
        return True

    def rotate_cluster_key(self, key: ClusterKey) -> None:
        """Write and read with ``key`` from now on, in place of the store's current cluster key.

        Pages written under the old key no longer authenticate (``auth_failed``, ``other_key``) and are
        announced removed (KV events); they are rewritten under the new key as the server backs them up
        again. Only a keyed store rotates: turning authentication on or off is a restart with the setting.
        """
        if not isinstance(key, ClusterKey):
            raise TypeError(f"rotate_cluster_key takes a ClusterKey, got {type(key).__name__}")
        if self.cluster_key is None:
            raise ValueError("this store has no cluster key to rotate: set HICACHE_L3_KEY_FILE and restart")
        self.__dict__["cluster_key"] = key
        self.backend.cluster_key = key
        if self._feed is not None:
            self._feed.key_changed()

    # ---- retention (hicache_core.retention) ----------------------------------------------------------

    @property
    def leases(self) -> Any:
        """This store's :class:`~hicache_core.retention.LeaseBook` (keyed by full keys), made on first use."""
        with self._stats_lock:
            if self._leases is None:
                from ..retention import LeaseBook

                book = LeaseBook(f"L3 {self.url.redacted}")
                self.__dict__["_eviction"] = self.backend.attach_leases(book)
                self.__dict__["_leases"] = book
                if self._eviction == "touched":
                    from ..retention.keeper import LeaseKeeper

                    self.__dict__["_keeper"] = LeaseKeeper(book, self.backend)
            return self._leases

    @property
    def eviction(self) -> str:
        """How the store's evictions meet leases: ``"ordered"``, ``"never"`` or ``"own"`` (``attach_leases``)."""
        _ = self.leases
        return self._eviction

    def retain(self, keys: Sequence[str], retain: Any, *, supersede: bool = False) -> Any:
        """Lease the pages ``keys`` (page hashes, in chain order) as ``retain`` asks; returns the
        :class:`~hicache_core.retention.Grant`.

        The lease holds on this store's pages under the current weight version; a hit on its last page
        refreshes it. ``supersede``: the session's earlier leases go first. On a store whose own policy
        evicts (``eviction == "own"``: Redis, Mooncake, S3 lifecycle rules) the lease is recorded and
        reported, but cannot order the store's evictions: the grant says so, and a warning says it once.
        """
        from ..retention import Retain

        if not isinstance(retain, Retain):
            raise TypeError(f"retain takes a hicache_core.retention.Retain, got {type(retain).__name__}")
        hashes = check_keys(keys)
        if self.namespace is None:
            raise self._unbound()
        grant = self.leases.retain(self.namespace.keys(hashes), retain, supersede=supersede)
        if self._eviction == "own" and not self.__dict__.get("_warned_own"):
            self.__dict__["_warned_own"] = True
            _log.warning("%s evicts by its own policy: hicache's leases are kept and reported but cannot order "
                         "its evictions (docs/retention.md)", self.url.redacted)  # fmt: skip
        return dataclasses.replace(grant, eviction=self._eviction)

    def supersede(self, session: str, keep: Sequence[str] = ()) -> int:
        """``session``'s leases on this store are superseded (its pages go first), but for the pages ``keep``."""
        if self.namespace is None:
            raise self._unbound()
        return self.leases.supersede(session, self.namespace.keys(check_keys(keep)) if keep else ())

    def release(self, *, session: str | None = None, lease_id: int | None = None) -> int:
        """End a lease of this store, or every lease of ``session``, now; returns how many ended."""
        return self.leases.release(session=session, lease_id=lease_id)

    def prefetch(self, keys: Sequence[str]) -> int:
        """A session resumes soon: bring its stored pages up a tier ahead of the request, where the store
        can (``file://``: into the page cache); returns how many pages it started to bring up (0 where the
        store has no faster tier of its own, as ``prefetch_objects`` says)."""
        hashes = check_keys(keys)
        if self.namespace is None:
            raise self._unbound()
        return self.backend.prefetch_objects(self.namespace.keys(hashes))

    def why_dropped(self, key: str) -> str | None:
        """Why page ``key`` left this store under a lease, if it did lately (``explain-miss`` says it)."""
        (h,) = check_keys([key])
        if self._leases is None or self.namespace is None:
            return None
        return self._leases.why_dropped(self.namespace.key(h))

    # ---- KV events (hicache_core.events) ---------------------------------------------------------

    def publish_events(self, publisher: Any, *, store_id: str | None = None, block_hash: Any = None,
                       audit_interval: float | None = 2.0, chained: bool = False) -> Any:  # fmt: skip
        """Tell ``publisher`` (a :class:`~hicache_core.events.KVEventPublisher`) what this store holds.

        From now on every page written and acknowledged, or read back whole and checked, is announced
        (``BlockStored``), and every page found gone or unreadable is removed (``BlockRemoved``); an
        audit thread finds what the store dropped unseen. ``store_id`` names the store where the default
        (:func:`~hicache_core.events.tiers.tier_of`) would differ between instances; ``block_hash`` maps a
        page hash to the server's event hash (the format's by default); ``chained``: each write's pages
        come in chain order. Returns the :class:`~hicache_core.events.StoreFeed`.
        """
        from ..events import StoreFeed, tier_of

        if self._pages is None:
            raise self._unbound()
        if self._feed is not None:
            raise RuntimeError("this store already publishes KV events")
        feed = StoreFeed(self, publisher, tier=tier_of(self.backend, store_id), block_size=self.host_pool.page_size,
                         block_hash=block_hash, audit_interval=audit_interval, chained=chained)  # fmt: skip
        self.__dict__["_feed"] = feed
        self.backend.removal_listener = feed.removed_keys
        return feed

    def old_weight_version_of(self, key: str) -> str | None:
        """The earlier weight version (of the last few this store served) under which page ``key`` is stored."""
        (h,) = check_keys([key])
        if self.weights is None:
            raise self._unbound()
        for ns in reversed(self.weights.previous):
            if self.backend.exists_objects([ns.key(h)])[0]:
                return ns.weight_version
        return None

    def _held(self, hashes: list[str]) -> list[PageResult] | None:
        """Every page ``skipped`` while the host pool holds pages of old weights; ``None`` when writes go on."""
        hold = self.weights.hold if self.weights is not None else ""
        if not hold:
            return None
        _metrics.L3_PAGES.labels(op="write", outcome=PageStatus.SKIPPED.value).inc(len(hashes))
        with self._stats_lock:
            self._stats.write_held_old_weights += len(hashes)
        return [PageResult(h, PageStatus.SKIPPED, hold) for h in hashes]

    def _unbound(self) -> RuntimeError:
        return RuntimeError(
            f"this {type(self.backend).__name__} store is not bound to a host pool: make it with "
            "make_storage(url, host_pool, ...)"
        )

    # ---- SGLang's HiCacheStorage contract --------------------------------------------------------

    def batch_exists(self, keys: Sequence[str], extra_info: Any = None) -> int:
        """How many leading page hashes of ``keys`` are stored (a prefix length, as SGLang's)."""
        hashes = check_keys(keys)
        if self.namespace is None:
            raise self._unbound()
        full = self.namespace.keys(hashes)
        hits = 0
        for start in range(0, len(full), STORAGE_BATCH_SIZE):
            chunk = full[start : start + STORAGE_BATCH_SIZE]
            found = self.backend.exists_objects(chunk)
            if len(found) != len(chunk):
                raise StorageError(f"{self._backend_name}.exists_objects answered {len(found)} of {len(chunk)} keys")
            n = next((i for i, f in enumerate(found) if not f), len(found))
            hits += n
            if n < len(chunk):
                if self._feed is not None and self.backend.capabilities.reads_own_writes:
                    self._feed.gone([hashes[start + n]], "missing")
                break
        with self._stats_lock:
            self._stats.exists_queries += 1
            self._stats.exists_hits += hits
        return hits

    def exists(self, key: str) -> bool:
        """Whether the page ``key`` is stored."""
        return self.batch_exists([key]) == 1

    def batch_set_from(self, keys: Sequence[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` (token slots, whole pages) under ``keys``.

        Where SGLang passes ``extra_info.prefix_keys`` (the hashes before ``keys`` in their chain), the last
        of them is the first page's parent in the KV events.
        """
        prefix = getattr(extra_info, "prefix_keys", None)
        return [r.ok for r in self.write_pages(keys, host_indices, parent=prefix[-1] if prefix else None)]

    def batch_get_into(self, keys: Sequence[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Load the pages ``keys`` into the host pool at ``host_indices``; one bool per page."""
        return [r.ok for r in self.read_pages(keys, host_indices)]

    def write_pages(self, keys: Sequence[str], host_indices: torch.Tensor, *, parent: str | None = None
                    ) -> list[PageResult]:  # fmt: skip
        """Store pages; one :class:`PageResult` per key. Checks every argument before a byte moves.

        ``parent``: the page hash before ``keys[0]`` where the keys are a chain (the KV events name it).
        """
        hashes = check_keys(keys)
        if parent is not None:
            (parent,) = check_keys([parent])
        pages = self.page_ids(hashes, host_indices)
        return self._write(hashes, pages, [parent, *hashes[:-1]])

    def _write(self, hashes: list[str], pages: list[int], parents: list[str | None]) -> list[PageResult]:
        # The namespace before the hold: a weight-version change sets the hold first, so these pages go
        # under the keys of the weights they were computed with, or are held.
        ns = self.namespace
        held = self._held(hashes)
        if held is not None:
            return held
        pm = self.pages
        refused: dict[int, PageResult] = {}
        if pm.table is not None:  # a page that failed host-tier verification never reaches the store
            quarantined = pm.verification.quarantined()
            for i, page in enumerate(pages):
                if page in quarantined:
                    refused[i] = PageResult(
                        hashes[i],
                        PageStatus.CORRUPT,
                        f"host page {page} failed host-tier "
                        "verification (quarantined until its slots are freed): not written",
                    )
            if refused:
                keep = [i for i in range(len(pages)) if i not in refused]
                written = iter(self._write([hashes[i] for i in keep], [pages[i] for i in keep],
                                           [parents[i] for i in keep]))  # fmt: skip
                return [refused[i] if i in refused else next(written) for i in range(len(pages))]
        work = [(hashes[a:b], ns.keys(hashes[a:b]), [pm.object_spans(p) for p in pages[a:b]], parents[a:b])
                for a, b in self._chunks(len(hashes))]  # fmt: skip
        # Two stages in flight: the next chunk's checksums are taken while the store writes this one.
        return self._pipelined(work, lambda w: (w[0], w[1], self._stage_headers(w[1], w[2]), w[3]), self._stage_put)

    def read_pages(self, keys: Sequence[str], host_indices: torch.Tensor, *,
                   on_landed: Callable[[list[PageResult], int], None] | None = None) -> list[PageResult]:  # fmt: skip
        """Load pages; one :class:`PageResult` per key. A page that is not ``ok`` is never reported loaded.

        Without zero-copy the pool's page is written only after its checksum passed. With
        zero-copy the bytes land in the page first and are checked there, so the slots of a
        page that failed hold unspecified bytes: they were reserved for it, nothing else is touched.

        ``on_landed(results, offset)``, where given, is called on the caller's thread once per chunk of
        the read (at most ``STORAGE_BATCH_SIZE`` pages and the backend's ``io_chunk_bytes``), in key
        order, as soon as that chunk's pages were read *and checked*: ``results`` are the chunk's
        :class:`PageResult` (a copy of what the return value holds for it), ``offset`` the position of its
        first key in ``keys``. An ``ok`` page is then in the host pool, whole and checked, and a caller may
        start moving it (to the device, say) while the store reads the next chunk; a page that is not
        ``ok`` must not be used. (On a device-checked pool, format algorithm 2, ``ok`` means what it means
        for the return value: the payload is checked by the load to the device.) No call for no keys.
        When ``on_landed`` raises, the read stops: the chunk then in flight is waited for (no byte of the
        read lands in the pool after this returns or raises), left unchecked and never reported, and the
        exception propagates. Without ``on_landed`` the read is the same, call for call.
        """
        hashes = check_keys(keys)
        pages = self.page_ids(hashes, host_indices)
        pm = self.pages
        work = [(hashes[a:b], self.namespace.keys(hashes[a:b]), [pm.object_spans(p) for p in pages[a:b]])
                for a, b in self._chunks(len(hashes))]  # fmt: skip
        # Two stages in flight: the store reads the next chunk while this one's checksums are checked.
        results = self._pipelined(work, self._stage_fetch, self._stage_check, fetch_first=True, landed=on_landed)
        book = self._leases
        if book is not None and self._eviction != "ordered" and len(book):  # an ordered store refreshes on its own
            book.refresh(self.namespace.keys([r.key for r in results if r.ok]))
        return results

    def set(self, key: str, value: torch.Tensor | None = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:  # fmt: skip
        """Store one flat page (as ``host_pool.get_data_page(i, flat=True)`` returns it)."""
        pages = self.pages
        flat = _flat_bytes(value, pages.page_bytes)
        (h,) = check_keys([key])
        full = self.namespace.key(h)  # before the hold (see write_pages)
        if self._held([h]) is not None:
            return False
        ptr = flat.data_ptr()
        span = Span(ptr, pages.page_bytes, memoryview(flat.numpy()).cast("B"))
        return self._put([h], [full], [[span]])[0].ok

    def get(
        self, key: str, target_location: torch.Tensor | None = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        """Load one flat page into ``target_location`` (default: a new dummy flat page); ``None`` on any miss."""
        pages = self.pages
        (h,) = check_keys([key])
        target = target_location if target_location is not None else self.host_pool.get_dummy_flat_data_page()
        flat = _flat_bytes(target, pages.page_bytes)
        span = Span(flat.data_ptr(), pages.page_bytes, memoryview(flat.numpy()).cast("B"))
        result, _ = self._get_flat(h, span)
        return target if result.ok else None

    def _get_flat(self, h: str, span: Span) -> tuple[PageResult, bytearray | None]:
        """Read page ``h`` into one flat span of its payload, checked as any read is; and its checksum row
        where it has one (a verifying pool's page)."""
        full = self.namespace.key(h)
        trailer = self.pages.trailer_bytes
        if not trailer:
            return self._get([h], [full], [[span]])[0], None
        # A verifying pool's pages carry their checksum row; a flat page has no place for it (the caller's
        # set_from_flat_data_page takes the checksums from the bytes): read it into scratch. A page stored
        # by set() has none: read again without.
        scratch = bytearray(trailer)
        result = self._get([h], [full], [[span, Span(address_of(scratch), trailer, memoryview(scratch))]])[0]
        if result.status is PageStatus.MISMATCH:
            return self._get([h], [full], [[span]])[0], None
        return result, scratch

    def batch_set(self, keys: Sequence[str], values: Sequence[torch.Tensor] | None = None, **_: Any) -> bool:
        """Store flat pages (SGLang's generic path); true when every page was stored.

        Every key and every value is checked before the first page is written.
        """
        pages = self.pages
        hashes = check_keys(keys)
        if values is None or isinstance(values, torch.Tensor) or not isinstance(values, Sequence):
            raise TypeError(f"batch_set needs one flat page tensor per key, got {type(values).__name__}")
        if len(values) != len(hashes):
            raise ValueError(f"batch_set got {len(hashes)} keys and {len(values)} values")
        flats = [_flat_bytes(v, pages.page_bytes) for v in values]
        spans = [[Span(f.data_ptr(), pages.page_bytes, memoryview(f.numpy()).cast("B"))] for f in flats]
        full = self.namespace.keys(hashes)  # before the hold (see write_pages)
        if self._held(hashes) is not None:
            return False
        return all(r.ok for r in self._put(hashes, full, spans))

    def batch_get(self, keys: Sequence[str], target_locations: Sequence[torch.Tensor] | None = None,
                  **_: Any) -> list[torch.Tensor | None]:  # fmt: skip
        """Load flat pages (SGLang's generic path); every key and target is checked before the first read."""
        pages = self.pages
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
            snapshot.backend = dict(self.backend.backend_stats())
        except Exception as exc:  # noqa: BLE001 - stats must not fail because the store is down
            snapshot.backend = {"error": self.backend.redact(f"{type(exc).__name__}: {exc}")}
        return snapshot

    # ---- the page machinery ----------------------------------------------------------------------

    def page_ids(self, hashes: Sequence[str], host_indices: torch.Tensor) -> list[int]:
        """The host pages at ``host_indices`` (token slots, whole pages, one page per hash), checked.

        Raises before anything moves: a tensor that is not 1-D int32/int64, a length that is not
        ``len(hashes)`` pages, slots that are not whole pages, a page outside the pool, a page twice.
        """
        pages = self.pages
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
        ids = (starts // p).tolist()
        bad = [q for q in ids if not 0 <= q < pages.num_pages]
        if bad:
            raise IndexError(f"host slots of page {bad[0]} are outside the host pool ({pages.num_pages} pages)")
        if len(set(ids)) != len(ids):
            raise ValueError("host_indices name the same page twice")
        return ids

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        """Batches of at most STORAGE_BATCH_SIZE pages and io_chunk_bytes of payload (at least one page)."""
        if self.device_checked and self.backend.capabilities.zero_copy:
            # No payload is hashed or copied on the host: nothing to overlap or keep cache-hot, one call per batch.
            per = STORAGE_BATCH_SIZE
        else:
            per = max(1, min(STORAGE_BATCH_SIZE, self.backend.io_chunk_bytes // max(1, self.pages.page_bytes)))
        return [(start, min(n, start + per)) for start in range(0, n, per)]

    def _key_digest(self, full_key: str) -> bytes:
        return hashlib.sha256(full_key.encode()).digest()

    def _pipelined(self, work: list, first: Any, second: Any, fetch_first: bool = False,
                   landed: Callable[[list[PageResult], int], None] | None = None) -> list[PageResult]:  # fmt: skip
        """Run ``second(first(w))`` over ``work``, the store's stage on the I/O thread, overlapped with ours.

        ``landed`` (reads only): called with each chunk's checked results and their offset (read_pages).
        """
        if len(work) <= 1:
            results = [r for w in work for r in second(first(w))]
            if landed is not None and work:
                landed(list(results), 0)
            return results
        io = self._stage_thread()
        results: list[PageResult] = []
        if fetch_first:  # first = the store's read (I/O thread), second = our checks (this thread)
            pending = io.submit(first, work[0])
            for i in range(len(work)):
                fetched = pending.result()
                if i + 1 < len(work):
                    pending = io.submit(first, work[i + 1])
                checked = second(fetched)
                if landed is not None:
                    try:
                        landed(list(checked), len(results))
                    except BaseException:
                        if i + 1 < len(work):  # the next chunk is landing in the pool: let it finish, unchecked
                            wait_futures([pending])
                        raise
                results += checked
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
            if self._io_pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._io_pool = ThreadPoolExecutor(max_workers=1,
                                                   thread_name_prefix=f"hicache-{self.backend.scheme}-io")  # fmt: skip
            return self._io_pool

    def _stage_headers(self, full: list[str], payloads: list[list[Span]]) -> list[list[Span]]:
        if self.cluster_key is not None:
            return self._keyed_headers(full, payloads)
        size = self.pages.page_bytes
        values = []
        device_checked = self.device_checked
        hashed = [hashed_runs([(s.ptr, s.nbytes) for s in spans], size, device_checked) for spans in payloads]
        digests = parallel_checksums(hashed, self.checksum_threads)
        for key, spans, checksum, runs in zip(full, payloads, digests, hashed):
            words = (sum(s.nbytes for s in spans) - size) // 8  # the checksum row after the payload, if any
            algorithm = CHECKSUM_DEVICE if words and len(runs) == 1 and device_checked else CHECKSUM_XXH3_64
            header = bytearray(pack_header(payload_bytes=size, checksum=checksum, fingerprint=self._fingerprint,
                                           key_digest=self._key_digest(key), verify_words=words,
                                           algorithm=algorithm))  # fmt: skip
            values.append([Span(address_of(header), HEADER_SIZE, memoryview(header)), *spans])
        return values

    def _keyed_headers(self, full: list[str], payloads: list[list[Span]]) -> list[list[Span]]:
        """Algorithm 3 headers: the key id where the checksum was, the tag where the key digest was."""
        size, key = self.pages.page_bytes, self.cluster_key
        key_id = int.from_bytes(key.key_id, "little")
        by_words: dict[int, bytes] = {}  # the bytes before the tag are the batch's, but for the checksum row's length
        prefixes = []
        for spans in payloads:
            words = (sum(s.nbytes for s in spans) - size) // 8
            if words not in by_words:
                by_words[words] = pack_header(payload_bytes=size, checksum=key_id, fingerprint=self._fingerprint,
                                              key_digest=bytes(TAG_BYTES), verify_words=words,
                                              algorithm=CHECKSUM_KEYED)[:MAC_HEADER_BYTES]  # fmt: skip
            prefixes.append(by_words[words])
        tags = parallel_map(lambda i: key.tag(prefixes[i], full[i], [(s.ptr, s.nbytes) for s in payloads[i]]),
                            range(len(full)), self.checksum_threads)  # fmt: skip
        values = []
        for prefix, tag, spans in zip(prefixes, tags, payloads):
            body = prefix + tag
            header = bytearray(body + zlib.crc32(body).to_bytes(4, "little"))
            values.append([Span(address_of(header), HEADER_SIZE, memoryview(header)), *spans])
        return values

    def _tags(self, headers: list[Any], full: list[str], runs: list[list[tuple[int, int]]]) -> list[bytes | None]:
        """The tag of each arrived page that says it is keyed with this store's key (``None`` for the rest)."""
        key = self.cluster_key
        mine = [i for i, (hd, r) in enumerate(zip(headers, runs)) if r and len(hd) >= HEADER_SIZE
                and stored_algorithm(hd) == CHECKSUM_KEYED and bytes(hd[KEY_ID_AT]) == key.key_id]  # fmt: skip
        tags: list[bytes | None] = [None] * len(full)
        computed = parallel_map(lambda i: key.tag(bytes(headers[i][:MAC_HEADER_BYTES]), full[i], runs[i]), mine,
                                self.checksum_threads)  # fmt: skip
        for i, tag in zip(mine, computed):
            tags[i] = tag
        return tags

    def _blob_tags(self, full: list[str], targets: list[list[Span]], blobs: list[Any]) -> list[bytes | None]:
        """:meth:`_tags` of whole objects as ``get_objects`` returned them (``None``: failed, or of another size)."""
        views, runs = [], []
        for blob, target in zip(blobs, targets):
            total = sum(s.nbytes for s in target)
            view = None if blob is None or isinstance(blob, BaseException) else memoryview(blob).cast("B")
            if view is None or len(view) != HEADER_SIZE + total:
                views.append(b"")
                runs.append([])
                continue
            views.append(view[:HEADER_SIZE])
            runs.append([(address_of(view) + HEADER_SIZE, total)])
        return self._tags(views, full, runs)

    def _put(self, hashes: list[str], full: list[str], payloads: list[list[Span]]) -> list[PageResult]:
        return self._stage_put((hashes, full, self._stage_headers(full, payloads)))

    def _stage_put(self, prepared: tuple) -> list[PageResult]:
        hashes, full, values, *chain = prepared  # then, from write_pages, each page's parent in its chain
        size = self.pages.page_bytes
        feed = self._feed
        since = feed.put_started() if feed is not None else 0
        t0 = time.perf_counter()
        try:
            outcome = list(self.backend.put_objects(full, values))
            if len(outcome) != len(full):
                raise StorageError(f"{self._backend_name}.put_objects answered {len(outcome)} of {len(full)} keys")
        except Exception as exc:  # noqa: BLE001 - the whole batch failed: every page says why
            outcome = [exc] * len(full)
        elapsed = time.perf_counter() - t0
        results = []
        for h, err in zip(hashes, outcome):
            if err is None:
                results.append(PageResult(h, PageStatus.OK))
            elif isinstance(err, StorageFull):
                results.append(PageResult(h, PageStatus.FULL, self.backend.redact(_describe(err))))
            else:
                results.append(PageResult(h, PageStatus.ERROR, self.backend.redact(_describe(err))))
        with self._stats_lock:
            ok = sum(r.ok for r in results)
            self._stats.pages_written += ok
            self._stats.bytes_written += ok * (size + HEADER_SIZE)
            self._stats.write_seconds += elapsed
            self._stats.write_refused_full += sum(r.status is PageStatus.FULL for r in results)
            self._stats.write_failed += sum(r.status is PageStatus.ERROR for r in results)
        _record_l3("write", results, size + HEADER_SIZE)
        if feed is not None:  # acknowledged by the store: there now, under this namespace and key
            parents = chain[0] if chain else [None] * len(results)
            feed.stored([r.key for r in results if r.ok], [p for r, p in zip(results, parents) if r.ok], since)
        return results

    def _get(self, hashes: list[str], full: list[str], targets: list[list[Span]]) -> list[PageResult]:
        return self._stage_check(self._stage_fetch((hashes, full, targets)))

    def _stage_fetch(self, work: tuple[list[str], list[str], list[list[Span]]]) -> tuple:
        """The store's half of a read: the primitive call, and how long it took."""
        hashes, full, targets = work
        t0 = time.perf_counter()
        headers: list[bytearray] = []
        if self.backend.capabilities.zero_copy:
            headers = [bytearray(HEADER_SIZE) for _ in full]
            spans = [[Span(address_of(h), HEADER_SIZE, memoryview(h)), *t] for h, t in zip(headers, targets)]
            try:
                outcome = list(self.backend.get_objects_into(full, spans))
                if len(outcome) != len(full):
                    raise StorageError(f"{self._backend_name}.get_objects_into answered {len(outcome)} of {len(full)}")
            except Exception as exc:  # noqa: BLE001 - the whole batch failed
                outcome = [exc] * len(full)
        else:
            try:
                outcome = list(self.backend.get_objects(full))
                if len(outcome) != len(full):
                    raise StorageError(f"{self._backend_name}.get_objects answered {len(outcome)} of {len(full)} keys")
            except Exception as exc:  # noqa: BLE001
                outcome = [exc] * len(full)
        return work, headers, outcome, time.perf_counter() - t0

    def _stage_check(self, fetched: tuple) -> list[PageResult]:
        """Our half of a read: check each page; without zero-copy, copy the checked ones into the pool."""
        (hashes, full, targets), headers, outcome, elapsed = fetched
        size = self.pages.page_bytes
        t0 = time.perf_counter()
        results = []
        if self.backend.capabilities.zero_copy:
            arrived = [[(s.ptr, s.nbytes) for s in t] if e is None else [] for t, e in zip(targets, outcome)]
            if self.cluster_key is not None:
                digests: list[Any] = self._tags(headers, full, arrived)
            else:
                # A device-checked page (algorithm 2) is hashed here only in its checksum row: its payload is
                # checked on the device after load, against that row.
                digests = parallel_checksums([
                    r[-1:] if r and stored_algorithm(hd) == CHECKSUM_DEVICE else r for r, hd in zip(arrived, headers)
                ], self.checksum_threads)  # fmt: skip
            for h, key, header, runs, err, digest in zip(hashes, full, headers, arrived, outcome, digests):
                if err is not None:
                    results.append(_failed_read(h, err, self.backend.redact))
                    continue
                results.append(self._check_object(h, key, header, runs, size, digest))
        else:
            tags = self._blob_tags(full, targets, outcome) if self.cluster_key is not None else [None] * len(full)
            for h, key, target, blob, tag in zip(hashes, full, targets, outcome, tags):
                if blob is None or isinstance(blob, BaseException):
                    results.append(_failed_read(h, ObjectMissing(key) if blob is None else blob, self.backend.redact))
                    continue
                view = memoryview(blob).cast("B")
                total = sum(s.nbytes for s in target)  # the payload, and the checksum row of a verifying pool
                if len(view) != HEADER_SIZE + total:
                    detail = f"object is {len(view)} bytes, a page here is {HEADER_SIZE + total}"
                    results.append(PageResult(h, PageStatus.MISMATCH, detail))
                    continue
                base = address_of(view)
                runs = [(base + HEADER_SIZE, total)]
                digest = tag
                if stored_algorithm(view[:HEADER_SIZE]) == CHECKSUM_DEVICE and total > size:
                    digest = checksum_runs([(base + HEADER_SIZE + size, total - size)])
                result = self._check_object(h, key, view[:HEADER_SIZE], runs, size, digest)
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
        if self._feed is not None:
            self._tell_feed(results)
        return results

    def _tell_feed(self, results: list[PageResult]) -> None:
        # A page read whole and checked is there for any reader. A device-checked page's payload is checked
        # only by the load to the device, so its read announces nothing: only its writer's acknowledgement does.
        # A tier that serves other instances only (peer://) reads from others, never from what it announced.
        if not self.backend.capabilities.reads_own_writes:
            return
        ok = [r.key for r in results if r.ok]
        if ok and not self.device_checked:
            self._feed.seen(ok)
        if len(ok) < len(results):  # the usual read is all hits: no further pass
            self._feed.gone([r.key for r in results if r.status is PageStatus.MISSING], "missing")
            self._feed.gone([r.key for r in results if r.status in _REFUSED], "refused")

    def _check_object(self, h: str, key: str, header_bytes: Any, runs: list[tuple[int, int]], size: int,
                digest: int | bytes | None = None) -> PageResult:  # fmt: skip
        try:
            header = unpack_header(header_bytes)
        except VersionError as exc:
            return PageResult(h, PageStatus.MISMATCH, str(exc))
        except HeaderError as exc:
            return PageResult(h, PageStatus.CORRUPT, str(exc))
        mine = self.cluster_key
        if mine is not None and not header.keyed:
            return _auth_failed(h, "unkeyed", "written without the cluster key (by a writer outside the cluster, "
                                "or by an instance without HICACHE_L3_KEY_FILE)")  # fmt: skip
        if mine is None and header.keyed:
            return _auth_failed(h, "no_key_here", f"written with cluster key id {header.key_id.hex()}; this "
                                "instance has no key (HICACHE_L3_KEY_FILE) to authenticate it")  # fmt: skip
        if mine is not None and header.key_id != mine.key_id:
            return _auth_failed(h, "other_key", f"written with another cluster key (id {header.key_id.hex()}, "
                                f"this instance's is {mine.key_id.hex()})")  # fmt: skip
        if header.fingerprint != self._fingerprint:
            return PageResult(h, PageStatus.MISMATCH, "stored for another pool geometry (fingerprint differs)")
        if not header.keyed and header.key_digest != self._key_digest(key):
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
        if header.keyed:
            tag = digest if isinstance(digest, bytes) else mine.tag(bytes(header_bytes[:MAC_HEADER_BYTES]), key, runs)
            if not mine.verify(tag, header.key_digest):
                return _auth_failed(h, "bad_tag", "MAC mismatch: the bytes were changed after they were written, "
                                    "or the page was stored under another key")  # fmt: skip
            return PageResult(h, PageStatus.OK)
        if header.checksum_algorithm == CHECKSUM_DEVICE and digest is None:
            digest = checksum_runs(row_of(runs, size))
        if (checksum_runs(runs) if digest is None else digest) != header.checksum:
            return PageResult(h, PageStatus.CORRUPT, "payload checksum mismatch")
        return PageResult(h, PageStatus.OK)

    def check_page(self, key: str) -> PageResult:
        """Read the page ``key`` into a scratch flat page and check it, as a prefetch would; the pool is untouched."""
        (h,) = check_keys([key])
        pages = self.pages
        flat = self.host_pool.get_dummy_flat_data_page().reshape(-1)
        flat = flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
        span = Span(flat.data_ptr(), pages.page_bytes, memoryview(flat.numpy()).cast("B"))
        result, row = self._get_flat(h, span)
        if result.ok and row is not None:
            # A device-checked page's payload is checked only by the load to the device (format algorithm 2):
            # the row that load would check is taken here, so a tool tells such a page before any load does.
            stored = torch.frombuffer(row, dtype=torch.int64).view_as(pages.table[0])
            taken = pages.checksum_row_of(flat)
            if bool(((stored != taken) & (stored != NO_CHECKSUM)).any()):
                return PageResult(h, PageStatus.CORRUPT, "payload does not match its checksum row (the device's "
                                  "check at load would fail)")  # fmt: skip
        return result

    def clear(self) -> None:
        """Delete every object the backend can see under its URL."""
        self.backend.clear()
        if self._feed is not None:
            self._feed.everything_gone("cleared")

    def ping(self) -> None:
        """Raise :class:`StorageError` when the store cannot be reached (the backend's message)."""
        self.backend.ping()

    def close(self) -> None:
        """Stop the I/O thread, then close the backend; the store is unusable after."""
        with self._stats_lock:
            io, self.__dict__["_io_pool"] = self._io_pool, None
        if io is not None:
            io.shutdown(wait=True)
        if self.weights is not None:
            self.weights.close()
        keeper = self.__dict__.pop("_keeper", None)
        if keeper is not None:
            keeper.close()
        feed, self.__dict__["_feed"] = self._feed, None
        if feed is not None:
            feed.close()
            self.backend.removal_listener = None
        observer = self.__dict__.pop("_observer", None)
        if observer is not None and observer in self.host_pool.observers:
            self.host_pool.unobserve(observer)
        self.backend.close()

    def __repr__(self) -> str:
        bound = f" namespace={self.namespace.prefix}" if self.namespace else " (unbound)"
        auth = f" key id={self.cluster_key.key_id.hex()}" if self.cluster_key is not None else " unauthenticated"
        return f"<PageStore {type(self.backend).__name__} {self.url.redacted}{bound}{auth}>"

    # ---- 0.2's make_storage returned the backend: its members are named, not reached, since 0.4 ----------------

    def __getattr__(self, name: str) -> Any:
        why = backend_member(self, name)
        raise AttributeError(why or f"'PageStore' object has no attribute {name!r}", name=name, obj=self)

    def __setattr__(self, name: str, value: Any) -> None:
        why = None if name in self.__dict__ or hasattr(type(self), name) else backend_member(self, name)
        if why is not None:  # a patch meant for the backend must not land silently on the store
            raise AttributeError(why, name=name, obj=self)
        object.__setattr__(self, name, value)


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


def _auth_failed(h: str, why: str, detail: str) -> PageResult:
    """A page the cluster key does not authenticate: a miss, counted by why (hicache_l3_auth_failures_total)."""
    _metrics.record_auth_failure(why)
    return PageResult(h, PageStatus.AUTH_FAILED, detail)


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
