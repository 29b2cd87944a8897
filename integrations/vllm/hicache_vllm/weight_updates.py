"""vLLM's in-place weight reloads, followed by hicache's host tier and L3.

vLLM 0.32 changes a running engine's weights through worker RPCs that the engine core dispatches
(``EngineCore.collective_rpc``): ``reload_weights`` (``LLM.collective_rpc("reload_weights",
kwargs={"weights_path": ...})``, in place from disk or from tensors) and the weight-transfer session
``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` (the RL API's
``/finish_weight_update``). None of them tells the KV connector: vLLM leaves invalidating what the old
weights computed to the caller (``reset_prefix_cache(reset_connector=True)``).

This module wraps ``EngineCore.collective_rpc``. After ``reload_weights``, ``start_weight_update`` or
``finish_weight_update`` returned (or raised: a failed reload may have loaded part of the weights), on
the engine core's thread, between engine steps (a session's start moves to a version of its own, so
that nothing computed while its chunks arrive lands under the old weights' keys, where other engines
still read):

* the connector's host tier is dropped: ``Scheduler.reset_connector_cache()`` empties the offloading
  manager (every host chunk forgotten), so no host page of the old weights is looked up again;
* every hicache L3 store of the engine (the scheduler's probe, the workers' block movers) moves to a
  new weight version, unique to this reload (vLLM's weight version cannot name it: ``finish_weight_update``
  sets it after the RPC, and a reload does not change it). A worker first waits out its transfers in
  flight, which write the old weights' pages under the old keys. Where that wait fails (a load past
  ``HICACHE_LOAD_TIMEOUT_S``), the keys move all the same, the store writes nothing until the stores
  still in flight are through (their old pages under no key), and the RPC fails with the wait's error
  (vLLM logs it and answers the caller so). L3 pages of the old weights are then misses
  (``old_weight_version``).

vLLM's device prefix cache stays vLLM's: reset it (``LLM.reset_prefix_cache()``) as vLLM asks after a
weight update; requests running across a reload keep what they computed.
"""

from __future__ import annotations

import logging
import uuid
import weakref
from typing import Any

logger = logging.getLogger("hicache_vllm")
#: Worker RPCs after which the weights are other weights (from a session's start on, partly other ones).
RELOADS = ("reload_weights", "start_weight_update", "finish_weight_update")
_followers: weakref.WeakSet = weakref.WeakSet()  # objects with set_weight_version(version), in this process
_installed: list[tuple[type, str, Any]] = []


def track(follower: Any) -> None:
    """Move ``follower`` (a ``StorageProbe`` or ``BlockMover`` with a store) to each reload's weight version."""
    _followers.add(follower)


def follow(version: str) -> int:
    """Move every tracked store of this process to ``version``; how many moved.

    One that raises (a worker whose transfers in flight did not finish in time: it moved all the same) does
    not keep the others from moving; the first error is raised after, the others logged."""
    moved, errors = 0, []
    for follower in list(_followers):
        try:
            moved += bool(follower.set_weight_version(version))
        except Exception as exc:  # noqa: BLE001 - every store moves before the first error is raised
            errors.append(exc)
    for exc in errors[1:]:
        logger.error("hicache: moving to weight version %r: %s: %s", version, type(exc).__name__, exc)
    if errors:
        raise errors[0]
    return moved


def _on_worker(worker: Any, version: str) -> int:
    """Run on each worker by ``collective_rpc`` (the worker is vLLM's, unused: the stores are this process's)."""
    return follow(version)


def _after_reload(core: Any, original: Any, method: str) -> None:
    scheduler = getattr(core, "scheduler", None)
    if scheduler is not None and not scheduler.reset_connector_cache():
        logger.warning("hicache: vLLM refused to reset the offloading connector's cache after %s", method)
    version = f"reload-{uuid.uuid4().hex}"
    moved = follow(version)  # the scheduler's probe (and, with vLLM's in-process executor, the worker's mover)
    moved += sum(original(core, _on_worker, None, (version,), None) or [])
    if moved:
        logger.info("hicache: %s changed the weights: host tier dropped, L3 keys move to weight version %r",
                    method, version)  # fmt: skip


def install() -> None:
    """Wrap ``EngineCore.collective_rpc`` (idempotent); a no-op where vLLM's engine core is not importable."""
    if _installed:
        return
    from vllm.v1.engine.core import EngineCore

    original = EngineCore.__dict__["collective_rpc"]

    def collective_rpc(self: Any, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list:  # fmt: skip
        try:
            return original(self, method, timeout, args, kwargs)
        finally:
            if method in RELOADS:
                _after_reload(self, original, method)

    collective_rpc.__wrapped__ = original
    _installed.append((EngineCore, "collective_rpc", original))
    EngineCore.collective_rpc = collective_rpc


def uninstall() -> None:
    """Give vLLM its own ``collective_rpc`` back."""
    while _installed:
        owner, name, old = _installed.pop()
        setattr(owner, name, old)


__all__ = ["RELOADS", "follow", "install", "track", "uninstall"]
