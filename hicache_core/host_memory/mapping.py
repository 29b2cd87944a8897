"""Exact-size host memory: anonymous pages mapped at the size asked, placed, touched, then pinned.

torch's pinned allocator rounds every block up to a power of two before pinning it (a 40 GiB pool
pins 64 GiB). A :class:`HostMapping` maps exactly the bytes asked, rounded up to one system page; asks
for transparent huge pages where the system offers them on request; prefers the NUMA node it is given
(before the first touch, so pages are born there); zeroes the pages from several threads (first touch
is what makes the kernel allocate, and one thread is the bottleneck of a large pool); and registers them
with CUDA in chunks (one registration call fails at a few hundred GiB), each chunk ending on a whole
``granule`` so that no copy of one granule spans two registrations. The mapping lives as long as any
tensor over it: the last one to go unregisters and unmaps it, so nothing stays pinned.

Every mapping is left out of children made by ``fork()`` (``MADV_DONTFORK``): without it a fork copies
the page tables of the whole pool, and the kernel copies every pinned page into the child at once
(docs/host-memory.md has the figures). A child that touches a host pool's address range gets
``SIGSEGV``: build host pools in the process that uses them. In a child forked by Python (``os.fork``,
multiprocessing's ``fork``) each such range is held by an inaccessible placeholder, so that the parent's
mapping objects, when the child drops them, unmap the placeholder and not memory the child mapped since.
Where the platform has no ``MADV_DONTFORK`` a warning says so once, and the records say ``dontfork=False``.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from . import numa

PAGE = mmap.PAGESIZE
_HUGE_PAGES_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
_PROT_NONE = 0
_MAP_FIXED_NOREPLACE = 0x100000  # Linux >= 4.17; older kernels take the address as a hint, checked below
_log = logging.getLogger("hicache")


@dataclass
class MappingRecord:
    """What one mapping asked for and what it took (live records: :func:`live_records`).

    ``placement`` maps a NUMA node to how many sampled pages live there. ``dontfork``: children made by
    ``fork()`` do not get it (``MADV_DONTFORK``); ``False`` where the platform could not say so.
    """

    label: str
    asked: int
    mapped: int
    pinned: bool
    node: int | None
    huge_pages: bool
    chunks: int = 0
    dontfork: bool = False
    placement: dict[int, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def pinned_bytes(self) -> int:
        return self.mapped if self.pinned else 0


_LIVE: dict[int, MappingRecord] = {}
_LIVE_LOCK = threading.Lock()
_MAPPINGS: weakref.WeakSet[HostMapping] = weakref.WeakSet()
_WARNED: set[str] = set()


def live_records() -> list[MappingRecord]:
    """Every host mapping of this process still alive (their memory is held, and pinned where said)."""
    with _LIVE_LOCK:
        return list(_LIVE.values())


def huge_pages_offered() -> bool:
    """Whether transparent huge pages are given to mappings that ask (``always`` or ``madvise``)."""
    try:
        with open(_HUGE_PAGES_MODE) as f:
            mode = f.read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


class HostMapping(mmap.mmap):
    """An anonymous private mapping whose last reference unregisters it from CUDA before it is unmapped.

    Built by :func:`map_host_memory`; the tensors over it (``torch.frombuffer``) hold it.
    """

    record: MappingRecord
    _address: int
    _registered: list[int]
    _unregister: object

    def __del__(self) -> None:
        # Runs before mmap's own deallocation unmaps the pages: CUDA must let go of them first.
        for address in getattr(self, "_registered", ()):
            try:
                self._unregister(address)  # type: ignore[operator]
            except Exception:  # interpreter shutdown: the driver releases a dying process's pins itself
                pass
        self._registered = []
        with _LIVE_LOCK:
            _LIVE.pop(id(self), None)


def map_host_memory(nbytes: int, *, label: str, pin: bool, node: int | None, huge_pages: bool, touch_threads: int,
                    chunk_bytes: int, granule: int,
                    touched: Callable[[int], None] | None = None) -> tuple[torch.Tensor, MappingRecord]:  # fmt: skip
    """A ``uint8`` tensor of exactly ``nbytes`` over a new mapping, and the mapping's record.

    :param pin: register the pages with CUDA (page-locked, reachable from the GPU through UVA).
    :param node: the NUMA node to prefer, or ``None`` for the kernel's default policy.
    :param granule: registration chunks end on a multiple of these bytes from the start.
    :param touched: called with the bytes mapped once every page exists (before pinning).
    :raises OSError: the mapping or the placement failed; :raises RuntimeError: CUDA refused to register.
    Nothing is left mapped or registered when it raises.
    """
    mapped = -(-max(nbytes, 1) // PAGE) * PAGE
    record = MappingRecord(label, nbytes, mapped, pin, node, huge_pages)
    mapping = HostMapping(-1, mapped, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                          prot=mmap.PROT_READ | mmap.PROT_WRITE)  # fmt: skip
    mapping._registered = []
    mapping.record = record
    tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=mapped)
    mapping._address = tensor.data_ptr()
    _MAPPINGS.add(mapping)
    try:
        _prepare(mapping, tensor.data_ptr(), record, touch_threads, chunk_bytes, granule, touched)
    except BaseException:
        del tensor, mapping  # the last references: unregistered (nothing was left registered) and unmapped now
        raise
    with _LIVE_LOCK:
        _LIVE[id(mapping)] = record
    return tensor[:nbytes], record


def _prepare(mapping: HostMapping, address: int, record: MappingRecord, touch_threads: int, chunk_bytes: int,
             granule: int, touched: Callable[[int], None] | None) -> None:  # fmt: skip
    start = time.perf_counter()
    _leave_out_of_children(mapping, record)
    if record.huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    if record.node is not None:
        numa.prefer_node(address, record.mapped, record.node)
    _touch(address, record.mapped, touch_threads)
    record.seconds["touch"] = time.perf_counter() - start
    if touched is not None:
        touched(record.mapped)
    if record.pinned:
        start = time.perf_counter()
        _register(mapping, address, record.mapped, chunk_bytes, granule)
        record.chunks = len(mapping._registered)
        record.seconds["register"] = time.perf_counter() - start
    record.placement = numa.nodes_of(address, record.mapped)


def _leave_out_of_children(mapping: HostMapping, record: MappingRecord) -> None:
    advice = getattr(mmap, "MADV_DONTFORK", None)
    if advice is None:
        _warn_inherited("this platform has no MADV_DONTFORK")
        return
    try:
        mapping.madvise(advice)
    except OSError as exc:
        _warn_inherited(f"madvise(MADV_DONTFORK) failed: {exc}")
        return
    record.dontfork = True


def _warn_inherited(why: str) -> None:
    if why not in _WARNED:
        _WARNED.add(why)
        _log.warning("host memory is inherited by children made by fork() (%s): each fork copies page tables of "
                     "every host pool, and pinned pages in full. Start child processes with spawn, or before the "
                     "host pools are built", why)  # fmt: skip


def _after_fork_in_child() -> None:
    """The child holds none of the parent's host mappings that ``fork()`` left out, nor any CUDA registration."""
    global _LIVE_LOCK
    _LIVE_LOCK = threading.Lock()  # a parent thread may have held it at the fork; that thread is not here
    for mapping in list(_MAPPINGS):
        mapping._registered = []
        if mapping.record.dontfork and not mapping.closed:
            _LIVE.pop(id(mapping), None)
            _hold_range(mapping._address, len(mapping))


