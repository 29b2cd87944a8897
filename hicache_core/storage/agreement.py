"""Ranks agree on a count with ``all_reduce(MIN)`` over a gloo group: they agree, or all fail, within a bound.

SGLang's L3 deadlocks came from collectives that ran only under a condition (#30760,
#26921): one rank skipped the call, the others waited forever. Here the caller runs
:func:`agree_min` for every request on every rank, whatever happened locally; a rank
with nothing to contribute contributes 0.

A collective that one rank gave up on stays pending in gloo, and the next collective
another rank issues pairs with it. So the reduction carries, beside the value, what
makes a stale or shifted pairing visible to *every* rank at once (each field reduced as
``x`` and ``-x``, so one MIN gives both the minimum and the maximum over the ranks):

* the collective's sequence number on each rank (ranks that issued different numbers of
  collectives disagree),
* a digest of the request (the prefetch's keys: a rank that submitted a prefetch the
  others did not disagrees),
* the wall-clock time each rank entered. A rank waits ``timeout + grace`` for the result;
  when the entries are ``timeout`` or more apart, the earliest rank has given up or will,
  so every rank that sees the result fails too.

Every rank sees the same reduced tensor, so the verdict is the same everywhere. A rank
whose wait timed out fails by itself; the others then fail at their next collective
(nobody answers it) within the same bound. After any failure the caller issues no more
collectives (``StorageController`` poisons its group). The bound assumes the ranks'
clocks agree to well within ``grace`` (NTP on one cluster does).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch


class AgreementFailed(RuntimeError):
    """The ranks did not agree; every rank of the group fails the same request, and the group is unusable."""


class AgreementTimeout(AgreementFailed, TimeoutError):
    """Another rank did not reach the collective in time (it died, hung, or diverged)."""


class RanksDisagreed(AgreementFailed):
    """The ranks reached the collective for different requests (another sequence number or other keys)."""


#: Extra wait beyond the agreement bound, for the result of a collective all ranks entered in time.
def grace_for(timeout: float) -> float:
    return min(10.0, max(1.0, 0.25 * timeout))


def keys_digest(keys: Iterable[str]) -> int:
    """62 bits of SHA-256 over the request's keys (0 for none), carried in the reduction."""
    h = hashlib.sha256()
    for k in keys:
        h.update(k.encode())
        h.update(b"\n")
    return int.from_bytes(h.digest()[:8], "little") >> 2


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


_MASK31 = (1 << 31) - 1


def agree_min(value: int, group: Any, timeout: float, *, seq: int = 0, digest: int = 0) -> int:
    """The minimum of ``value`` over the ranks of ``group`` (``value`` itself without a group).

    :param seq: this collective's sequence number on this rank (every rank counts the same way).
    :param digest: what the request is (:func:`keys_digest`); ranks with different digests disagree.
    :raises AgreementTimeout: the result did not come within ``timeout + grace_for(timeout)``, or the
        ranks entered ``timeout`` or more apart (a stale collective was met).
    :raises RanksDisagreed: the ranks' sequence numbers or digests differ.
    """
    if group is None:
        return int(value)
    import torch.distributed as dist

    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"the agreement timeout must be a positive number of seconds, got {timeout!r}")
    entered_us = time.time_ns() // 1000
    fields = [int(value), seq, digest >> 31, digest & _MASK31, entered_us]
    tensor = torch.tensor([x for f in fields[1:] for x in (f, -f)] + [fields[0]], dtype=torch.int64)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group, async_op=True)
    wait = timeout + grace_for(timeout)
    try:
        finished = work.wait(timeout=timedelta(seconds=wait))
    except RuntimeError as exc:  # gloo raises on its own timeout, or when a peer's connection drops
        raise AgreementTimeout(f"all_reduce(MIN) did not complete within {wait:g} s: {exc}") from exc
    if finished is False:
        raise AgreementTimeout(f"all_reduce(MIN) did not complete within {wait:g} s")
    r = tensor.tolist()
    lo_hi = [(r[2 * i], -r[2 * i + 1]) for i in range(4)]  # (min, max) of seq, digest parts, entry time
    (seq_lo, seq_hi), (d1_lo, d1_hi), (d2_lo, d2_hi), (t_lo, t_hi) = lo_hi
    if seq_lo != seq_hi:
        raise RanksDisagreed(f"ranks met at different collectives (sequence numbers {seq_lo} to {seq_hi})")
    if (d1_lo, d2_lo) != (d1_hi, d2_hi):
        raise RanksDisagreed("ranks agreed on different requests (the prefetches' keys differ between ranks)")
    spread = (t_hi - t_lo) / 1e6
    if spread >= timeout:
        raise AgreementTimeout(
            f"ranks entered the collective {spread:.1f} s apart, beyond the {timeout:g} s bound: "
            "the earliest rank has given up on it"
        )
    return int(r[-1])
