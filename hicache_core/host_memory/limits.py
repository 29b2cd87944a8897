"""How much host memory this process may take: the system's, its cgroup's, and the locked-memory limit.

Read from Linux's own files (``/proc/meminfo``, the process's cgroup, ``getrlimit``) each time they are
asked for: a pool is checked against what is free when it is built, after the pools built before it.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

_CGROUP_ROOT = Path("/sys/fs/cgroup")
_PROC_CGROUP = Path("/proc/self/cgroup")
_MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class MemoryLimits:
    """What bounds a new host allocation, in bytes (``None``: no such bound here).

    :param available: the system's ``MemAvailable`` (what can be had without swapping).
    :param total: the system's ``MemTotal``.
    :param cgroup_limit: the process's cgroup memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``).
    :param cgroup_usage: what the cgroup already uses (``memory.current`` / ``memory.usage_in_bytes``).
    :param cgroup_reclaimable: of that, file cache the kernel reclaims before it refuses the cgroup memory
        (``memory.stat``: v2 ``inactive_file``, v1 ``total_inactive_file``).
    :param cgroup_path: the cgroup's folder, for the error that names it.
    :param memlock: ``RLIMIT_MEMLOCK`` (soft), the cap on memory an RDMA registration may lock.
    """

    available: int
    total: int
    cgroup_limit: int | None
    cgroup_usage: int | None
    cgroup_path: str | None
    memlock: int | None
    cgroup_reclaimable: int | None = None

    @property
    def cgroup_free(self) -> int | None:
        """What the cgroup can still take (``None``: no cgroup limit): its limit less what it uses, reclaimable
        file cache not counted (a model's weights just read are cache the kernel drops for a new pool)."""
        if self.cgroup_limit is None:
            return None
        used = max(0, (self.cgroup_usage or 0) - (self.cgroup_reclaimable or 0))
        return max(0, self.cgroup_limit - used)

    def bound(self) -> tuple[int, str]:
        """The tighter of the system's available memory and the cgroup's room, and which it is."""
        free = self.cgroup_free
        if free is not None and free < self.available:
            cache = f", {self.cgroup_reclaimable} of it reclaimable file cache" if self.cgroup_reclaimable else ""
            return free, (f"the cgroup's limit ({self.cgroup_path}: {self.cgroup_limit} bytes, {self.cgroup_usage} "
                          f"used{cache})")  # fmt: skip
        return self.available, "the system's available memory (MemAvailable in /proc/meminfo)"


def read_limits() -> MemoryLimits:
    """The limits now in force for this process."""
    info = _meminfo()
    limit, usage, reclaimable, path = _cgroup()
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return MemoryLimits(
        available=info.get("MemAvailable", info.get("MemFree", 0)),
        total=info.get("MemTotal", 0),
        cgroup_limit=limit,
        cgroup_usage=usage,
        cgroup_path=path,
        memlock=None if soft == resource.RLIM_INFINITY else soft,
        cgroup_reclaimable=reclaimable,
    )


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        text = _MEMINFO.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            out[name] = int(fields[0]) * (1024 if fields[1:2] == ["kB"] else 1)
    return out


def _cgroup() -> tuple[int | None, int | None, int | None, str | None]:
    """(limit, usage, reclaimable file cache, folder) of the tightest memory limit on this process's cgroup path,
    v2 or v1."""
    try:
        lines = _PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None, None, None, None
    best: tuple[int | None, int | None, int | None, str | None] = (None, None, None, None)
    # Only inactive file pages count as reclaimable, as kubelet's working set does (usage less inactive_file):
    # active ones are read now (a server's mmapped weights), and dropping them for a pool would thrash.
    v1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    for line in lines:
        _id, controllers, rel = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy; a limit may sit on any ancestor
            candidates = [(_CGROUP_ROOT / rel.lstrip("/"), ("memory.max", "memory.current", "inactive_file"))]
        elif "memory" in controllers.split(","):
            base = _CGROUP_ROOT / "memory"
            candidates = [(base / rel.lstrip("/"), v1), (base, v1)]
        else:
            continue
        for folder, (limit_file, usage_file, cache_key) in candidates:
            for d in (folder, *folder.parents):
                if not str(d).startswith(str(_CGROUP_ROOT)):
                    break
                limit = _read_int(d / limit_file)
                if limit is None or limit >= (1 << 60):  # "max", or v1's "no limit" (a page-rounded LONG_MAX)
                    continue
                if best[0] is None or limit < best[0]:
                    best = (limit, _read_int(d / usage_file), _stat(d / "memory.stat", cache_key), str(d))
    return best


def _stat(path: Path, key: str) -> int | None:
    """One figure of a cgroup's ``memory.stat`` (``None``: unreadable or absent)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def _read_int(path: os.PathLike) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
