"""What a storage plugin implements: :class:`StorageBackend`, byte primitives on whole objects.

A storage plugin subclasses :class:`StorageBackend`, declares its URL ``scheme`` and
:class:`Capabilities`, and implements the object primitives (``exists_objects``,
``put_objects``, and ``get_objects_into`` or ``get_objects``). It never sees a page:
:func:`~hicache_core.storage.make_storage` wraps it in a :class:`~hicache_core.storage.PageStore`,
which owns the keys, the page header, checksums, batches, argument checks and statistics, and
SGLang's page API (``storage/page_store.py``). ``hicache_core.testing.storage_kit`` is this
contract's test.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from .legacy import PAGE_API, page_api_problems, removed_page_api
from .outcomes import NotAPage, ObjectMissing, PageResult, PageStatus, SizeMismatch, StorageError, StorageFull
from .url import redact_text, scrub_exception, secrets_of

__all__ = [  # the outcomes are part of the contract: a backend returns or raises them
    "Capabilities", "NotAPage", "ObjectMissing", "PageResult", "PageStatus", "SizeMismatch", "StorageBackend",
    "StorageError", "StorageFull",
]  # fmt: skip

if TYPE_CHECKING:
    from .keys import Namespace
    from .page_auth import ClusterKey
    from .pages import Span
    from .url import StorageURL


#: The methods a plugin writes (its primitives and ``__init__``): every exception that leaves one is
#: redacted (:func:`~hicache_core.storage.url.scrub_exception`), so no plugin has to remember to.
_PLUGIN_METHODS = ("__init__", "exists_objects", "put_objects", "get_objects_into", "get_objects", "ping",
                   "register_memory", "remove_objects", "clear", "close", "backend_stats", "check_steps",
                   "raw_put_from", "raw_get_into")  # fmt: skip


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


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared as data.

    :param zero_copy: reads land straight in the host pool's pages and writes leave from
        them (``get_objects_into``); without it the core copies each page out of the
        bytes ``get_objects`` returns.
    :param durable: stored pages survive a restart of the store (and of this process).
    :param shared: other processes, or other machines, see the same pages.
    :param reads_own_writes: an instance finds and reads back the pages it wrote itself. ``False``
        for a tier that serves other instances only (``peer://``: a page stays in its writer's
        host pool, which never reads it from itself); ``hicache storage check`` then reads
        through a second instance of the same URL.
    """

    zero_copy: bool = False
    durable: bool = False
    shared: bool = False
    reads_own_writes: bool = True


#: A URL scheme (RFC 3986): a letter, then letters, digits, ``+``, ``-`` or ``.``, lower case here.
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*$")


