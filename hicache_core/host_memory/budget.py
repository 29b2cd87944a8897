"""What a host allocation will take, checked against what the machine lets this process have, before any byte.

A :class:`HostMemoryPlan` is computed from sizes alone (no memory is touched): the bytes asked, the
bytes that will be mapped (each buffer rounded up to one system page) and pinned, and the NUMA node.
:func:`check_fits` refuses a plan that the system's available memory, the process's cgroup or the
reserve cannot hold, naming the bytes, the limit and the setting to change.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..settings import variables
from . import numa
from .limits import MemoryLimits, read_limits
from .mapping import PAGE, huge_pages_offered

_GIB = 1 << 30
_log = logging.getLogger("hicache")


NUMA_NODE = variables.HOST_NUMA_NODE
TOUCH_THREADS = variables.HOST_TOUCH_THREADS
REGISTER_CHUNK_GIB = variables.HOST_REGISTER_CHUNK_GIB
HUGE_PAGES = variables.HOST_HUGE_PAGES
RESERVE_GIB = variables.HOST_RESERVE_GIB
MEMORY_CHECK = variables.HOST_MEMORY_CHECK


class HostMemoryError(ValueError):
    """A host allocation that would not fit, refused before anything is mapped or pinned.

    ``needed`` and ``limit`` are bytes; ``limit_name`` says which limit; the message names the setting.
    """

    def __init__(self, message: str, *, needed: int, limit: int, limit_name: str) -> None:
        super().__init__(message)
        self.needed, self.limit, self.limit_name = needed, limit, limit_name


@dataclass(frozen=True)
class HostMemoryPlan:
    """The host memory one pool (or table, or staging buffer) will take, computed before any is taken.

    ``buffers`` holds ``(name, bytes asked, bytes mapped)``; mapped is asked rounded up to one system page.
    ``node`` is the NUMA node its pages will be placed on (``None``: the kernel's default policy), and
    ``node_reason`` says why.
    """

    label: str
    buffers: tuple[tuple[str, int, int], ...]
    pinned: bool
    node: int | None
    node_reason: str
    huge_pages: bool

    @property
    def asked(self) -> int:
        return sum(b[1] for b in self.buffers)

    @property
    def mapped(self) -> int:
        return sum(b[2] for b in self.buffers)

    @property
    def pinned_bytes(self) -> int:
        """Bytes that will be page-locked (0 where nothing is pinned)."""
        return self.mapped if self.pinned else 0

    def summary(self) -> str:
        """One line: what is asked, what will be held and pinned, and where."""
        held = f"{self.mapped} bytes ({self.mapped / _GIB:.3f} GiB) {'pinned' if self.pinned else 'not pinned'}"
        huge = ", transparent huge pages asked" if self.huge_pages else ""
        return f"{self.label}: {self.asked} bytes asked, {held}; NUMA: {self.node_reason}{huge}"


def plan_host_memory(buffers: Mapping[str, int], *, label: str, pinned: bool,
                     device: torch.device | None = None) -> HostMemoryPlan:  # fmt: skip
    """The plan for ``buffers`` (name -> bytes) of one pool, pinned or not, near ``device`` where it is a GPU."""
    sized = tuple((name, int(n), -(-max(int(n), 1) // PAGE) * PAGE) for name, n in buffers.items())
    node, why = choose_node(device)
    return HostMemoryPlan(label, sized, pinned, node, why, bool(HUGE_PAGES.read()) and huge_pages_offered())


def choose_node(device: torch.device | None) -> tuple[int | None, str]:
    """The NUMA node for host memory serving ``device``, and why (``HICACHE_HOST_NUMA_NODE``).

    A node the kernel will not let this process place pages on (``mbind`` refused: a container's
    seccomp profile without ``CAP_SYS_NICE``) is no node: the plan says so, and pages go where the
    kernel's default policy puts them.
    """
    node, why = _wanted_node(device)
    if node is None:
        return None, why
    refused = numa.placement_refused(node)
    if refused:
        return None, f"not placed on node {node} ({why}): {refused}"
    return node, why


def _wanted_node(device: torch.device | None) -> tuple[int | None, str]:
    asked = NUMA_NODE.read()
    nodes = numa.online_nodes()
    if asked == "none":
        return None, f"not placed ({NUMA_NODE.name}=none)"
    if isinstance(asked, int):
        if asked not in nodes:
            raise ValueError(f"{NUMA_NODE.name}={asked}: this machine's nodes with memory are {nodes}")
        return asked, f"node {asked} ({NUMA_NODE.name}={asked})"
    if len(nodes) == 1:
        return None, f"one node ({nodes[0]}) on this machine: nothing to place"
    if device is None or device.type != "cuda":
        return None, "a CPU pool: the kernel's default policy (set HICACHE_HOST_NUMA_NODE=N to place it)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    node, why = numa.gpu_node(index)
    return (node, why) if node is not None else (None, f"not placed: {why}")


def check_fits(plan: HostMemoryPlan, limits: MemoryLimits | None = None) -> None:
    """Refuse ``plan`` when the memory it will hold, plus ``HICACHE_HOST_RESERVE_GIB``, is not free.

    Pinned pages can be neither swapped nor reclaimed, so what counts is the available memory
    (``MemAvailable``) and the cgroup's room, whichever is smaller (:meth:`MemoryLimits.bound`).
    ``RLIMIT_MEMLOCK`` does not bound CUDA's registration (the driver pins without charging it); it bounds
    RDMA registrations, which :func:`check_lockable` checks. ``HICACHE_HOST_MEMORY_CHECK=0`` turns the
    refusal into a warning, for memory this check cannot see is free.

    :raises HostMemoryError: it would not fit.
    """
    refused = fit_refusal(plan, limits)
    if refused is None:
        return
    if not MEMORY_CHECK.read():
        _log.warning("%s; built all the same (%s=0)", refused, MEMORY_CHECK.name)
        return
    raise refused


def fit_refusal(plan: HostMemoryPlan, limits: MemoryLimits | None = None, *, pending: int = 0,
                pending_by: str = "") -> HostMemoryError | None:  # fmt: skip
    """The refusal :func:`check_fits` raises for ``plan``, whatever ``HICACHE_HOST_MEMORY_CHECK`` says, or ``None``.

    ``pending``: bytes other processes reserved and have not touched yet (:mod:`.reservations`), held by
    ``pending_by`` (for the message); they are taken off the room.
    """
    limits = limits or read_limits()
    reserve = int(RESERVE_GIB.read() * _GIB)
    room, which = limits.bound()
    if plan.mapped + reserve <= room - pending:
        return None
    keep = f" and keep {reserve} bytes free ({RESERVE_GIB.name})" if reserve else ""
    others = (f", and processes building host pools on this host reserved {pending} bytes of it that they have "
              f"not touched yet ({pending_by})") if pending else ""  # fmt: skip
    return HostMemoryError(
        f"{plan.label} would not fit: it needs {plan.mapped} bytes ({plan.mapped / _GIB:.2f} GiB"
        f"{', pinned' if plan.pinned else ''}){keep}, but {which} leaves {room} bytes ({room / _GIB:.2f} GiB)"
        f"{others}. "
        "Nothing was allocated. Ask for a smaller host pool (SGLang: --hicache-size or --hicache-ratio; vLLM: "
        f"cpu_bytes_to_use){', or lower ' + RESERVE_GIB.name if reserve else ''}; `hicache size` shows what fits. "
        f"If you know the memory is there all the same (this check counts active file cache as used), "
        f"{MEMORY_CHECK.name}=0 builds the pool anyway, with a warning.",
        needed=plan.mapped + reserve, limit=room - pending, limit_name=which,
    )  # fmt: skip


def check_lockable(nbytes: int, what: str, limits: MemoryLimits | None = None) -> None:
    """Refuse registering ``nbytes`` for RDMA when ``RLIMIT_MEMLOCK`` is smaller (the NIC driver enforces it).

    :raises HostMemoryError: the locked-memory limit is below ``nbytes``.
    """
    limits = limits or read_limits()
    if limits.memlock is not None and nbytes > limits.memlock:
        raise HostMemoryError(
            f"{what} would lock {nbytes} bytes for RDMA, over this process's locked-memory limit (RLIMIT_MEMLOCK, "
            f"{limits.memlock} bytes). Raise it: `ulimit -l unlimited`, systemd LimitMEMLOCK=infinity, or docker "
            "--ulimit memlock=-1.",
            needed=nbytes, limit=limits.memlock, limit_name="RLIMIT_MEMLOCK",
        )  # fmt: skip


def touch_threads() -> int:
    """Threads that first-touch new host memory: ``HICACHE_HOST_TOUCH_THREADS``, else the usable CPUs, at most 32."""
    asked = TOUCH_THREADS.read()
    return asked if asked is not None else max(1, min(32, len(os.sched_getaffinity(0))))
