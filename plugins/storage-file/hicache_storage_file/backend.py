"""``file:///dir``: one file per page under ``dir/<namespace>/<hash[:2]>/<hash>.page``.

* Writes go to a temporary file beside the target, then ``os.replace``: a reader sees a
  whole page or none, also when the writer is killed halfway (its temporary files are
  removed by the next backend that opens the directory).
* **Direct I/O straight into the host pool** (``o_direct=auto``, the default): a page whose
  runs are 4 KiB-aligned in address and length (checked per request) is read and written
  with ``O_DIRECT`` from and into the pool's own memory, with no page cache and no copy,
  split into requests of ``request_bytes`` of which up to ``io_depth`` are in flight at
  once (a thread pool issuing ``os.preadv`` / ``os.pwritev``, which release the GIL). On
  disk the 80-byte header is padded to one 4 KiB block, so the payload is block-aligned;
  the header block, and a short unaligned last run (a verifying pool's checksum row), go
  through a 4 KiB-aligned scratch block of their own.
* A page that cannot go direct falls back, and **every fall back is counted and named**
  in ``backend_stats()["direct_fallbacks"]`` (``"misaligned run"``: a run of the page is
  not 4 KiB-aligned; ``"EINVAL from the filesystem"``: the directory's filesystem refuses
  O_DIRECT, as tmpfs does) and said once per reason in a log warning. Under ``auto`` a
  fall back is buffered I/O through the page cache (zero-copy ``readv`` / ``writev`` on
  the pool's memory). ``o_direct=1`` never buffers: a directory that refuses O_DIRECT fails
  construction, and a misaligned page goes through an aligned bounce buffer (counted the
  same way). ``o_direct=0`` is buffered I/O throughout (nothing counted: nothing falls back).
* ``dirs=/mnt/b,/mnt/c``: several directories (one per drive), pages striped over the URL's
  directory and these by rendezvous hashing of the key and each directory's path: a
  page lives in exactly one of them, a lost directory loses only its share (a miss,
  never a wrong page: every page carries its key's digest), and adding or removing a
  directory moves only that directory's share.
* ``fsync=1`` makes each page durable before it is reported stored (file and directory).
* ``capacity=10GiB`` bounds the bytes all the directories hold together; the least recently
  used pages are evicted to make room, and a page larger than the capacity is refused.
  The accounting is per backend instance (several processes on one directory each
  evict by their own view of it).
* GPUDirect Storage is not implemented: reads land in the host pool, and
  ``hicache storage check`` says which path they take and whether this machine has GDS.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import itertools
import logging
import mmap
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from hicache_core.retention import LeaseBook, RetentionQueue
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

log = logging.getLogger(__name__)

SUFFIX = ".page"
#: On disk the 80-byte header is padded to one 4 KiB block, so the payload starts block-aligned:
#: the kernel copies it between page cache and pool a quarter faster than from offset 80, and
#: O_DIRECT needs it aligned anyway.
HEADER_BLOCK = 4096
_PAD = bytes(HEADER_BLOCK)
_TMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.\d+\.\d+\.tmp$")
_KEY = re.compile(r"^[A-Za-z0-9._-]+/[0-9A-Za-z_-]+$")
_ALIGN = 4096
#: The longest unaligned last run that still lets a page go direct through the scratch block (a checksum
#: row is a few KiB); a longer one is payload the pool lays out unaligned, and the page falls back.
_TAIL_MAX = 1 << 20
_counter = itertools.count()

#: Why a page did not go straight between the pool and the drive (``backend_stats()["direct_fallbacks"]``).
MISALIGNED = "misaligned run"
EINVAL_FS = "EINVAL from the filesystem"


@dataclass
class _Page:
    """One page of a batch on its way through the direct path."""

    key: str
    path: Path
    spans: Sequence[Span]
    size: int  # bytes of the file: header block, payload, tail
    fd: int = -1
    tmp: Path | None = None
    scratch: mmap.mmap | None = None
    tail: Span | None = None  # the unaligned last run, moved through the scratch block
    requests: list[tuple[int, list[memoryview], int]] = field(default_factory=list)  # (offset, views, need)
    error: BaseException | None = None


class FileStorage(StorageBackend):
    """Pages as files in one local (or shared) directory, or striped over several."""

    scheme: ClassVar[str] = "file"
    capabilities: ClassVar[Capabilities] = Capabilities(zero_copy=True, durable=True, shared=True)
    description: ClassVar[str] = (
        "one file per page in one or several directories (atomic writes, direct I/O into the pool, fsync, LRU)"
    )
    options_help: ClassVar[dict[str, str]] = {
        "capacity": "bytes all the directories may hold; least recently used pages are evicted (default: unbounded)",
        "fsync": "1: fsync every page and its directory before reporting it stored",
        "o_direct": "auto (default): O_DIRECT straight into the pool where a page's runs are 4 KiB-aligned and the "
        "filesystem takes it, else buffered, each fall back counted in direct_fallbacks; 1: always O_DIRECT "
        "(misaligned pages through a bounce buffer; a directory refusing O_DIRECT fails construction); 0: buffered",
        "dirs": "more directories, comma-separated absolute paths (one per drive): pages are striped over the "
        "URL's directory and these by key",
        "io_depth": "direct-I/O requests in flight at once (default 16)",
        "request_bytes": "bytes of one direct-I/O request, a multiple of 4096 (default 1MiB)",
        "inspect": "1: opened to be looked at (hicache storage check, stats, explain-miss): a directory that does not "
        "exist is refused, not created; nothing found is tidied (no stale temporary file removed, no O_DIRECT probe "
        "written: check_steps probes); a page removed takes the folders it emptied with it. Default 0",
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
        self.roots: list[Path] = [self.root, *_parse_dirs(options.get("dirs"))]
        if len({str(r) for r in self.roots}) != len(self.roots):
            raise ValueError(f"file:// directories must differ; got {', '.join(map(str, self.roots))}")
        self._salts = [hashlib.blake2b(str(r).encode(), digest_size=16).digest() for r in self.roots]
        self.fsync = option_bool(options.get("fsync", False), "fsync")
        self.direct_mode = _direct_mode(options.get("o_direct", "auto"))
        #: Whether any page may go with O_DIRECT (``o_direct`` 1 or auto); see :attr:`direct_mode`.
        self.o_direct = self.direct_mode != "0"
        if self.direct_mode == "1" and not hasattr(os, "O_DIRECT"):
            raise ValueError("o_direct=1: this platform has no O_DIRECT")
        depth = options.get("io_depth", 16)
        if not str(depth).isdigit() or not 1 <= int(depth) <= 256:
            raise ValueError(f"option io_depth={depth} must be a whole number from 1 to 256")
        self.io_depth = int(depth)
        self.request_bytes = option_bytes(options.get("request_bytes", 1 << 20), "request_bytes")
        if self.request_bytes < _ALIGN or self.request_bytes % _ALIGN:
            raise ValueError(f"option request_bytes={options['request_bytes']!r} must be a multiple of 4096")
        self.capacity = option_bytes(options["capacity"], "capacity") if "capacity" in options else None
        #: Opened to be looked at (``inspect=1``): nothing is created or tidied (see :attr:`options_help`).
        self.inspect = option_bool(options.get("inspect", False), "inspect")
        for root in self.roots:
            if self.inspect:
                if not root.is_dir():
                    what = "is not a directory" if root.exists() else "does not exist"
                    raise StorageError(f"the storage directory {root} {what} (opened to inspect: nothing is created)")
                continue
            try:
                root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StorageError(f"cannot create the storage directory {root}: {exc}") from exc
            if not os.access(root, os.W_OK | os.X_OK):
                raise StorageError(f"the storage directory {root} is not writable")
        #: Per directory: ``None`` when it takes O_DIRECT, else why not (a fall back reason).
        self.direct_refused: dict[Path, str | None] = {}
        #: Directories not probed for O_DIRECT (``inspect=1``): tried direct, an EINVAL falls back as it comes.
        self._unprobed: set[Path] = set(self.roots) if self.inspect and self.o_direct else set()
        if self.o_direct:
            for root in self.roots:
                if root in self._unprobed:
                    self.direct_refused[root] = None
                    continue
                why = _probe_direct(root) if hasattr(os, "O_DIRECT") else "no O_DIRECT on this platform"
                self.direct_refused[root] = why
                if why is not None and self.direct_mode == "1":
                    fs = filesystem_of(root)
                    raise StorageError(
                        f"o_direct=1: {root} ({fs['fstype']} on {fs['device']}) refuses O_DIRECT ({why}); use "
                        "a directory on a disk filesystem, or o_direct=auto to read and write it buffered"
                    )
        if any(why is None for why in self.direct_refused.values()):
            # Direct I/O moves bytes by DMA, never through the CPU's cache: bigger batches keep more requests in
            # flight and cost the page store's checksums nothing they would otherwise gain.
            self.io_chunk_bytes = 64 << 20
        self._lock = threading.Lock()
        # key -> bytes, least recently used first; evictions in the order the store's leases allow
        self._queue = RetentionQueue()
        self._evicted = 0
        self._refused = 0
        self._fallbacks: dict[str, int] = {}
        self._warned: set[str] = set()
        self._direct = {"read": 0, "write": 0}
        self._buffered = {"read": 0, "write": 0}
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self._cleaned_tmp = 0 if self.inspect else self._remove_stale_tmp()
        if self.capacity is not None:
            self._scan()
        for root, why in self.direct_refused.items():
            if why is not None:
                self._fell_back(why, 0, f"{root} refuses O_DIRECT: its pages are read and written buffered")

    # ---- paths ---------------------------------------------------------------------------------

    def root_of(self, key: str) -> Path:
        """The directory that holds ``key``: the highest of a hash of (directory, key), so each keeps its share."""
        if len(self.roots) == 1:
            return self.root
        data = key.encode()
        scores = [hashlib.blake2b(data, digest_size=8, key=salt).digest() for salt in self._salts]
        return self.roots[scores.index(max(scores))]

    def path_of(self, key: str) -> Path:
        """The file of a full key (``<namespace>/<page hash>``)."""
        if not _KEY.match(key):
            raise ValueError(f"not a storage key: {key!r}")
        prefix, name = key.split("/")
        return self.root_of(key) / prefix / name[:2] / (name + SUFFIX)

    def _key_of(self, path: Path) -> str:
        return f"{path.parent.parent.name}/{path.name[: -len(SUFFIX)]}"

    def _page_files(self) -> Iterator[Path]:
        for root in self.roots:
            yield from root.glob(f"*/*/*{SUFFIX}")

    def _remove_stale_tmp(self) -> int:
        """Temporary files of writers that died (their pid is gone) are never pages: remove them."""
        removed = 0
        for root in self.roots:
            for path in root.glob("*/*/.*.tmp"):
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
            self._queue.add(key, size)

    # ---- primitives ----------------------------------------------------------------------------

    def exists_objects(self, keys: Sequence[str]) -> list[bool]:
        return [self.path_of(k).is_file() for k in keys]

    def put_objects(self, keys: Sequence[str], values: Sequence[Sequence[Span]]) -> list[BaseException | None]:
        out: list[BaseException | None] = [None] * len(keys)
        direct: list[tuple[int, _Page]] = []
        buffered: list[tuple[int, Path, Sequence[Span]]] = []
        pending, evicted = frozenset(keys), []
        for i, (key, spans) in enumerate(zip(keys, values)):
            try:
                on_disk = sum(s.nbytes for s in spans) + HEADER_BLOCK - spans[0].nbytes
                evicted += self._make_room(key, on_disk, pending)
            except StorageFull as exc:
                out[i] = exc
                continue
            path = self.path_of(key)
            page = self._direct_page(key, path, spans)
            if page is not None and self._open_write(page):
                direct.append((i, page))
            elif page is not None and page.error is not None:
                out[i] = self._write_outcome(key, page.error)
            else:
                buffered.append((i, path, spans))
        jobs = [lambda a=a: self._write(a[1], a[2], sum(s.nbytes for s in a[2])) for a in buffered]
        done = self._run(self._request_jobs([p for _, p in direct], _pwritev_all) + jobs)
        for (i, _, _), err in zip(buffered, done[len(done) - len(jobs) :]):
            out[i] = self._write_outcome(keys[i], err)
        finished = self._run([lambda p=p: self._finish_write(p) for _, p in direct])
        for (i, page), err in zip(direct, finished):
            if err is False:  # the filesystem refused O_DIRECT after all: buffered, counted
                err = _call(lambda page=page: self._write(page.path, page.spans, sum(s.nbytes for s in page.spans)))
            out[i] = self._write_outcome(keys[i], err)
        if evicted:  # pages of this batch that later ones evicted: written in parallel with them, removed now
            for victim in evicted:
                _unlink(self.path_of(victim))
            self.report_removed(evicted, "evicted")
        return out

    def _write_outcome(self, key: str, err: BaseException | None) -> BaseException | None:
        if err is None:
            return None
        self._forget(key)
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            with self._lock:
                self._refused += 1
            return StorageFull(f"{self.root_of(key)}: {err.strerror}")
        return err

    def get_objects_into(self, keys: Sequence[str], targets: Sequence[Sequence[Span]]) -> list[BaseException | None]:
        out: list[BaseException | None] = [None] * len(keys)
        direct: list[tuple[int, _Page]] = []
        buffered: list[int] = []
        for i, (key, spans) in enumerate(zip(keys, targets)):
            page = self._direct_page(key, self.path_of(key), spans)
            if page is not None and self._open_read(page):
                direct.append((i, page))
            elif page is not None and page.error is not None:
                out[i] = page.error
            else:
                buffered.append(i)
        jobs = [lambda i=i: self._read(self.path_of(keys[i]), targets[i]) for i in buffered]
        done = self._run(self._request_jobs([p for _, p in direct], _preadv_all) + jobs)
        for i, res in zip(buffered, done[len(done) - len(jobs) :]):
            out[i] = res
        for i, page in direct:
            res = self._finish_read(page)
            out[i] = _call(lambda i=i: self._read(self.path_of(keys[i]), targets[i])) if res is False else res
        for i, key in enumerate(keys):
            if isinstance(out[i], FileNotFoundError):
                self._forget(key)
                out[i] = ObjectMissing(key)
        if self.capacity is not None:
            self._queue.touch([key for i, key in enumerate(keys) if out[i] is None])
        return out

    def attach_leases(self, book: LeaseBook) -> str:
        if self.capacity is None:
            return "never"
        book.capacity = self.capacity
        self._queue.attach(book)
        return "ordered"

    def prefetch_objects(self, keys: Sequence[str]) -> int:
        # Into the page cache (readahead): a buffered read is then at memory speed. A direct read bypasses
        # the page cache, so a directory read direct gains nothing and is not counted.
        started = 0
        for key in keys:
            if self.direct_mode != "0" and self.direct_refused.get(self.root_of(key)) is None:
                continue
            try:
                fd = os.open(self.path_of(key), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                started += 1
            finally:
                os.close(fd)
        if self.capacity is not None:
            self._queue.touch([k for k in keys if k in self._queue])
        return started

    def remove_objects(self, keys: Sequence[str]) -> None:
        for key in keys:
            _unlink(self.root_of(key) / "raw" / key.replace("/", "_"))
            path = self.path_of(key)
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            self._forget(key)
            if self.inspect:  # the folders this page emptied go too: an inspection leaves the store as it was
                for folder in (path.parent, path.parent.parent):
                    try:
                        folder.rmdir()
                    except OSError:  # not empty (other pages), or already gone
                        break

    def clear(self) -> None:
        for path in list(self._page_files()):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        with self._lock:
            self._queue.clear()

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def backend_stats(self) -> dict[str, Any]:
        if self.capacity is not None:
            with self._lock:
                objects, used = len(self._queue), self._queue.used
        else:
            sizes = []
            for p in self._page_files():
                try:
                    sizes.append(p.stat().st_size)
                except FileNotFoundError:  # removed while we listed
                    pass
            objects, used = len(sizes), sum(sizes)
        with self._lock:
            fallbacks = dict(self._fallbacks)
            direct, buffered = dict(self._direct), dict(self._buffered)
        return {
            "directory": str(self.root),
            "directories": [str(r) for r in self.roots],
            "objects": objects,
            "used_bytes": used,
            "capacity_bytes": self.capacity,
            "evicted": self._evicted,
            "refused_full": self._refused,
            "stale_tmp_removed": self._cleaned_tmp,
            "fsync": self.fsync,
            "o_direct": {"auto": "auto", "1": True, "0": False}[self.direct_mode],
            "direct_directories": {str(r): self._direct_status(r) for r in self.direct_refused},
            "io_depth": self.io_depth,
            "direct_pages": direct,  # straight between the pool and the drive
            "buffered_pages": buffered,  # through the page cache (o_direct=0, or fallen back under auto)
            "direct_fallbacks": fallbacks,
        }

    def _direct_status(self, root: Path) -> str:
        if root in self._unprobed:
            return "not probed (inspect=1)"
        return self.direct_refused[root] or "O_DIRECT"

    def check_steps(self) -> list[tuple[str, bool, str]]:
        steps = []
        for root in self.roots:
            fs = filesystem_of(root)
            where = f"{fs['fstype']} on {fs['device']} (mounted at {fs['mountpoint']})"
            if self.direct_mode == "0":
                steps.append((f"directory {root}", True, f"{where}; o_direct=0: reads and writes buffered"))
                continue
            why = _probe_direct(root) if hasattr(os, "O_DIRECT") else "no O_DIRECT on this platform"
            if root in self._unprobed:  # the round trip that follows takes the path a server's would
                self._unprobed.discard(root)
                self.direct_refused[root] = why
            detail = f"{where}; takes O_DIRECT" if why is None else f"{where}; refuses O_DIRECT ({why})"
            steps.append((f"directory {root}", why is None or self.direct_mode == "auto", detail))
        steps.append(("read path", True, self.read_path()))
        steps.append(("GPUDirect Storage", True, gds_status()))
        return steps

    def read_path(self) -> str:
        """Which path reads take, and why (for ``hicache storage check``)."""
        if self.direct_mode == "0":
            return "buffered through the page cache (o_direct=0)"
        takes = [r for r, why in self.direct_refused.items() if why is None]
        refuse = [f"{r} ({why})" for r, why in self.direct_refused.items() if why is not None]
        parts = []
        if takes:
            parts.append(
                f"direct (O_DIRECT) straight into the host pool's pages, {self.io_depth} requests of "
                f"{self.request_bytes >> 10} KiB in flight, for pages whose runs are 4 KiB-aligned (checked per "
                f"request; {self._pool_alignment()})"
            )
            other = "an aligned bounce buffer" if self.direct_mode == "1" else "buffered reads"
            parts.append(f"misaligned pages: {other}, counted as direct_fallbacks['{MISALIGNED}']")
        if refuse:
            parts.append("buffered in " + ", ".join(refuse) + f", counted as direct_fallbacks['{EINVAL_FS}']")
        return "; ".join(parts)

    def register_memory(self, spans: Sequence[Span]) -> None:
        self._buffers = [(s.ptr, s.nbytes) for s in spans]

    def _pool_alignment(self) -> str:
        buffers = getattr(self, "_buffers", None)
        if not buffers or self.page_bytes is None:
            return "no host pool bound"
        unaligned = sum(1 for ptr, _ in buffers if ptr % _ALIGN)
        if unaligned:
            return f"{unaligned} of the pool's {len(buffers)} buffers start off a 4 KiB boundary: expect fall backs"
        if self.page_bytes % _ALIGN:
            return f"this pool's page is {self.page_bytes} bytes, not a multiple of 4096: expect fall backs"
        return f"this pool's buffers start 4 KiB-aligned and its page is {self.page_bytes} bytes"

    # ---- the raw client (benchmark ceiling): plain open/write/read of the same bytes ----------

    def raw_put_from(self, keys: Sequence[str], spans: Sequence[Span]) -> None:
        for key, span in zip(keys, spans):
            raw = self.root_of(key) / "raw"
            raw.mkdir(exist_ok=True)
            with open(raw / key.replace("/", "_"), "wb", buffering=0) as f:
                f.write(span.view)

    def raw_get_into(self, keys: Sequence[str], spans: Sequence[Span]) -> None:
        for key, span in zip(keys, spans):
            with open(self.root_of(key) / "raw" / key.replace("/", "_"), "rb", buffering=0) as f:
                if f.readinto(span.view) != span.nbytes:
                    raise StorageError(f"raw read of {key} came up short")

    # ---- capacity ------------------------------------------------------------------------------

    def _make_room(self, key: str, size: int, pending: frozenset[str] = frozenset()) -> list[str]:
        """Reserve ``size`` bytes for ``key``, evicting the least recently used; returns the victims among
        ``pending`` (pages of this batch not written yet), which the caller unlinks once they are."""
        if self.capacity is None:
            return []
        victims = []
        with self._lock:
            if size > self.capacity:
                self._refused += 1
                raise StorageFull(f"a {size}-byte page exceeds the capacity of {self.capacity} bytes")
            self._queue.add(key, size)  # reserved now, so concurrent writers do not overshoot
            victims = self._queue.evict(self._queue.used - self.capacity, skip=(key,))
            self._evicted += len(victims)
        later = [v for v in victims if v in pending]
        victims = [v for v in victims if v not in pending]
        for victim in victims:
            try:
                self.path_of(victim).unlink()
            except FileNotFoundError:
                pass
        self.report_removed(victims, "evicted")
        return later

    def _forget(self, key: str) -> None:
        if self.capacity is None:
            return
        with self._lock:
            self._queue.remove([key])

    # ---- direct I/O: straight between the pool's pages and the drive ----------------------------

    def _fell_back(self, reason: str, pages: int = 1, detail: str = "") -> None:
        with self._lock:
            self._fallbacks[reason] = self._fallbacks.get(reason, 0) + pages
            first = reason not in self._warned
            self._warned.add(reason)
        if first:
            path = "an aligned bounce buffer" if self.direct_mode == "1" else "buffered I/O (the page cache)"
            log.warning("file:// %s: pages fall back from direct I/O to %s: %s%s (counted in "
                        "backend_stats()['direct_fallbacks'][%r]; said once)", self.url.redacted, path, reason,
                        f": {detail}" if detail else "", reason)  # fmt: skip

    def _direct_page(self, key: str, path: Path, spans: Sequence[Span]) -> _Page | None:
        """The page's direct-I/O plan, or ``None`` when it goes another way (the fall back counted)."""
        if not self.o_direct:
            return None
        root = self.root_of(key)
        why = self.direct_refused.get(root)
        if why is not None:
            self._fell_back(why)
            return None
        tail = None
        for i, s in enumerate(spans[1:], 1):
            if s.ptr % _ALIGN == 0 and s.nbytes % _ALIGN == 0:
                continue
            if i == len(spans) - 1 and s.nbytes <= _TAIL_MAX:
                tail = s  # its file offset is aligned: every run before it is
                continue
            self._fell_back(MISALIGNED, 1, f"a run of {s.nbytes} bytes at {s.ptr:#x} (O_DIRECT needs 4 KiB)")
            return None
        size = HEADER_BLOCK + sum(s.nbytes for s in spans[1:])
        page = _Page(key, path, spans, size, tail=tail)
        # One scratch mapping per page (page-aligned, zeroed): the header block, then the tail padded to a block.
        tail_pad = -(-tail.nbytes // _ALIGN) * _ALIGN if tail is not None else 0
        page.scratch = mmap.mmap(-1, HEADER_BLOCK + tail_pad)
        scratch = memoryview(page.scratch)
        views: list[memoryview] = [scratch[:HEADER_BLOCK]]
        offset, start, pending = HEADER_BLOCK, 0, HEADER_BLOCK
        for s in spans[1:]:
            if s is tail:
                break
            view = s.view.cast("B") if s.view.format != "B" else s.view
            at = 0
            while at < s.nbytes:
                n = min(s.nbytes - at, self.request_bytes - pending)
                views.append(view[at : at + n])
                at += n
                pending += n
                offset += n
                if pending >= self.request_bytes:
                    page.requests.append((start, views, pending))
                    views, start, pending = [], offset, 0
        if views:
            page.requests.append((start, views, pending))
        if tail is not None:
            page.requests.append((offset, [scratch[HEADER_BLOCK : HEADER_BLOCK + tail_pad]], tail.nbytes))
        return page

    def _run(self, jobs: list[Callable[[], Any]]) -> list[Any]:
        """Each job's result (or the exception it raised), the jobs run up to ``io_depth`` at once."""
        if len(jobs) <= 1 or self.io_depth == 1:
            return [_call(j) for j in jobs]
        pool = self._executor()
        return [f.result() for f in [pool.submit(_call, j) for j in jobs]]

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.io_depth, thread_name_prefix="hicache-file-io")
            return self._pool

    def _request_jobs(self, pages: list[_Page], op: Callable[[int, list[memoryview], int], int]) -> list[Any]:
        """One job per request of every page: all of a batch's requests go in flight together; each job
        records its failure, or a short transfer, on its page."""

        def job(page: _Page, offset: int, views: list[memoryview], need: int) -> None:
            try:
                n = op(page.fd, views, offset)
            except OSError as exc:
                page.error = page.error or exc
                return
            if n < need and page.error is None:
                page.error = SizeMismatch(f"{page.path.name}: {n} of {need} bytes at offset {offset}")

        return [lambda p=p, r=r: job(p, *r) for p in pages for r in p.requests]

    def _open_read(self, page: _Page) -> bool:
        """Open the page's file for O_DIRECT reading; false (the page's error set, or a counted fall back) if not."""
        try:
            page.fd = os.open(page.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | os.O_DIRECT)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                page.error = self._direct_refused_now(page, exc)
            else:
                page.error = exc
            return False
        size = os.fstat(page.fd).st_size
        if size != page.size:
            self._close(page)
            page.error = SizeMismatch(f"{page.path.name} is {size} bytes, the page takes {page.size}")
            return False
        return True

    def _finish_read(self, page: _Page) -> BaseException | None | bool:
        """The page's outcome once its requests are done; ``False``: refused after all, read it buffered."""
        try:
            err = page.error
            if isinstance(err, OSError) and err.errno == errno.EINVAL:
                refused = self._direct_refused_now(page, err)
                return False if refused is None else refused
            if err is not None:
                return err
            scratch = memoryview(page.scratch)
            page.spans[0].view[:] = scratch[: page.spans[0].nbytes]
            if page.tail is not None:
                page.tail.view[:] = scratch[HEADER_BLOCK : HEADER_BLOCK + page.tail.nbytes]
            del scratch
        finally:
            self._close(page)
        with self._lock:
            self._direct["read"] += 1
        return None

    def _open_write(self, page: _Page) -> bool:
        """Stage the header and tail in the scratch block and open a temporary file with O_DIRECT."""
        scratch = memoryview(page.scratch)
        scratch[: page.spans[0].nbytes] = page.spans[0].view
        if page.tail is not None:
            scratch[HEADER_BLOCK : HEADER_BLOCK + page.tail.nbytes] = page.tail.view
        del scratch
        page.tmp = page.path.with_name(f".{page.path.name}.{os.getpid()}.{threading.get_ident() % 10**6}."
                                       f"{next(_counter)}.tmp")  # fmt: skip
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | os.O_DIRECT
        try:
            try:
                page.fd = os.open(page.tmp, flags, 0o644)
            except FileNotFoundError:
                page.path.parent.mkdir(parents=True, exist_ok=True)
                page.fd = os.open(page.tmp, flags, 0o644)
        except OSError as exc:
            page.error = self._direct_refused_now(page, exc) if exc.errno == errno.EINVAL else exc
            return False
        return True

    def _finish_write(self, page: _Page) -> BaseException | None | bool:
        """Truncate, sync, close and rename the page into place once its requests are done."""
        err = page.error
        try:
            if err is None and page.tail is not None:
                os.ftruncate(page.fd, page.size)
            if err is None and self.fsync:
                os.fsync(page.fd)
        except OSError as exc:
            err = exc
        finally:
            self._close(page)
        if err is not None:
            _unlink(page.tmp)
            if isinstance(err, OSError) and err.errno == errno.EINVAL:
                refused = self._direct_refused_now(page, err)
                return False if refused is None else refused
            return err
        try:
            os.replace(page.tmp, page.path)
        except OSError as exc:
            _unlink(page.tmp)
            return exc
        if self.fsync:
            _fsync_dir(page.path.parent)
        with self._lock:
            self._direct["write"] += 1
        return None

    @staticmethod
    def _close(page: _Page) -> None:
        # The scratch mapping is left to the garbage collector: the request views still export it.
        if page.fd >= 0:
            os.close(page.fd)
            page.fd = -1

    def _direct_refused_now(self, page: _Page, exc: OSError) -> BaseException | None:
        """The filesystem refused an O_DIRECT request the probe let through: an error under ``o_direct=1``;
        under ``auto`` the page falls back (counted) and ``None`` says to go on buffered."""
        if self.direct_mode == "1":
            return StorageError(f"o_direct=1: {page.path.parent} refused an O_DIRECT request ({exc})")
        self._fell_back(EINVAL_FS, 1, f"{page.path}: {exc}")
        return None

    # ---- buffered I/O (o_direct=0, and the fall backs) -----------------------------------------

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
        bounce_direct = self.direct_mode == "1"  # a misaligned page under o_direct=1: still no page cache
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        if bounce_direct:
            flags |= os.O_DIRECT
        fd = os.open(tmp, flags, 0o644)
        try:
            if bounce_direct:
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
            _fsync_dir(path.parent)
        with self._lock:
            self._buffered["write"] += not bounce_direct
            self._direct["write"] += bounce_direct

    def _read(self, path: Path, spans: Sequence[Span]) -> BaseException | None:
        pad = HEADER_BLOCK - spans[0].nbytes
        scratch = getattr(self._local, "pad", None)
        if scratch is None:
            scratch = self._local.pad = bytearray(HEADER_BLOCK)
        spans = [spans[0], Span(0, pad, memoryview(scratch)[:pad]), *spans[1:]]
        total = sum(s.nbytes for s in spans)
        bounce_direct = self.direct_mode == "1"
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | (os.O_DIRECT if bounce_direct else 0)
        fd = os.open(path, flags)
        try:
            size = os.fstat(fd).st_size
            if size != total:
                return SizeMismatch(f"{path.name} is {size} bytes, the page takes {total}")
            if bounce_direct:
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
        with self._lock:
            self._buffered["read"] += not bounce_direct
            self._direct["read"] += bounce_direct
        return None

    def _bounce(self, size: int) -> mmap.mmap:
        """A page-aligned buffer of at least ``size`` bytes, one per thread (O_DIRECT only)."""
        need = max(_ALIGN, -(-size // _ALIGN) * _ALIGN)
        buf = getattr(self._local, "bounce", None)
        if buf is None or len(buf) < need:
            buf = self._local.bounce = mmap.mmap(-1, need)
        return buf


def _direct_mode(value: Any) -> str:
    if str(value).strip().lower() == "auto":
        return "auto"
    return "1" if option_bool(value, "o_direct") else "0"


def _parse_dirs(value: Any) -> list[Path]:
    if value is None or value == "":
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    out = []
    for item in items:
        item = str(item).strip()
        if not item.startswith("/"):
            raise ValueError(f"option dirs takes absolute directory paths separated by commas; got {item!r}")
        out.append(Path(item))
    return out


def _probe_direct(root: Path) -> str | None:
    """``None`` when ``root``'s filesystem takes an O_DIRECT write and read of one aligned block, else why not."""
    probe = root / f".o_direct-probe.{os.getpid()}.{threading.get_ident() % 10**6}.{next(_counter)}"
    block = mmap.mmap(-1, _ALIGN)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as exc:
        block.close()
        if exc.errno == errno.EINVAL:
            return EINVAL_FS
        raise StorageError(f"cannot probe O_DIRECT in {root}: {exc}") from exc
    try:
        os.pwritev(fd, [block], 0)
        os.preadv(fd, [block], 0)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return EINVAL_FS
        raise StorageError(f"cannot probe O_DIRECT in {root}: {exc}") from exc
    finally:
        os.close(fd)
        block.close()
        _unlink(probe)
    return None


def filesystem_of(path: Path | str) -> dict[str, str]:
    """The filesystem type, device and mount point that hold ``path`` (from ``/proc/mounts``)."""
    real = os.path.realpath(path)
    best = {"fstype": "unknown", "device": "unknown", "mountpoint": "/"}
    try:
        lines = open("/proc/mounts").read().splitlines()
    except OSError:
        return best
    length = -1
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= length:
            length = len(mount)
            best = {"fstype": parts[2], "device": parts[0], "mountpoint": mount}
    return best


def gds_status() -> str:
    """Why GPUDirect Storage does not serve this tier's reads on this machine (it is not implemented here)."""
    import ctypes.util
    import glob

    fs, cufile, gpu = glob.glob("/dev/nvidia-fs*"), ctypes.util.find_library("cufile"), glob.glob("/dev/nvidia[0-9]*")
    have = [what for ok, what in ((fs, "the nvidia-fs driver"), (cufile, "libcufile"), (gpu, "an NVIDIA GPU")) if ok]
    lacks = [what for ok, what in ((fs, "nvidia-fs driver (/dev/nvidia-fs* absent)"), (cufile, "libcufile"),
                                   (gpu, "NVIDIA GPU")) if not ok]  # fmt: skip
    machine = "; ".join(part for part in (
        "this machine has " + ", ".join(have) if have else "",
        "it has no " + ", ".join(lacks) if lacks else "") if part)  # fmt: skip
    return f"not used: the file:// tier reads into the host pool, never straight to the GPU; {machine}"


def _call(job: Callable[[], Any]) -> Any:
    try:
        return job()
    except BaseException as exc:  # noqa: BLE001 - each job's failure is its page's outcome
        return exc


def _fsync_dir(directory: Path) -> None:
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _preadv_all(fd: int, views: list[memoryview], offset: int) -> int:
    """Bytes read into ``views`` from ``offset`` (fewer only at the end of the file)."""
    total = 0
    while views:
        n = os.preadv(fd, views[:1024], offset + total)  # IOV_MAX
        if n == 0:
            break
        total += n
        views = _advance(views, n)
    return total


def _pwritev_all(fd: int, views: list[memoryview], offset: int) -> int:
    total = 0
    while views:
        n = os.pwritev(fd, views[:1024], offset + total)
        total += n
        views = _advance(views, n)
    return total


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    views = list(views)
    while n and views:
        if n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        else:
            views[0] = views[0][n:]
            n = 0
    return views


def _mmap_address(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _write_all(fd: int, views: list[memoryview]) -> None:
    views = [v for v in views if len(v)]
    while views:
        views = _advance(views, os.writev(fd, views[:1024]))  # IOV_MAX


def _read_all(fd: int, views: list[memoryview]) -> int:
    views = [v for v in views if len(v)]
    total = 0
    while views:
        n = os.readv(fd, views[:1024])
        if n == 0:
            break
        total += n
        views = _advance(views, n)
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
