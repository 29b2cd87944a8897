"""``mooncake://master-host:port``: pages in Mooncake Store, through a registered staging buffer.

Mooncake's transfer engine authenticates no one: whoever reaches a client's transfer port (over
TCP it listens on every interface, whatever ``local_hostname`` says) reads and writes every buffer
that client registered (``register_buffer``). So by default the host pool is **not** registered:
a write copies each page (header, then its runs) into a bounded staging buffer that is registered,
and puts it from there; a read lands in staging and is copied into the pool before this returns, so
the page store's checksum or MAC is taken on the pool's copy, which nothing outside the process can
reach, and no remote write can change a page after it was checked. Staging is ``staging`` bytes per
thread moving pages at once (at most :data:`STAGING_BUFFERS` of them), registered when first used.

``expose_host_pool=1`` registers the host pool's buffers instead, as 0.1 of this plugin always did:
each page moves with ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` on the
page's own addresses (header first, from a small registered scratch arena, then the page's runs),
saving the staging copy, but then whoever reaches the transfer port reads and writes the whole
host pool, also after a page's MAC was checked: for a network only the cluster reaches. This
client also contributes a segment of its memory to the store (``segment``), as every Mooncake
client does; the default transport is TCP (no RDMA needed).

A page lives in the segment of the client that stored it: when that process exits, its
pages leave the store with it (run a ``mooncake_client`` that lends memory to keep pages
beyond the processes that wrote them). Before setting up, the master's port is probed for
``connect_timeout`` seconds, so a missing master fails at once instead of after Mooncake's
own retries (about 90 s). ``clear()`` removes only hicache's pages: the bound namespace's,
or, unbound, every key in hicache's key shape.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import math
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import torch

from hicache_core.host_memory import host_tensor
from hicache_core.storage.backend import (
    Capabilities,
    ObjectMissing,
    SizeMismatch,
    StorageBackend,
    StorageError,
    StorageFull,
)
from hicache_core.storage.page_format import HEADER_SIZE
from hicache_core.storage.pages import Span
from hicache_core.storage.url import StorageURL, option_bool, option_bytes, option_float

# Mooncake's ErrorCode values that mean "no such object" and "no space".
OBJECT_NOT_FOUND = -704
NO_SPACE = {-200, -201, -202}  # NO_AVAILABLE_HANDLE, and the allocation failures around it
ARENA_SLOTS = 128
#: Codes batch_get_into_multi_buffers gives for an object that does not fit the targets (-600); other
#: failures are checked against the object's size (a short object answered -800 here).
SIZE_CODES = {-600}
#: At most this many staging buffers exist per backend (one per thread moving pages at once; more wait).
STAGING_BUFFERS = 4
#: Every key hicache writes: ``<model>.<model digest>.<fingerprint>.<share>/<page hash>``.
_HICACHE_KEY = r"[A-Za-z0-9._-]+\.m[0-9]+-[0-9a-f]{24}\.[0-9a-f]{32}\.[A-Za-z0-9-]+/[0-9A-Za-z_-]+"


class _Client:
    """One Mooncake client per (master, settings) in a process, shared by every backend on it.

    Closing a Mooncake client takes a second or more (it unmounts its segment), so backends
    share one, and it closes when the process exits. Buffer registrations are counted, so two
    backends on one host pool register it once and unregister it when the last one closes.
    """

    def __init__(self, store: Any) -> None:
        self.store = store
        self.lock = threading.Lock()
        self.registered: dict[int, int] = {}  # address -> backends using it

    def register(self, ptr: int, nbytes: int) -> None:
        with self.lock:
            if self.registered.get(ptr):
                self.registered[ptr] += 1
                return
            rc = self.store.register_buffer(ptr, nbytes)
            if rc != 0:
                raise StorageError(f"Mooncake register_buffer({ptr:#x}, {nbytes}) failed with code {rc}")
            self.registered[ptr] = 1

    def unregister(self, ptr: int) -> None:
        with self.lock:
            left = self.registered.get(ptr, 0) - 1
            if left > 0:
                self.registered[ptr] = left
                return
            self.registered.pop(ptr, None)
            self.store.unregister_buffer(ptr)


_CLIENTS: dict[tuple, _Client] = {}
_CLIENTS_LOCK = threading.Lock()


@atexit.register
def _close_clients() -> None:
    with _CLIENTS_LOCK:
        clients = list(_CLIENTS.items())
        _CLIENTS.clear()
    for settings, client in clients:
        # Closing against a master that is gone retries for seconds per client; the master
        # drops a vanished client by itself, so only clients of a reachable master close.
        if not _reachable(settings[-1]):
            # Its destructor would retry for seconds too: keep it alive until the OS reclaims the process.
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(client.store))
            continue
        try:
            client.store.close()
        except Exception:  # noqa: BLE001 - the process is exiting
            pass


def _reachable(address: str, timeout: float = 0.2) -> bool:
    import socket

    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


class _Staging:
    """Registered buffers that pages pass through, lent one per thread at a time (at most ``limit``)."""

    def __init__(self, nbytes: int, limit: int, register: Any) -> None:
        self.nbytes = nbytes
        self.limit = limit
        self._register = register
        self._made: list[torch.Tensor] = []
        self._free: list[torch.Tensor] = []
        self._registered: set[int] = set()
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def lend(self) -> Iterator[tuple[int, int]]:
        """A staging buffer's address and size, for this thread alone until the block ends."""
        with self._cond:
            while not self._free and len(self._made) >= self.limit:
                self._cond.wait()
            buf = self._free.pop() if self._free else None
            if buf is None:
                buf = host_tensor((self.nbytes,), torch.uint8, pinned=False, label="mooncake:// staging",
                                  name=f"staging {len(self._made)}")  # fmt: skip
                self._made.append(buf)
        try:
            if buf.data_ptr() not in self._registered:
                self._register(buf.data_ptr(), buf.numel())
                self._registered.add(buf.data_ptr())
            yield buf.data_ptr(), buf.numel()
        finally:
            with self._cond:
                self._free.append(buf)
                self._cond.notify()


