"""SGLang's in-place weight updates, followed by hicache's L3 and peer tiers.

SGLang 0.5.23 changes a running server's weights through its scheduler's
``SchedulerWeightUpdaterManager``: ``update_weights_from_disk`` (``POST /update_weights_from_disk``),
``update_weights_from_distributed``, ``update_weights_from_tensor`` and ``update_weights_from_ipc``.
Each, when it succeeds, records the request's ``weight_version`` (SGLang's ``--weight-version``,
``default`` unless given; ``GET /get_weight_version``) and, unless the request says
``flush_cache=False``, flushes the radix tree: ``tree_cache.reset()`` drops every device and host
node and clears the host pool.

This module wraps the four. Once one returned (succeeded or not: a failed update may have loaded
part of the weights), every hicache storage of this process (:class:`~hicache_sglang.storage.HicacheStorage`)
moves its keys to a new weight version (``PageStore.set_weight_version``):

* the request's ``weight_version`` when it named a new one, SGLang recorded it and the request flushes
  the cache (a bucketed update's last bucket): servers updated to the same named version share pages
  (the name is the operator's promise that the weights are equal);
* otherwise SGLang's version with a random suffix, drawn on TP rank 0 and broadcast to the other
  ranks: weights no other server can be shown to hold, so their pages are shared with none.

A store attached after an update (``/attach_hicache_storage_backend``) starts at that update's version
(:func:`current_version`), not at SGLang's, which an unnamed update leaves as it was.

An update that did not flush (``flush_cache=False``, or a flush SGLang refused because requests were
running) leaves SGLang's tree, device and host, as SGLang keeps it; hicache then writes nothing to
L3 or the peer tier until the host pool is cleared (SGLang's next flush), so no page of the old
weights lands under the new version's keys.
"""

from __future__ import annotations

import logging
import uuid
import weakref
from typing import Any

from .errors import NotServedError

log = logging.getLogger("hicache_sglang")
MODULE = "sglang.srt.managers.scheduler_components.weight_updater"
#: The manager's entry points, and whether each refuses (without touching the weights) outside a session.
ENTRY_POINTS = {
    "update_weights_from_disk": False,
    "update_weights_from_distributed": True,
    "update_weights_from_tensor": True,
    "update_weights_from_ipc": False,
}
_stores: weakref.WeakSet = weakref.WeakSet()
_current: str | None = None  # the version of this process's last update (None: none yet, SGLang's is right)
_installed: list[tuple[type, str, Any]] = []


def track(storage: Any) -> None:
    """Follow weight updates with ``storage`` (a bound :class:`~hicache_sglang.storage.HicacheStorage`)."""
    _stores.add(storage)


def bound_storages() -> list[Any]:
    """Every hicache storage of this process bound to its host pool (:mod:`hicache_sglang.retention` leases in them)."""
    return [s for s in list(_stores) if getattr(s, "store", None) is not None]


def sglang_weight_version() -> str:
    """The weight version SGLang reports in this process (``--weight-version``, or the last update's)."""
    from sglang.srt.runtime_context import get_serving

    version = get_serving().weight_version
    if not isinstance(version, str) or not version:
        raise RuntimeError(f"SGLang reports weight version {version!r}: hicache keys pages on a non-empty version")
    return version


def current_version() -> str:
    """The weight version keys are made with now: the last update's here, else SGLang's (a store attached later)."""
    return _current if _current is not None else sglang_weight_version()


def next_version(named: str | None, before: str, after: str, token: str, *, flushes: bool = True) -> str:
    """The weight version of the weights an update left: the request's name, when SGLang took it, else unique.

    A name counts only on an update that flushes the cache (``flush_cache=True``: the last bucket of a
    bucketed update): after an earlier bucket the weights are partly the old ones, and what is computed
    with them must not go under the name other servers will read.
    """
    if named is not None and named != before and after == named and flushes:
        return named
    return f"{after}~unnamed-{token}"


def _rank0_token(manager: Any) -> str:
    """A random token, the same on every TP rank (rank 0's, broadcast over the TP CPU group)."""
    token = uuid.uuid4().hex[:16]
    group = getattr(manager, "tp_cpu_group", None)
    import torch.distributed as dist

    if group is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) < 2:
        return token
    box = [token]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def _follow(manager: Any, entry: str, recv_req: Any, before: str) -> None:
    global _current
    # Every rank runs every update, stores or not: the token's broadcast is matched on all of them.
    _current = next_version(getattr(recv_req, "weight_version", None), before, sglang_weight_version(),
                            _rank0_token(manager), flushes=bool(getattr(recv_req, "flush_cache", True)))  # fmt: skip
    for storage in bound_storages():
        storage.set_weight_version(_current, reason=entry)


def _wrap(entry: str, original: Any, needs_session: bool) -> Any:
    def update(self: Any, recv_req: Any) -> Any:
        if needs_session and getattr(self, "_session", None) is None:
            return original(self, recv_req)  # SGLang refuses it before any weight moves
        before = sglang_weight_version()
        try:
            return original(self, recv_req)
        finally:
            _follow(self, entry, recv_req, before)

    update.__wrapped__ = original
    update.__name__ = entry
    return update


def install() -> None:
    """Wrap SGLang's weight-update entry points (idempotent)."""
    if _installed:
        return
    import importlib

    manager = importlib.import_module(MODULE).SchedulerWeightUpdaterManager
    for entry, needs_session in ENTRY_POINTS.items():
        original = manager.__dict__.get(entry)
        if original is None:
            raise NotServedError(f"{MODULE}.SchedulerWeightUpdaterManager has no {entry}: this SGLang is modified; "
                                 "hicache could not follow its weight updates, so it is not served")  # fmt: skip
        _installed.append((manager, entry, original))
        setattr(manager, entry, _wrap(entry, original, needs_session))


def uninstall() -> None:
    """Give SGLang its own entry points back."""
    while _installed:
        owner, name, old = _installed.pop()
        setattr(owner, name, old)


__all__ = ["ENTRY_POINTS", "bound_storages", "current_version", "install", "next_version", "sglang_weight_version",
           "track", "uninstall"]  # fmt: skip
