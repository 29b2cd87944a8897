"""Host memory a server can give: exact sizes, placed near the GPU, pinned fast, counted, checked first.

Every host buffer hicache pins goes through here: a pool's buffers (:func:`allocate`), its checksum
table and drop word, staging buffers (:func:`host_tensor`). Each is planned from its sizes
(:func:`plan_host_memory`), refused before any byte is taken when it would not fit (:func:`check_fits`),
reserved on this host until its pages exist, so that ranks building pools at once cannot overcommit it
together (:mod:`.reservations`), then mapped at its exact size (:mod:`.mapping`).
:func:`pinned_bytes_by_label` is what the ``hicache_host_pinned_bytes`` metric reads. Without CUDA the
same code runs without pinning.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from .budget import (
    HUGE_PAGES,
    MEMORY_CHECK,
    NUMA_NODE,
    REGISTER_CHUNK_GIB,
    RESERVE_GIB,
    TOUCH_THREADS,
    HostMemoryError,
    HostMemoryPlan,
    check_fits,
    check_lockable,
    choose_node,
    fit_refusal,
    plan_host_memory,
    touch_threads,
)
from .limits import MemoryLimits, read_limits
from .mapping import MappingRecord, live_records, map_host_memory
from .reservations import reserve

__all__ = [
    "HUGE_PAGES", "MEMORY_CHECK", "NUMA_NODE", "REGISTER_CHUNK_GIB", "RESERVE_GIB", "TOUCH_THREADS",
    "HostMemoryError", "HostMemoryPlan", "MappingRecord", "MemoryLimits", "allocate", "check_fits", "check_lockable",
    "choose_node", "fit_refusal", "host_tensor", "live_records", "pinned_bytes_by_label", "plan_host_memory",
    "read_limits", "reserve", "touch_threads",
]  # fmt: skip


def allocate(plan: HostMemoryPlan, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], *,
             granules: Mapping[str, int] | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """Map every buffer of ``plan`` at its exact size, shaped as ``shapes`` says; zero-filled.

    Call :func:`check_fits` first. The plan is checked again as it is reserved on this host (:func:`reserve`:
    it may wait there for other processes' pools), and its reservation ends as each buffer's pages exist.
    ``granules`` (bytes) keeps each CUDA registration chunk of a buffer on whole granules (a host page of the
    layout), so one copy never spans two registrations. On failure, buffers already mapped are released
    before the error propagates.
    """
    chunk = int(REGISTER_CHUNK_GIB.read() * (1 << 30))
    threads = touch_threads()
    out: dict[str, torch.Tensor] = {}
    for name, asked, _mapped in plan.buffers:
        shape, dtype = shapes[name]
        expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if expected != asked:
            raise ValueError(f"{plan.label}: buffer {name!r} of shape {shape} {dtype} holds {expected} bytes, "
                             f"the plan {asked}")  # fmt: skip
    with reserve(plan) as reservation:
        for name, asked, _mapped in plan.buffers:
            shape, dtype = shapes[name]
            raw, _record = map_host_memory(asked, label=f"{plan.label}: {name}", pin=plan.pinned, node=plan.node,
                                           huge_pages=plan.huge_pages, touch_threads=threads, chunk_bytes=chunk,
                                           granule=(granules or {}).get(name, 1),
                                           touched=reservation.touched)  # fmt: skip
            out[name] = raw.view(dtype).view(shape)
    return out


def host_tensor(shape: tuple[int, ...], dtype: torch.dtype, *, label: str, name: str, pinned: bool,
                device: torch.device | None = None, fill: float | int | None = None) -> torch.Tensor:  # fmt: skip
    """One checked, exact-size host tensor (a table, a word, a staging buffer): planned, checked, mapped.

    ``label`` names what it belongs to (the pool's label: the metric sums per label), ``name`` what it is.
    Zero-filled, or ``fill``. :raises HostMemoryError: it would not fit.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    plan = plan_host_memory({name: nbytes}, label=label, pinned=pinned, device=device)
    check_fits(plan)
    tensor = allocate(plan, {name: (tuple(shape), dtype)})[name]
    if fill is not None and fill != 0:
        tensor.fill_(fill)
    return tensor


def pinned_bytes_by_label() -> dict[str, int]:
    """Pinned bytes of every live host mapping of this process, summed per pool label."""
    out: dict[str, int] = {}
    for record in live_records():
        pool = record.label.rsplit(": ", 1)[0]
        out[pool] = out.get(pool, 0) + record.pinned_bytes
    return out
