"""The stored form of a page: an 80-byte header, then the payload.

Every object hicache writes is self-describing, so a reader never trusts a store to
hand back the bytes that were put under a key::

    offset size field
         0    4 magic b"HICP"
         4    2 format version (2)
         6    2 header size (80; a backend may pad, e.g. to 4096 for O_DIRECT, and say so here)
         8    2 checksum algorithm (1 = XXH3-64, seed 0, of the payload and checksum row;
                  2 = XXH3-64 of the checksum row only: the payload is checked on the device;
                  3 = keyed: a MAC with the cluster's key, see below)
        10    2 verification words after the payload (0, or the pool's checksum table row)
        12    8 payload bytes
        20    8 payload checksum (algorithm 3: the id of the cluster key that wrote it)
        28   16 geometry fingerprint (the namespace's, raw bytes)
        44   32 SHA-256 of the object key (namespace and page hash) (algorithm 3: the MAC tag)
        76    4 CRC-32 of bytes 0..75 (the header's own check)

All integers little-endian. The payload is the page in the host pool's flat order
(``get_data_page(i, flat=True)``): host buffer by buffer, each page view in memory order.
A pool with host-tier verification (:mod:`hicache_core.verification.verify`) stores after the payload its
checksum table row for the page (the checksums taken on the device at backup, int64 each), and
the payload checksum covers payload and row, so a prefetched page is checked on the device
against the checksums of its original backup. Such a pool writes algorithm 2 by default: the host
hashes only the row, and the payload is verified where it is used, on the device after each load
(``HICACHE_L3_HOST_CHECK=1`` writes algorithm 1, hashed on the host as well). Version 1 (no such
field) reads as a mismatch.

A store with the cluster's key (:mod:`hicache_core.storage.page_auth`) writes algorithm 3: the tag is
keyed BLAKE3 over header bytes 0..43 (:data:`MAC_HEADER_BYTES`, the key id included), the full object
key (length-prefixed) and the payload with its checksum row; it replaces both the unkeyed checksum
and the key digest, which anyone could recompute. Unkeyed pages are written as before.

XXH3-64 is the payload checksum because it is the one fast enough to sit on the I/O path
(docs/storage-checksums.md has the comparison). It comes from the ``xxhash`` package; the
system's libxxhash through ctypes is the fallback. Both give the same digest.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..settings.variables import L3_HASH_THREADS

MAGIC = b"HICP"
FORMAT_VERSION = 2
HEADER_SIZE = 80
CHECKSUM_XXH3_64 = 1
CHECKSUM_DEVICE = 2
CHECKSUM_KEYED = 3
ALGORITHMS = (CHECKSUM_XXH3_64, CHECKSUM_DEVICE, CHECKSUM_KEYED)
#: Header bytes a keyed page's tag covers: everything before the tag's own field.
MAC_HEADER_BYTES = 44
#: Where a keyed page's header keeps the id of the key that wrote it (the checksum field).
KEY_ID_AT = slice(20, 28)
_BODY = struct.Struct("<4sHHHHQQ16s32s")  # 76 bytes, then the CRC-32
assert _BODY.size == HEADER_SIZE - 4


@dataclass(frozen=True)
class PageHeader:
    """A decoded header (see the module docstring for the bytes)."""

    version: int
    header_size: int
    checksum_algorithm: int
    payload_bytes: int
    checksum: int
    fingerprint: bytes
    key_digest: bytes
    verify_words: int = 0

    @property
    def keyed(self) -> bool:
        """Written with a cluster key (algorithm 3): :attr:`key_digest` holds the MAC tag."""
        return self.checksum_algorithm == CHECKSUM_KEYED

    @property
    def key_id(self) -> bytes:
        """The id of the cluster key a keyed page was written with (empty for an unkeyed page)."""
        return self.checksum.to_bytes(KEY_ID_AT.stop - KEY_ID_AT.start, "little") if self.keyed else b""


class HeaderError(ValueError):
    """The bytes are not a hicache page header (bad magic, version or header CRC)."""


class VersionError(HeaderError):
    """A sound hicache header of another format version (a mismatch, not corruption)."""


def pack_header(
    *,
    payload_bytes: int,
    checksum: int,
    fingerprint: bytes,
    key_digest: bytes,
    header_size: int = HEADER_SIZE,
    verify_words: int = 0,
    algorithm: int = CHECKSUM_XXH3_64,
) -> bytes:
    """The 80 header bytes (callers pad to ``header_size`` themselves)."""
    if algorithm not in ALGORITHMS or (algorithm == CHECKSUM_DEVICE and not verify_words):
        raise ValueError(f"checksum algorithm {algorithm} (device-checked pages need a checksum row)")
    body = _BODY.pack(
        MAGIC, FORMAT_VERSION, header_size, algorithm, verify_words, payload_bytes, checksum, fingerprint,
        key_digest,
    )  # fmt: skip
    return body + struct.pack("<I", zlib.crc32(body))


def stored_algorithm(header: bytes | bytearray | memoryview) -> int:
    """The checksum algorithm field of header bytes, unchecked (to know what to hash before the header is checked)."""
    return struct.unpack_from("<H", header, 8)[0] if len(header) >= 10 else 0


def unpack_header(data: bytes | bytearray | memoryview) -> PageHeader:
    """Decode and self-check a header; raise :class:`HeaderError` on anything wrong."""
    data = memoryview(data)
    if len(data) < HEADER_SIZE:
        raise HeaderError(f"object is {len(data)} bytes, shorter than a {HEADER_SIZE}-byte page header")
    body = bytes(data[: HEADER_SIZE - 4])
    magic, version, size, algo, words, payload, checksum, fp, key_digest = _BODY.unpack(body)
    if magic != MAGIC:
        raise HeaderError(f"bad magic {magic!r} (not a hicache page)")
    (crc,) = struct.unpack("<I", data[HEADER_SIZE - 4 : HEADER_SIZE])
    if crc != zlib.crc32(body):
        raise HeaderError("header CRC mismatch (the header itself is corrupted)")
    if version != FORMAT_VERSION:
        raise VersionError(f"page format version {version}, this hicache reads version {FORMAT_VERSION}")
    if algo not in ALGORITHMS or (algo == CHECKSUM_DEVICE and not words):
        raise HeaderError(f"unknown checksum algorithm {algo}")
    if size < HEADER_SIZE:
        raise HeaderError(f"header size {size} < {HEADER_SIZE}")
    return PageHeader(version, size, algo, payload, checksum, fp, key_digest, words)


# ---- XXH3-64 over a list of memory runs --------------------------------------------------------


def _load_libxxhash():
    for name in (ctypes.util.find_library("xxhash"), "libxxhash.so.0", "libxxhash.dylib"):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
            lib.XXH3_64bits.restype = ctypes.c_uint64
            lib.XXH3_64bits.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            lib.XXH3_createState.restype = ctypes.c_void_p
            lib.XXH3_freeState.argtypes = [ctypes.c_void_p]
            lib.XXH3_64bits_reset.argtypes = [ctypes.c_void_p]
            lib.XXH3_64bits_update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
            lib.XXH3_64bits_digest.restype = ctypes.c_uint64
            lib.XXH3_64bits_digest.argtypes = [ctypes.c_void_p]
            return lib
        except (OSError, AttributeError):
            continue
    return None


_LIB = _load_libxxhash()


try:
    import xxhash as _xxhash
except ImportError:  # hicache-core depends on xxhash; the fallback serves stripped installs
    _xxhash = None

_EMPTY = 0x2D06800538D394C2  # XXH3-64 of zero bytes, seed 0


def checksum_runs(runs: Sequence[tuple[int, int]]) -> int:
    """XXH3-64 (seed 0) of the concatenation of memory runs ``(address, nbytes)``."""
    if _xxhash is not None:
        if len(runs) == 1:
            ptr, n = runs[0]
            return _xxhash.xxh3_64_intdigest((ctypes.c_char * n).from_address(ptr)) if n else _EMPTY
        h = _xxhash.xxh3_64()
        for ptr, n in runs:
            if n:
                h.update((ctypes.c_char * n).from_address(ptr))
        return h.intdigest()
    if _LIB is not None:
        if len(runs) == 1:
            return int(_LIB.XXH3_64bits(runs[0][0], runs[0][1]))
        state = _LIB.XXH3_createState()
        try:
            _LIB.XXH3_64bits_reset(state)
            for ptr, n in runs:
                _LIB.XXH3_64bits_update(state, ptr, n)
            return int(_LIB.XXH3_64bits_digest(state))
        finally:
            _LIB.XXH3_freeState(state)
    raise RuntimeError("no XXH3 implementation: pip install xxhash (hicache-core depends on it)")


def checksum_bytes(data: bytes | bytearray | memoryview) -> int:
    """XXH3-64 of a buffer (tests and tools)."""
    view = memoryview(data).cast("B")
    if not len(view):
        return checksum_runs([(0, 0)])
    return checksum_runs([(address_of(view), len(view))])


def address_of(buffer: bytes | bytearray | memoryview) -> int:
    """The address of a contiguous buffer's first byte, without copying it."""
    if isinstance(buffer, bytes):
        return ctypes.cast(ctypes.c_char_p(buffer), ctypes.c_void_p).value or 0
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError("buffer is not contiguous")
    if view.readonly:
        obj = view.obj
        if isinstance(obj, bytes) and view.nbytes == len(obj):
            return address_of(obj)
        import numpy as np  # a read-only view into something else: numpy knows its address

        return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
    return ctypes.addressof(ctypes.c_char.from_buffer(view.cast("B")))


