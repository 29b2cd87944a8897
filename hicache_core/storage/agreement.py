"""Ranks agree on a count with ``all_reduce(MIN)`` over a gloo group, always with a timeout.

SGLang's L3 deadlocks came from collectives that ran only under a condition (#30760,
#26921): one rank skipped the call, the others waited forever. Here the caller runs
:func:`agree_min` for every request on every rank, whatever happened locally; a rank
with nothing to contribute contributes 0. A collective that times out leaves the group
unusable, so the caller stops issuing collectives after it (see ``StorageController``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch


class AgreementTimeout(TimeoutError):
    """Another rank did not reach the collective in time (it died, hung, or diverged)."""


def check_group(group: Any) -> None:
    """Refuse, before anything runs, a group that cannot reduce CPU tensors."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group= needs torch.distributed initialised (init_process_group) in every rank")
    backend = dist.get_backend(group)
    if str(backend).lower() != "gloo":
        raise ValueError(
            f"the rank-agreement group must be a gloo group (CPU tensors, off the CUDA stream), got {backend!r}; "
            "make one with torch.distributed.new_group(backend='gloo')"
        )


def agree_min(value: int, group: Any, timeout: float) -> int:
    """The minimum of ``value`` over the ranks of ``group`` (``value`` itself without a group)."""
    if group is None:
        return int(value)
    import torch.distributed as dist

    tensor = torch.tensor([int(value)], dtype=torch.int64)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group, async_op=True)
    try:
        finished = work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as exc:  # gloo raises on its own timeout, or when a peer's connection drops
        raise AgreementTimeout(f"all_reduce(MIN) did not complete within {timeout:g} s: {exc}") from exc
    if finished is False:
        raise AgreementTimeout(f"all_reduce(MIN) did not complete within {timeout:g} s")
    return int(tensor.item())
