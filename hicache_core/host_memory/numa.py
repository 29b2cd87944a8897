"""NUMA: which node a GPU hangs off, placing a mapping's pages there, and reading where they went.

Placement is the kernel's ``mbind`` with ``MPOL_PREFERRED`` (set before the first touch, so pages are
born on the node; preferred, not bound, so a full node spills to another instead of failing the pool),
and ``move_pages`` with no target reads back the node of sampled pages. Both are system calls that
libnuma only wraps; calling them directly spares servers a system package.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from pathlib import Path

_MPOL_PREFERRED = 1
# (mbind, move_pages) system call numbers, per machine; elsewhere placement is not offered, and said so.
_SYSCALLS = {"x86_64": (237, 279), "aarch64": (235, 239)}
_NODES = Path("/sys/devices/system/node")


def online_nodes() -> list[int]:
    """The NUMA nodes with memory that this machine has online (``[0]`` where it does not say)."""
    try:
        text = (_NODES / "has_memory").read_text().strip() or (_NODES / "online").read_text().strip()
    except OSError:
        return [0]
    nodes: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        nodes.extend(range(int(lo), int(hi or lo) + 1))
    return nodes or [0]


def gpu_node(device_index: int) -> tuple[int | None, str]:
    """The NUMA node nearest CUDA device ``device_index``, or ``None`` with the reason."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None, "torch does not say the GPU's PCI address"
    address = f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
    try:
        node = int(Path(f"/sys/bus/pci/devices/{address}/numa_node").read_text())
    except (OSError, ValueError):
        return None, f"/sys/bus/pci/devices/{address}/numa_node is not readable"
    if node < 0:
        return None, f"the system gives GPU {device_index} ({address}) no NUMA node"
    return node, f"GPU {device_index} ({address}) is on node {node}"


def _syscall():
    calls = _SYSCALLS.get(platform.machine())
    if calls is None:
        return None, None
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.syscall
    fn.restype = ctypes.c_long
    return fn, calls


def prefer_node(address: int, length: int, node: int) -> None:
    """Ask the kernel to place the pages of ``[address, address + length)`` on ``node`` when first touched.

    :raises OSError: the system call failed (its errno), or this machine has no known call number.
    """
    fn, calls = _syscall()
    if fn is None:
        raise OSError(f"NUMA placement is not supported on {platform.machine()}")
    words = node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] = 1 << (node % 64)
    # maxnode counts bits, and the kernel reads one bit fewer than it is given.
    rc = fn(ctypes.c_long(calls[0]), ctypes.c_void_p(address), ctypes.c_ulong(length), ctypes.c_int(_MPOL_PREFERRED),
            mask, ctypes.c_ulong(words * 64 + 1), ctypes.c_uint(0))  # fmt: skip
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mbind(node {node}): {os.strerror(err)}")


@functools.cache
def placement_refused(node: int) -> str | None:
    """Why pages cannot be placed on ``node`` from this process (tried once, on one page of its own), or ``None``."""
    import mmap

    probe = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = ctypes.c_char.from_buffer(probe)
    try:
        prefer_node(ctypes.addressof(view), mmap.PAGESIZE, node)
    except OSError as exc:
        hint = " (a container's seccomp profile refuses mbind without CAP_SYS_NICE)" if exc.errno == 1 else ""
        return f"mbind was refused: {exc.strerror or exc}{hint}"
    finally:
        del view  # the probe's only export: it can be unmapped now
        probe.close()
    return None


def nodes_of(address: int, length: int, samples: int = 64) -> dict[int, int]:
    """Node -> how many of ``samples`` pages spread over the range live there (touched pages only).

    Pages not yet present count under ``-1`` (a negative status from the kernel).
    """
    fn, calls = _syscall()
    if fn is None or length <= 0:
        return {}
    page = os.sysconf("SC_PAGE_SIZE")
    count = max(1, min(samples, length // page))
    step = (length // page) // count * page or page
    pages = (ctypes.c_void_p * count)(*[address + i * step for i in range(count)])
    status = (ctypes.c_int * count)()
    rc = fn(ctypes.c_long(calls[1]), ctypes.c_int(0), ctypes.c_ulong(count), pages, None, status, ctypes.c_int(0))
    if rc < 0:
        return {}
    out: dict[int, int] = {}
    for s in status:
        key = s if s >= 0 else -1
        out[key] = out.get(key, 0) + 1
    return out