# ---- the checksums of a batch's pages, on several threads ----------------------------------------


def checksum_threads() -> int:
    """Threads that checksum a batch's pages at once (``HICACHE_L3_HASH_THREADS``; default the cores, at most 8)."""
    asked = L3_HASH_THREADS.read()
    return asked if asked is not None else max(1, min(8, os.cpu_count() or 1))


_HASHERS: Any = None
_HASHERS_LOCK = threading.Lock()


def parallel_checksums(pages: list[list[tuple[int, int]]], threads: int | None = None) -> list[int]:
    """The payload checksum of each page (its runs), pages spread over ``threads`` (default :func:`checksum_threads`).

    XXH3 releases the GIL while it hashes, so the pages of a batch are checksummed on several
    cores at once. An empty run list gives 0 (nothing to check).
    """
    return parallel_map(lambda r: checksum_runs(r) if r else 0, pages, threads)


def parallel_map(fn: Callable[[Any], Any], items: Sequence[Any], threads: int | None = None) -> list[Any]:
    """``[fn(x) for x in items]``, spread over ``threads`` (default :func:`checksum_threads`) of one shared pool.

    For hashes that release the GIL (XXH3, BLAKE3): a batch's pages are hashed on several cores. The
    items go in ``threads`` contiguous groups, the first on the calling thread: one hand-off per
    thread, not per page (a hand-off cost 8 us here, hashing a 64 KiB page with BLAKE3 11 us).
    """
    global _HASHERS
    threads = checksum_threads() if threads is None else threads
    n = len(items)
    if n < 2 or threads == 1:
        return [fn(x) for x in items]
    with _HASHERS_LOCK:
        if _HASHERS is None:
            from concurrent.futures import ThreadPoolExecutor

            _HASHERS = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hicache-l3-hash")
    groups = min(threads, n)
    bounds = [n * g // groups for g in range(groups + 1)]
    pending = [_HASHERS.submit(lambda a, b: [fn(items[i]) for i in range(a, b)], bounds[g], bounds[g + 1])
               for g in range(1, groups)]  # fmt: skip
    out = [fn(items[i]) for i in range(bounds[0], bounds[1])]
    for future in pending:
        out += future.result()
    return out


def hashed_runs(runs: list[tuple[int, int]], size: int, device_checked: bool) -> list[tuple[int, int]]:
    """What the store's checksum covers: payload and checksum row, or only the row of a device-checked page."""
    if device_checked and sum(n for _, n in runs) > size:
        return runs[-1:]  # the row is the last run (PageMap.object_spans)
    return runs


def row_of(runs: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The bytes after the first ``size`` bytes of ``runs`` (the checksum row after the payload)."""
    out, skip = [], size
    for ptr, n in runs:
        if skip >= n:
            skip -= n
            continue
        out.append((ptr + skip, n - skip))
        skip = 0
    return out