class StorageBackend:
    """Base class of every L3 storage backend: byte primitives on whole objects under full keys.

    Subclasses set :attr:`scheme` and :attr:`capabilities`, take ``(url, **options)`` in
    ``__init__`` (calling ``super().__init__(url, **options)``), and implement:

    * :meth:`exists_objects` (required),
    * :meth:`put_objects` (required),
    * :meth:`get_objects_into` when ``capabilities.zero_copy``, else :meth:`get_objects`,
    * optionally :meth:`ping`, :meth:`register_memory`, :meth:`remove_objects`, :meth:`clear`,
      :meth:`close`, :meth:`backend_stats`, and :meth:`raw_put_from` / :meth:`raw_get_into`
      for ``hicache bench --storage``.

    An object is a page's header and payload; the primitives store and return the spans they
    are given and never interpret them. They are called from several threads at once and must
    be thread-safe. :func:`~hicache_core.storage.make_storage` builds the backend and wraps it
    in a :class:`~hicache_core.storage.PageStore` bound to a host pool; the store sets plain
    attributes here when it binds: :attr:`namespace` (the keys' :class:`Namespace`),
    :attr:`page_bytes` (payload bytes of one page), both ``None`` until then,
    :attr:`trailer_bytes` (bytes of the checksum row stored after each page's payload: 0 unless
    the pool verifies), and :attr:`cluster_key` (the store's key, for a backend that
    authenticates records of its own). All are set before :meth:`register_memory`.
    """

    scheme: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities] = Capabilities()
    description: ClassVar[str] = ""
    #: Pages go to the primitives in groups of at most this many payload bytes (at least one page),
    #: so that a page's checksum is taken while the copy that moved it still has it in the CPU cache.
    io_chunk_bytes: ClassVar[int] = 8 << 20
    #: Options this backend accepts (URL query or keyword), with a one-line meaning each. A backend whose opening
    #: creates or tidies its store (``file://`` makes its directory) declares ``inspect``: ``hicache storage
    #: check|stats`` and ``explain-miss`` open it with ``inspect=1``, to look at a store, never to make or change it.
    options_help: ClassVar[Mapping[str, str]] = {}
    #: How to start the store's server, for messages when it cannot be reached ("" for serverless stores).
    server_hint: ClassVar[str] = ""
    #: The namespace of the bound page store's keys (set when it binds; ``None`` before).
    namespace: Namespace | None = None
    #: Payload bytes of one page of the bound host pool (set when it binds; ``None`` before).
    page_bytes: int | None = None
    #: Bytes of the checksum row stored after each page's payload (a verifying host pool's; 0 otherwise), so an
    #: object under a key is ``header + page_bytes + trailer_bytes`` bytes (set when it binds).
    trailer_bytes: int = 0
    #: The bound page store's cluster key (set before ``register_memory``; ``None``: unauthenticated).
    cluster_key: ClusterKey | None = None
    #: Who hears of objects the store dropped on its own (set by the page store when KV events are
    #: published; ``None``: nobody). A backend calls :meth:`report_removed`, never this directly.
    removal_listener: Any = None

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
        return problems + page_api_problems(cls, StorageBackend)

    def __init__(self, url: StorageURL, **options: Any) -> None:
        unknown = sorted(set(options) - set(self.options_help))
        if unknown:
            known = ", ".join(sorted(self.options_help)) or "none"
            raise ValueError(f"{self.scheme}:// storage does not take option(s) {', '.join(unknown)}; options: {known}")
        self.url = url
        self.options = dict(options)

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

    def attach_leases(self, book: Any) -> str:
        """How this store's evictions meet hicache's leases (``docs/retention.md``); called once, by the page store.

        ``book`` is the store's :class:`~hicache_core.retention.LeaseBook`, keyed by full keys. Returns:

        * ``"ordered"``: the store evicts in the order the book gives (hicache's own
          :class:`~hicache_core.retention.RetentionQueue`), and refreshes its leases on a hit;
        * ``"touched"``: the store evicts by its own measure of recency or frequency, and the page store
          keeps protected pages ahead of it by touching them (:meth:`touch_objects`) every
          ``HICACHE_LEASE_TOUCH_S``; a protected page it finds gone is counted dropped under its lease;
        * ``"never"``: the store evicts nothing on its own (a full store refuses writes): a lease has
          nothing to protect against;
        * ``"own"`` (the default): the store's own policy evicts, and cannot be told of leases.
        """
        return "own"

    def touch_objects(self, keys: Sequence[str]) -> list[bool]:
        """Mark objects as just used, for the store's own eviction (a ``"touched"`` store); one bool per key:
        whether the object is still there."""
        raise NotImplementedError(f"{type(self).__name__} does not implement touch_objects")

    def prefetch_objects(self, keys: Sequence[str]) -> int:
        """Start bringing these objects up to a faster tier of the store's own (a page cache, a local
        replica) ahead of a read; returns how many it started on. Default: 0, the store has none."""
        return 0

    def report_removed(self, keys: Sequence[str], reason: str) -> None:
        """Say that the store dropped these full keys on its own (``reason``: ``"evicted"``, ``"expired"``, ...).

        A backend that evicts or expires objects itself calls this after they are gone, so the cluster's KV
        events say so at once (``hicache_core.events``); stores that cannot tell are audited instead.
        """
        listener = self.removal_listener
        if listener is not None and keys:
            listener(list(keys), reason)

    def check_steps(self) -> list[tuple[str, bool, str]]:
        """What ``hicache storage check`` verifies of this backend beyond the page round trip, once bound.

        One ``(step, passed, detail)`` per thing a user needs to know works (a directory joined, memory
        registered with a transfer engine, ...); the default has none.
        """
        return []

    # ---- the raw client, for ``hicache bench --storage`` only -----------------------------------

    def raw_put_from(self, keys: Sequence[str], spans: Sequence[Span]) -> None:
        """Store each contiguous buffer as plainly as the store's own client can (no header, no checksum).

        The benchmark's ceiling: ``hicache bench --storage`` compares the tier against it on the same bytes.
        """
        raise NotImplementedError(f"{type(self).__name__} has no raw client benchmark")

    def raw_get_into(self, keys: Sequence[str], spans: Sequence[Span]) -> None:
        """Read what :meth:`raw_put_from` stored back into the same buffers, as plainly as the client can."""
        raise NotImplementedError(f"{type(self).__name__} has no raw client benchmark")

    def __repr__(self) -> str:
        bound = f" namespace={self.namespace.prefix}" if self.namespace else " (unbound)"
        return f"<{type(self).__name__} {self.url.redacted}{bound}>"

    def __getattr__(self, name: str) -> Any:
        # Only for names not found: 0.2's page API on a backend, which 0.4 removed, is explained, not served.
        if name in PAGE_API:
            raise AttributeError(removed_page_api(type(self).__name__, name), name=name, obj=self)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self)
