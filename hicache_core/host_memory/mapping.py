"""Exact-size host memory: anonymous pages mapped at the size asked, placed, touched, then pinned.

torch's pinned allocator rounds every block up to a power of two before pinning it (a 40 GiB pool
pins 64 GiB). A :class:`HostMapping` maps exactly the bytes asked, rounded up to one system page; asks
for transparent huge pages where the system offers them on request; prefers the NUMA node it is given
(before the first touch, so pages are born there); zeroes the pages from several threads (first touch
is what makes the kernel allocate, and one thread is the bottleneck of a large pool); and registers them
with CUDA in chunks (one registration call fails at a few hundred GiB), each chunk ending on a whole
``granule`` so that no copy of one granule spans two registrations. The mapping lives as long as any
tensor over it: the last one to go unregisters and unmaps it, so nothing stays pinned.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from . import numa

PAGE = mmap.PAGESIZE
_HUGE_PAGES_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


@dataclass
class MappingRecord:
    """What one mapping asked for and what it took (live records: :func:`live_records`).

    ``placement`` maps a NUMA node to how many sampled pages live there.
    """

    label: str
    asked: int
    mapped: int
    pinned: bool
    node: int | None
    huge_pages: bool
    chunks: int = 0
    placement: dict[int, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def pinned_bytes(self) -> int:
        return self.mapped if self.pinned else 0


_LIVE: dict[int, MappingRecord] = {}
_LIVE_LOCK = threading.Lock()


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
                    chunk_bytes: int, granule: int) -> tuple[torch.Tensor, MappingRecord]:  # fmt: skip
    """A ``uint8`` tensor of exactly ``nbytes`` over a new mapping, and the mapping's record.

    :param pin: register the pages with CUDA (page-locked, reachable from the GPU through UVA).
    :param node: the NUMA node to prefer, or ``None`` for the kernel's default policy.
    :param granule: registration chunks end on a multiple of these bytes from the start.
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
    try:
        _prepare(mapping, tensor.data_ptr(), record, touch_threads, chunk_bytes, granule)
    except BaseException:
        del tensor, mapping  # the last references: unregistered (nothing was left registered) and unmapped now
        raise
    with _LIVE_LOCK:
        _LIVE[id(mapping)] = record
    return tensor[:nbytes], record


def _prepare(mapping: HostMapping, address: int, record: MappingRecord, touch_threads: int, chunk_bytes: int,
             granule: int) -> None:  # fmt: skip
    start = time.perf_counter()
    if record.huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    if record.node is not None:
        numa.prefer_node(address, record.mapped, record.node)
    _touch(address, record.mapped, touch_threads)
    record.seconds["touch"] = time.perf_counter() - start
    if record.pinned:
        start = time.perf_counter()
        _register(mapping, address, record.mapped, chunk_bytes, granule)
        record.chunks = len(mapping._registered)
        record.seconds["register"] = time.perf_counter() - start
    record.placement = numa.nodes_of(address, record.mapped)


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