def _hold_range(address: int, length: int) -> None:
    """Map ``[address, address + length)`` inaccessible and unbacked, where nothing is mapped there now."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    got = libc.mmap(address, length, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED_NOREPLACE, -1, 0)
    if got is not None and got != address and got != ctypes.c_void_p(-1).value:
        libc.munmap(got, length)  # a kernel that took the address as a hint put it elsewhere: not a placeholder


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _touch(address: int, length: int, threads: int) -> None:
    """Zero the range from ``threads`` threads (ctypes releases the GIL), so its pages exist before pinning."""
    step = max(PAGE, -(-length // max(1, threads) // PAGE) * PAGE)
    spans = [(a, min(step, address + length - a)) for a in range(address, address + length, step)]
    if len(spans) == 1:
        ctypes.memset(spans[0][0], 0, spans[0][1])
        return
    with ThreadPoolExecutor(len(spans), thread_name_prefix="hicache-touch") as pool:
        list(pool.map(lambda span: ctypes.memset(span[0], 0, span[1]), spans))


def _register(mapping: HostMapping, address: int, length: int, chunk_bytes: int, granule: int) -> None:
    cudart = torch.cuda.cudart()
    mapping._unregister = cudart.cudaHostUnregister
    chunk = max(granule, chunk_bytes // max(1, granule) * max(1, granule))
    for offset in range(0, length, chunk):
        size = min(chunk, length - offset)
        err = cudart.cudaHostRegister(address + offset, size, 0)
        if int(err) != 0:
            why = cudart.cudaGetErrorString(err) if hasattr(cudart, "cudaGetErrorString") else f"error {int(err)}"
            for done in mapping._registered:
                cudart.cudaHostUnregister(done)
            mapping._registered = []
            raise RuntimeError(f"cudaHostRegister of {size} bytes at offset {offset} failed: {why}")
        mapping._registered.append(address + offset)
