"""SGLang's host-memory budget, checked before any host pool allocates, and the reserve it keeps free.

SGLang refuses a host pool unless free memory (within cgroup limits) exceeds the pool plus a fixed
10 GiB reserve (``host_memory_budget_bytes``). Every pool the adapter builds hands
:func:`sglang_budget` to ``make_host_pool``, which calls it with the bytes that will be mapped and pinned
(hicache's exact sizes, ``hicache_core.host_memory``) before it takes any; the launcher's ``--hicache-size``
check goes through :func:`check_host_memory` too; :data:`RESERVE` lets a small server
(or a CI machine with 7 GB) keep a smaller reserve, in every process the launcher starts.
"""

from __future__ import annotations

from collections.abc import Callable

from hicache_core.host_memory import HostMemoryPlan
from hicache_core.settings import number

from .errors import NotServedError

#: GiB of host memory SGLang's HiCache budget keeps free (SGLang 0.5.23 fixes 10 GiB).
RESERVE = number("HICACHE_SGLANG_HOST_RESERVE_GIB", unit="GiB",
                 doc="host memory SGLang's HiCache budget keeps free (SGLang: 10 GiB, fixed)")  # fmt: skip


def check_host_memory(requested: int, label: str, *, asking: str = "requesting") -> None:
    """Refuse ``requested`` bytes for the ``label`` when SGLang's host-memory budget cannot hold them.

    :param asking: how the message introduces the amount (the launcher names ``--hicache-size``).
    :raises NotServedError: the budget is smaller than ``requested``.
    """
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_bytes

    available = host_memory_budget_bytes(requested)
    if requested > available:
        raise NotServedError(
            f"Not enough host memory for the {label}: {asking} {requested / 1e9:.2f} GB but only "
            f"{available / 1e9:.2f} GB are free (SGLang's host-memory budget). Reduce --hicache-size or "
            "--hicache-ratio."
        )


def sglang_budget(label: str) -> Callable[[HostMemoryPlan], None]:
    """``make_host_pool``'s ``host_memory_check``: SGLang's budget, applied to the bytes the pool will map and pin
    (not the bytes asked), before any of them is taken."""

    def check(plan: HostMemoryPlan) -> None:
        check_host_memory(plan.mapped, label)

    return check


def apply_host_reserve() -> None:
    """Set SGLang's host-memory reserve from :data:`RESERVE`, when given (unset: SGLang's 10 GiB).

    :raises hicache_core.settings.SettingError: the value is not a number of GiB >= 0.
    """
    gib = RESERVE.read()
    if gib is None:
        return
    from sglang.srt.mem_cache.pool_host import base

    base.HICACHE_HOST_MEMORY_RESERVE_BYTES = int(gib * (1 << 30))