class MooncakeStorage(StorageBackend):
    """Pages as Mooncake Store objects, through registered staging (or the registered pool), TCP by default."""

    scheme: ClassVar[str] = "mooncake"
    # zero_copy: the core hands get_objects_into the pool's pages (the copy through staging is this plugin's).
    capabilities: ClassVar[Capabilities] = Capabilities(zero_copy=True, durable=False, shared=True)
    description: ClassVar[str] = ("Mooncake Store: batch_put_from/batch_get_into through a registered staging "
                                  "buffer (expose_host_pool=1: on the registered host pool)")  # fmt: skip
    # A Mooncake batch call costs about as much as copying a few MB here; larger groups amortise it
    # (the checksum pass is from DRAM either way once a group outgrows the cache).
    io_chunk_bytes: ClassVar[int] = 64 << 20
    options_help: ClassVar[dict[str, str]] = {
        "segment": "bytes of this process's memory lent to the store (default 1GiB)",
        "local_buffer": "the client's own transfer buffer (default 64MiB)",
        "protocol": "transfer protocol (default tcp)",
        "device": "RDMA device names (default none)",
        "local_hostname": "this client's address as the others see it (default 127.0.0.1)",
        "metadata": "metadata server (default P2PHANDSHAKE: none needed)",
        "connect_timeout": "seconds to wait for the master's port before giving up (default 5)",
        "staging": "bytes of registered staging per thread moving pages (default 64MiB; at least one page)",
        "expose_host_pool": "1: register the host pool with the transfer engine and move pages without the "
        "staging copy; whoever reaches this client's transfer port then reads and writes the whole pool "
        "(default 0; for a network only the cluster reaches)",
    }
    server_hint: ClassVar[str] = (
        "start a master with: mooncake_master -rpc_address=127.0.0.1 -rpc_port=PORT "
        "(it ships in the mooncake-transfer-engine wheel)"
    )

    def __init__(self, url: StorageURL, **options: Any) -> None:
        super().__init__(url, **options)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise StorageError(
                "mooncake:// needs Mooncake Store's Python client: pip install mooncake-transfer-engine "
                f"(or mooncake-transfer-engine-non-cuda on a machine without CUDA), and libibverbs1 ({exc})"
            ) from exc
        if not url.host or not url.port:
            raise ValueError(
                f"mooncake:// takes the master's address, as mooncake://127.0.0.1:50051; got {url.redacted!r}"
            )
        if url.username or url.password:
            raise ValueError(f"mooncake:// has no credentials (a Mooncake master does not authenticate): remove the "
                             f"user-info from {url.redacted!r}")  # fmt: skip
        self.master = f"{url.host}:{url.port}"
        self.segment = option_bytes(options.get("segment", 1 << 30), "segment")
        self.local_buffer = option_bytes(options.get("local_buffer", 64 << 20), "local_buffer")
        self.connect_timeout = option_float(options.get("connect_timeout", 5.0), "connect_timeout")
        if not (math.isfinite(self.connect_timeout) and self.connect_timeout > 0):
            raise ValueError(f"option connect_timeout={options.get('connect_timeout')!r} must be a positive number")
        self.expose_host_pool = option_bool(options.get("expose_host_pool", False), "expose_host_pool")
        self.staging_bytes = option_bytes(options.get("staging", 64 << 20), "staging")
        if self.staging_bytes <= 0:
            raise ValueError(f"option staging={options.get('staging')!r} must be a positive size")
        settings = (
            str(options.get("local_hostname", "127.0.0.1")),
            str(options.get("metadata", "P2PHANDSHAKE")),
            self.segment,
            self.local_buffer,
            str(options.get("protocol", "tcp")),
            str(options.get("device", "")),
            self.master,
        )
        with _CLIENTS_LOCK:
            client = _CLIENTS.get(settings)
            if client is None:
                if not _reachable(self.master, self.connect_timeout):
                    raise StorageError(f"no Mooncake master answers at {self.master} (waited "
                                       f"{self.connect_timeout:g} s); {self.server_hint}")  # fmt: skip
                store = MooncakeDistributedStore()
                rc = store.setup(*settings)
                if rc != 0:
                    raise StorageError(f"Mooncake Store setup against master {self.master} failed with code {rc}")
                client = _CLIENTS[settings] = _Client(store)
        self._client = client
        self._store = client.store
        self._registered: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self._arenas: list[torch.Tensor] = []
        self._refused = 0
        self._pool_spans: list[Span] = []
        self._pool_registered = False
        self._staging: _Staging | None = None

    @property
    def store(self) -> Any:
        """The Mooncake client; raises :class:`StorageError` after :meth:`close`."""
        store = self._store
        if store is None:
            raise StorageError(f"this mooncake://{self.master} backend is closed: make a new one with make_storage")
        return store

    # ---- memory --------------------------------------------------------------------------------

    def register_memory(self, spans: Sequence[Span]) -> None:
        """Register the host pool with the transfer engine only with ``expose_host_pool=1``."""
        self._pool_spans = list(spans)
        if self.expose_host_pool:
            self._register_pool()

    def _register_pool(self) -> None:
        with self._lock:
            if self._pool_registered:
                return
            self._pool_registered = True
        for s in self._pool_spans:
            self._register(s.ptr, s.nbytes)

    def _staged(self) -> _Staging:
        with self._lock:
            if self._staging is None:
                # Never smaller than one page's object, so any page of the bound pool fits alone.
                one = HEADER_SIZE + (self.page_bytes or 0) + self.trailer_bytes
                self._staging = _Staging(max(self.staging_bytes, one), STAGING_BUFFERS, self._register)
            return self._staging

    def _register(self, ptr: int, nbytes: int) -> None:
        if nbytes == 0:
            return
        self._client.register(ptr, nbytes)
        with self._lock:
            self._registered.append((ptr, nbytes))

    def _arena(self) -> torch.Tensor:
        """This thread's registered scratch for page headers (one slot per page of a batch)."""
        arena = getattr(self._local, "arena", None)
        if arena is None:
            arena = host_tensor((ARENA_SLOTS * HEADER_SIZE,), torch.uint8, pinned=False, label="mooncake:// headers",
                                name=f"arena {threading.get_ident()}")  # fmt: skip
            self._register(arena.data_ptr(), arena.numel())
            with self._lock:
                self._arenas.append(arena)
            self._local.arena = arena
        return arena

    # ---- primitives ----------------------------------------------------------------------------

    def exists_objects(self, keys: Sequence[str]) -> list[bool]:
        codes = self.store.batch_is_exist(list(keys))
        bad = [c for c in codes if c < 0]
        if bad:
            raise StorageError(f"Mooncake batch_is_exist failed with code {bad[0]}")
        return [c == 1 for c in codes]

    def put_objects(self, keys: Sequence[str], values: Sequence[Sequence[Span]]) -> list[BaseException | None]:
        if not self.expose_host_pool:
            return self._put_staged(keys, values)
        out: list[BaseException | None] = []
        arena = self._arena()
        base = arena.data_ptr()
        for start in range(0, len(keys), ARENA_SLOTS):
            ks, vs = list(keys[start : start + ARENA_SLOTS]), values[start : start + ARENA_SLOTS]
            ptrs, sizes = [], []
            for i, spans in enumerate(vs):
                header, payload = spans[0], spans[1:]
                ctypes.memmove(base + i * HEADER_SIZE, header.ptr, header.nbytes)
                ptrs.append([base + i * HEADER_SIZE] + [s.ptr for s in payload])
                sizes.append([header.nbytes] + [s.nbytes for s in payload])
            codes = self.store.batch_put_from_multi_buffers(ks, ptrs, sizes)
            out += [self._put_outcome(code) for code in codes]
        return out

    def _put_outcome(self, code: int) -> BaseException | None:
        if code == 0:
            return None
        if code in NO_SPACE:
            self._refused += 1
            return StorageFull(f"Mooncake Store has no space (code {code})")
        return StorageError(f"Mooncake put failed with code {code}")

    def _groups(self, sizes: Sequence[int], capacity: int, start: int) -> int:
        """The end of the group of objects from ``start`` that fits ``capacity`` bytes (at least one object)."""
        end, used = start, 0
        while end < len(sizes) and end - start < ARENA_SLOTS and (end == start or used + sizes[end] <= capacity):
            used += sizes[end]
            end += 1
        return end

    def _staged_groups(self, totals: list[int], out: list[BaseException | None],
                       too_big: Callable[[int, int], BaseException]) -> Iterator[tuple[int, int, int]]:  # fmt: skip
        """``(start, end, staging address)`` per group of objects that fits a staging buffer, the buffer lent
        to this thread while the caller's body runs; an object larger than the buffer gets ``too_big``."""
        start = 0
        while start < len(totals):
            with self._staged().lend() as (base, capacity):
                if totals[start] > capacity:
                    out[start] = too_big(totals[start], capacity)
                    start += 1
                    continue
                end = self._groups(totals, capacity, start)
                yield start, end, base
            start = end

    def _put_staged(self, keys: Sequence[str], values: Sequence[Sequence[Span]]) -> list[BaseException | None]:
        store = self.store  # closed: raise before a staging buffer is registered again
        totals = [sum(s.nbytes for s in spans) for spans in values]
        out: list[BaseException | None] = [None] * len(keys)

        def too_big(total: int, capacity: int) -> BaseException:
            return StorageError(f"a {total}-byte object does not fit Mooncake's {capacity}-byte staging buffer "
                                "(option staging)")  # fmt: skip

        for start, end, at in self._staged_groups(totals, out, too_big):
            ptrs: list[list[int]] = []
            sizes: list[list[int]] = []
            for spans in values[start:end]:
                ptrs.append([])
                sizes.append([])
                for s in spans:
                    ctypes.memmove(at, s.ptr, s.nbytes)
                    ptrs[-1].append(at)
                    sizes[-1].append(s.nbytes)
                    at += s.nbytes
            codes = store.batch_put_from_multi_buffers(list(keys[start:end]), ptrs, sizes)
            for i, code in enumerate(codes):
                out[start + i] = self._put_outcome(code)
        return out

    def get_objects_into(self, keys: Sequence[str], targets: Sequence[Sequence[Span]]) -> list[BaseException | None]:
        if not self.expose_host_pool:
            return self._get_staged(keys, targets)
        out: list[BaseException | None] = []
        arena = self._arena()
        base = arena.data_ptr()
        for start in range(0, len(keys), ARENA_SLOTS):
            ks, ts = list(keys[start : start + ARENA_SLOTS]), targets[start : start + ARENA_SLOTS]
            ptrs, sizes, totals = [], [], []
            for i, spans in enumerate(ts):
                payload = spans[1:]
                ptrs.append([base + i * HEADER_SIZE] + [s.ptr for s in payload])
                sizes.append([HEADER_SIZE] + [s.nbytes for s in payload])
                totals.append(sum(sizes[-1]))
            codes = self.store.batch_get_into_multi_buffers(ks, ptrs, sizes)
            for i, (code, total, spans) in enumerate(zip(codes, totals, ts)):
                if code == total:
                    ctypes.memmove(spans[0].ptr, base + i * HEADER_SIZE, HEADER_SIZE)
                out.append(self._get_outcome(ks[i], total, code))
        return out

    def _get_outcome(self, key: str, total: int, code: int) -> BaseException | None:
        if code == total:
            return None
        if code == OBJECT_NOT_FOUND:
            return ObjectMissing(key)
        if code >= 0 or code in SIZE_CODES:  # the object does not fit the targets
            return SizeMismatch(f"Mooncake object {key!r} does not match a {total}-byte page ({code})")
        return self._sized(key, total, code)

    def _get_staged(self, keys: Sequence[str], targets: Sequence[Sequence[Span]]) -> list[BaseException | None]:
        # The header span is the caller's (not registered either): it lands in staging like the runs.
        store = self.store  # closed: raise before a staging buffer is registered again
        totals = [HEADER_SIZE + sum(s.nbytes for s in spans[1:]) for spans in targets]
        out: list[BaseException | None] = [None] * len(keys)

        def too_big(total: int, capacity: int) -> BaseException:
            return SizeMismatch(f"a {total}-byte page does not fit Mooncake's {capacity}-byte staging buffer "
                                "(option staging)")  # fmt: skip

        for start, end, at in self._staged_groups(totals, out, too_big):
            ptrs: list[list[int]] = []
            sizes: list[list[int]] = []
            for spans in targets[start:end]:
                ptrs.append([at])
                sizes.append([HEADER_SIZE])
                at += HEADER_SIZE
                for s in spans[1:]:
                    ptrs[-1].append(at)
                    sizes[-1].append(s.nbytes)
                    at += s.nbytes
            ks = list(keys[start:end])
            codes = store.batch_get_into_multi_buffers(ks, ptrs, sizes)
            for i, (code, spans) in enumerate(zip(codes, targets[start:end])):
                if code == totals[start + i]:  # copied out while this thread still holds the staging buffer
                    ctypes.memmove(spans[0].ptr, ptrs[i][0], HEADER_SIZE)
                    for s, src in zip(spans[1:], ptrs[i][1:]):
                        ctypes.memmove(s.ptr, src, s.nbytes)
                out[start + i] = self._get_outcome(ks[i], totals[start + i], code)
        return out

    def _sized(self, key: str, total: int, code: int) -> BaseException:
        """A failed read: a :class:`SizeMismatch` when the object is there with another size, else the code."""
        try:
            size = int(self.store.get_size(key))
        except Exception:  # noqa: BLE001 - then the code is all we can tell
            size = -1
        if size >= 0 and size != total:
            return SizeMismatch(f"Mooncake object {key!r} is {size} bytes, a page here is {total} (code {code})")
        return StorageError(f"Mooncake get failed with code {code}")

    def raw_put_from(self, keys: Sequence[str], spans: Sequence[Span]) -> None:
        """The client's ceiling: from registered memory, so this registers the bound host pool as
        ``expose_host_pool=1`` does (``hicache bench --storage`` only; a server never calls it)."""
        self._register_pool()
        codes = self.store.batch_put_from(list(keys), [s.ptr for s in spans], [s.nbytes for s in spans])
        if any(codes):
            raise StorageError(f"raw batch_put_from failed: {sorted(set(codes))}")

    def raw_get_into(self, keys: Sequence[str], spans: Sequence[Span]) -> None:
        self._register_pool()
        codes = self.store.batch_get_into(list(keys), [s.ptr for s in spans], [s.nbytes for s in spans])
        if any(c != s.nbytes for c, s in zip(codes, spans)):
            raise StorageError(f"raw batch_get_into failed: {sorted(set(codes))}")

    def remove_objects(self, keys: Sequence[str]) -> None:
        if keys:
            self.store.batch_remove(list(keys), True)

    def clear(self) -> None:
        """Remove this namespace's pages (bound), or every hicache-shaped key (unbound); never other objects."""
        if self.namespace is not None:
            pattern = "^" + re.escape(self.namespace.prefix + "/") + "[0-9A-Za-z_-]+$"
        else:
            pattern = "^" + _HICACHE_KEY + "$"
        code = self.store.remove_by_regex(pattern, True)
        if code < 0:
            raise StorageError(f"Mooncake remove_by_regex failed with code {code}")

    def close(self) -> None:
        store = getattr(self, "_store", None)
        if store is None:
            return
        with self._lock:
            registered, self._registered = self._registered, []
            self._pool_registered = False
            self._staging = None  # its buffers are unregistered just below; a thread still using one keeps it
        for ptr, _ in registered:
            self._client.unregister(ptr)
        self._store = None

    def backend_stats(self) -> dict[str, Any]:
        return {
            "master": self.master,
            "segment_bytes": self.segment,
            "registered_buffers": len(self._registered),
            "registered_bytes": sum(n for _, n in self._registered),
            "host_pool_registered": self._pool_registered,
            "refused_full": self._refused,
            "healthy": self._store.health_check() == 0 if self._store is not None else False,
        }
