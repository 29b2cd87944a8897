"""``file:///dir``: one file per page under ``dir/<namespace>/<hash[:2]>/<hash>.page``.

* Writes go to a temporary file beside the target, then ``os.replace``: a reader sees a
  whole page or none, also when the writer is killed halfway (its temporary files are
  removed by the next backend that opens the directory).
* Pages leave and land in the host pool directly (``os.writev`` / ``os.readv`` on its
  memory): zero-copy. ``o_direct=1`` bypasses the page cache through an aligned bounce
  buffer (O_DIRECT needs 4 KiB-aligned memory and lengths; the pool's runs are not).
* ``fsync=1`` makes each page durable before it is reported stored (file and directory).
* ``capacity=10GiB`` bounds the bytes this directory holds; the least recently used
  pages are evicted to make room, and a page larger than the capacity is refused.
  The accounting is per backend instance (several processes on one directory each
  evict by their own view of it).
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import mmap
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from hicache_core.storage.backend import (
    Capabilities,
    ObjectMissing,
    SizeMismatch,
    StorageBackend,
    StorageError,
    StorageFull,
)
from hicache_core.storage.pages import Span
from hicache_core.storage.url import StorageURL, option_bool, option_bytes

SUFFIX = ".page"
#: On disk the 80-byte header is padded to one 4 KiB block, so the payload starts block-aligned:
#: the kernel copies it between page cache and pool a quarter faster than from offset 80, and
#: O_DIRECT needs it aligned anyway.
HEADER_BLOCK = 4096
_PAD = bytes(HEADER_BLOCK)
_TMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.\d+\.\d+\.tmp$")
_KEY = re.compile(r"^[A-Za-z0-9._-]+/[0-9A-Za-z_-]+$")
_ALIGN = 4096
_counter = itertools.count()


class FileStorage(StorageBackend):
    """Pages as files in a local (or shared) directory."""

    scheme: ClassVar[str] = "file"
    capabilities: ClassVar[Capabilities] = Capabilities(zero_copy=True, durable=True, shared=True)
    description: ClassVar[str] = "one file per page in a directory (atomic writes, optional O_DIRECT, fsync, LRU)"
    options_help: ClassVar[dict[str, str]] = {
        "capacity": "bytes the directory may hold; least recently used pages are evicted (default: unbounded)",
        "fsync": "1: fsync every page and its directory before reporting it stored",
        "o_direct": "1: read and write with O_DIRECT (bypass the page cache)",
    }

    def __init__(self, url: StorageURL, **options: Any) -> None:
        super().__init__(url, **options)
        if url.host not in (None, "", "localhost"):
            raise ValueError(f"file:// URLs take an absolute local path, as file:///path; got {url.redacted!r}")
        if url.username or url.password:
            raise ValueError(f"file:// URLs take no credentials (a local directory has no login); got {url.redacted!r}")
        if not url.path.startswith("/"):
            raise ValueError(f"file:// URLs take an absolute path, as file:///path; got {url.redacted!r}")
        self.root = Path(url.path)
        self.fsync = option_bool(options.get("fsync", False), "fsync")
        self.o_direct = option_bool(options.get("o_direct", False), "o_direct")
        if self.o_direct and not hasattr(os, "O_DIRECT"):
            raise ValueError("o_direct=1: this platform has no O_DIRECT")
        self.capacity = option_bytes(options["capacity"], "capacity") if "capacity" in options else None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create the storage directory {self.root}: {exc}") from exc
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise StorageError(f"the storage directory {self.root} is not writable")
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self._used = 0
        self._evicted = 0
        self._refused = 0
        self._local = threading.local()
        self._cleaned_tmp = self._remove_stale_tmp()
        if self.capacity is not None:
            self._scan()

    # ---- paths ---------------------------------------------------------------------------------

    def path_of(self, key: str) -> Path:
        """The file of a full key (``<namespace>/<page hash>``)."""
        if not _KEY.match(key):
            raise ValueError(f"not a storage key: {key!r}")
        prefix, name = key.split("/")
        return self.root / prefix / name[:2] / (name + SUFFIX)

    def _key_of(self, path: Path) -> str:
        return f"{path.parent.parent.name}/{path.name[: -len(SUFFIX)]}"

    def _page_files(self):
        yield from self.root.glob(f"*/*/*{SUFFIX}")

    def _remove_stale_tmp(self) -> int:
        """Temporary files of writers that died (their pid is gone) are never pages: remove them."""
        removed = 0
        for path in self.root.glob("*/*/.*.tmp"):
            m = _TMP.match(path.name)
            if m and not _pid_alive(int(m["pid"])):
                try:
                    path.unlink()
                    removed += 1
                except OSError:
                    pass
        return removed

    def _scan(self) -> None:
        found = []
        for path in self._page_files():
            try:
                st = path.stat()
            except OSError:
                continue
            found.append((st.st_atime_ns, self._key_of(path), st.st_size))
        for _, key, size in sorted(found):
            self._lru[key] = size
            self._used += size

    # ---- primitives ----------------------------------------------------------------------------

    def exists_objects(self, keys: Sequence[str]) -> list[bool]:
        return [self.path_of(k).is_file() for k in keys]

    def put_objects(self, keys: Sequence[str], values: Sequence[Sequence[Span]]) -> list[BaseException | None]:
        out: list[BaseException | None] = []
        for key, spans in zip(keys, values):
            size = sum(s.nbytes for s in spans)
            try:
                self._make_room(key, size + HEADER_BLOCK - spans[0].nbytes)  # what it takes on disk
                self._write(self.path_of(key), spans, size)
            except StorageFull as exc:
                out.append(exc)
                continue
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    with self._lock:
                        self._refused += 1
                    out.append(StorageFull(f"{self.root}: {exc.strerror}"))
                else:
                    out.append(exc)
                self._forget(key)
                continue
            out.append(None)
        return out

    def get_objects_into(self, keys: Sequence[str], targets: Sequence[Sequence[Span]]) -> list[BaseException | None]:
        out: list[BaseException | None] = []
        for key, spans in zip(keys, targets):
            path = self.path_of(key)
            try:
                out.append(self._read(path, spans))
            except FileNotFoundError:
                self._forget(key)
                out.append(ObjectMissing(key))
                continue
            except OSError as exc:
                out.append(exc)
                continue
            if out[-1] is None and self.capacity is not None:
                with self._lock:
                    if key in self._lru:
                        self._lru.move_to_end(key)
        return out

    def remove_objects(self, keys: Sequence[str]) -> None:
        for key in keys:
            _unlink(self.root / "raw" / key.replace("/", "_"))
            try:
                self.path_of(key).unlink()
            except FileNotFoundError:
                pass
            self._forget(key)

    def clear(self) -> None:
        for path in list(self._page_files()):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        with self._lock:
            self._lru.clear()
            self._used = 0

    def backend_stats(self) -> dict[str, Any]:
        if self.capacity is not None:
            with self._lock:
                objects, used = len(self._lru), self._used
        else:
            sizes = [p.stat().st_size for p in self._page_files()]
            objects, used = len(sizes), sum(sizes)
        return {
            "directory": str(self.root),
            "objects": objects,
            "used_bytes": used,
            "capacity_bytes": self.capacity,
            "evicted": self._evicted,
            "refused_full": self._refused,
            "stale_tmp_removed": self._cleaned_tmp,
            "fsync": self.fsync,
            "o_direct": self.o_direct,
        }

    # ---- the raw client (benchmark ceiling): plain open/write/read of the same bytes ----------

    def raw_put_from(self, keys: Sequence[str], spans: Sequence[Span]) -> None:
        raw = self.root / "raw"
        raw.mkdir(exist_ok=True)
        for key, span in zip(keys, spans):
            with open(raw / key.replace("/", "_"), "wb", buffering=0) as f:
                f.write(span.view)

    def raw_get_into(self, keys: Sequence[str], spans: Sequence[Span]) -> None:
        for key, span in zip(keys, spans):
            with open(self.root / "raw" / key.replace("/", "_"), "rb", buffering=0) as f:
                if f.readinto(span.view) != span.nbytes:
                    raise StorageError(f"raw read of {key} came up short")

    # ---- capacity ------------------------------------------------------------------------------

    def _make_room(self, key: str, size: int) -> None:
        if self.capacity is None:
            return
        victims = []
        with self._lock:
            if size > self.capacity:
                self._refused += 1
                raise StorageFull(f"a {size}-byte page exceeds the capacity of {self.capacity} bytes")
            old = self._lru.pop(key, 0)
            self._used -= old
            while self._used + size > self.capacity and self._lru:
                victim, vsize = self._lru.popitem(last=False)
                self._used -= vsize
                victims.append(victim)
            self._lru[key] = size  # reserved now, so concurrent writers do not overshoot
            self._used += size
            self._evicted += len(victims)
        for victim in victims:
            try:
                self.path_of(victim).unlink()
            except FileNotFoundError:
                pass
        self.report_removed(victims, "evicted")

    def _forget(self, key: str) -> None:
        if self.capacity is None:
            return
        with self._lock:
            size = self._lru.pop(key, None)
            if size is not None:
                self._used -= size

    # ---- I/O -----------------------------------------------------------------------------------

    def _write(self, path: Path, spans: Sequence[Span], size: int) -> None:
        pad = HEADER_BLOCK - spans[0].nbytes
        spans = [spans[0], Span(0, pad, memoryview(_PAD)[:pad]), *spans[1:]]
        size += pad
        try:
            self._write_file(path, spans, size)
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._write_file(path, spans, size)

    def _write_file(self, path: Path, spans: Sequence[Span], size: int) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident() % 10**6}.{next(_counter)}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        if self.o_direct:
            flags |= os.O_DIRECT
        fd = os.open(tmp, flags, 0o644)
        try:
            if self.o_direct:
                bounce = self._bounce(size)
                offset = 0
                for s in spans:
                    if s.ptr:
                        ctypes.memmove(_mmap_address(bounce) + offset, s.ptr, s.nbytes)
                    else:
                        ctypes.memset(_mmap_address(bounce) + offset, 0, s.nbytes)
                    offset += s.nbytes
                padded = -(-size // _ALIGN) * _ALIGN
                _write_all(fd, [memoryview(bounce)[:padded]])
                os.ftruncate(fd, size)
            else:
                _write_all(fd, [s.view for s in spans])
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        os.close(fd)
        try:
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        if self.fsync:
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def _read(self, path: Path, spans: Sequence[Span]) -> BaseException | None:
        pad = HEADER_BLOCK - spans[0].nbytes
        scratch = getattr(self._local, "pad", None)
        if scratch is None:
            scratch = self._local.pad = bytearray(HEADER_BLOCK)
        spans = [spans[0], Span(0, pad, memoryview(scratch)[:pad]), *spans[1:]]
        total = sum(s.nbytes for s in spans)
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | (os.O_DIRECT if self.o_direct else 0)
        fd = os.open(path, flags)
        try:
            size = os.fstat(fd).st_size
            if size != total:
                return SizeMismatch(f"{path.name} is {size} bytes, the page takes {total}")
            if self.o_direct:
                padded = -(-size // _ALIGN) * _ALIGN
                bounce = self._bounce(padded)
                got = _read_all(fd, [memoryview(bounce)[:padded]])
                if got < size:
                    return SizeMismatch(f"{path.name}: read {got} of {size} bytes")
                offset = 0
                for s in spans:
                    if s.ptr:
                        ctypes.memmove(s.ptr, _mmap_address(bounce) + offset, s.nbytes)
                    offset += s.nbytes
            else:
                got = _read_all(fd, [s.view for s in spans])
                if got != total:
                    return SizeMismatch(f"{path.name}: read {got} of {total} bytes (it changed while read)")
        finally:
            os.close(fd)
        return None

    def _bounce(self, size: int) -> mmap.mmap:
        """A page-aligned buffer of at least ``size`` bytes, one per thread (O_DIRECT only)."""
        need = max(_ALIGN, -(-size // _ALIGN) * _ALIGN)
        buf = getattr(self._local, "bounce", None)
        if buf is None or len(buf) < need:
            buf = self._local.bounce = mmap.mmap(-1, need)
        return buf


def _mmap_address(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _write_all(fd: int, views: list[memoryview]) -> None:
    views = [v for v in views if len(v)]
    while views:
        n = os.writev(fd, views[:1024])  # IOV_MAX
        while n:
            if n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0


def _read_all(fd: int, views: list[memoryview]) -> int:
    views = [v for v in views if len(v)]
    total = 0
    while views:
        n = os.readv(fd, views[:1024])
        if n == 0:
            break
        total += n
        while n:
            if n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0
    if views:
        return total
    # One byte more than expected means the file grew while we read it.
    extra = os.read(fd, 1)
    return total + len(extra)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
