"""SGLang's layer-wise loads of hicache pools, submitted by hicache's layer loader.

SGLang's ``L2TransferEngine.submit_host_to_device`` submits every layer of a prefix's load on
the scheduler thread before the forward is queued, and records one ``LayerLoadingEvent`` event
per layer; the forward's layer ``l`` makes its stream wait on event ``l``
(``LayerDoneCounter.wait_until``). Where every pool of a load is hicache's, this module takes
that load: the scheduler thread does what SGLang does before the copies (the start event, the
load fence, index resolution on SGLang's host-to-device stream), has each pool prepare its part
(``prepare_load``: SGLang's layer ids mapped once, with SGLang's per-pool rule for drafts,
sidecars, indexers and pipeline stages; the indices checked once), records one event there, and
hands the parts to hicache's one door for layer-wise loads (:func:`hicache_core.loads.pool_loads.submit_loads`),
whose loader thread waits on that event on a stream of its own and submits layer after layer.
The forward's wait for layer ``l`` first waits on the host until layer ``l`` was submitted, then on
its event: no stream ever waits on an event not yet recorded, so no hardware-queue aliasing can
deadlock it.

The completion SGLang keeps (its ack, the allocator's transfer-done event, the counter's
``finish_event``) holds :class:`~hicache_core.loads.layer_loads.PendingEvent` objects, which answer
``query``, ``wait``, ``synchronize`` and ``elapsed_time`` as CUDA events do. A load whose pools
are not all hicache's, or whose per-layer callback is not SGLang's counter, runs SGLang's own code.
``HICACHE_SGLANG_LAYER_LOADS=sglang`` keeps SGLang's own submission for every load.

A failed or timed-out load never leaves copies running behind SGLang's back: before the forward's
wait raises, the rest of the load is cancelled and the wait returns only once every copy the load
enqueued has finished (``LayerLoad.wait_settled``), so SGLang may free or reuse the rows when it
handles the error; the completion's ``finish_event`` raises the error only once the load settled.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from hicache_core.loads.layer_loads import LayerLoad, LayerLoadError, LayerLoadTimeout
from hicache_core.loads.pool_loads import CallPerLayer, submit_loads

from .pool_api import CoreSlots
from .variables import LAYER_LOADS

CHOICES = ("hicache", "sglang")
MODE = LAYER_LOADS
ENV = MODE.name
log = logging.getLogger("hicache_sglang")
_installed: list[tuple[type, str, Any]] = []


def mode() -> str:
    """Who submits hicache pools' layer-wise loads: ``hicache`` (the default) or ``sglang``."""
    return MODE.read()


def _served(transfers: list, on_layer_done: Any) -> bool:
    if not transfers or not all(isinstance(t.host_pool, CoreSlots) for t in transfers):
        return False
    if on_layer_done is not None and not isinstance(getattr(on_layer_done, "__self__", None), _event_class()):
        return False  # a callback of someone else's: it stays on the thread SGLang calls it from
    return True


def _event_class() -> type:
    from sglang.srt.managers.cache_controller import LayerLoadingEvent

    return LayerLoadingEvent


def submit_host_to_device(engine: Any, transfers: list, *, transfer_layer_id_max: int, start_event: Any = None,
                          on_layer_done: Any = None, _original: Any = None) -> Any:  # fmt: skip
    """``L2TransferEngine.submit_host_to_device`` for loads of hicache pools (see the module's text)."""
    if not _served(transfers, on_layer_done):
        return _original(engine, transfers, transfer_layer_id_max=transfer_layer_id_max, start_event=start_event,
                         on_layer_done=on_layer_done)  # fmt: skip
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.l2_transfer import TransferCompletion, _timing_events_supported
    from sglang.srt.utils import get_device_module

    device_module = get_device_module()
    stream = engine.host_to_device_stream
    start_event = engine._start_event(start_event)
    device = torch.device(getattr(transfers[0].device_pool, "device", "cpu"))
    with device_module.stream(stream):
        try:
            # What SGLang's own submission does before the first copy, on the same stream; then each pool's part
            # of the load: SGLang's layer ids mapped once, the indices checked (and converted) once.
            start_event.wait(stream)
            prepared = engine._prepare_transfers(transfers)
            parts = [_part(t, prepared[0], transfer_layer_id_max, engine.io_backend) for t in prepared]
        except Exception:
            stream.synchronize()
            raise
        ready = None
        if device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(stream)
    engine._record_stream(transfers + prepared, stream)
    delay_cycles = envs.SGLANG_TEST_HICACHE_H2D_DELAY_CYCLES.get()
    if delay_cycles:  # SGLang's test knob: a slow copy before each layer
        parts.insert(0, CallPerLayer(lambda _: torch.cuda._sleep(delay_cycles), device))
    keep = [t for tr in transfers + prepared for t in (tr.host_indices, tr.device_indices) if t is not None]
    timing = _timing_events_supported() and device.type == "cuda"
    load = submit_loads(
        parts, transfer_layer_id_max, start_event=ready, keep=keep, timing=timing,
        what=f"SGLang load of {len(transfers[0].host_indices)} tokens into {transfer_layer_id_max} layers",
    )  # fmt: skip
    if on_layer_done is not None:
        on_layer_done.__self__._hicache_load = load
    return TransferCompletion(load.start_event, load.finish_event, timing)


def _part(transfer: Any, primary: Any, layers: int, io_backend: str) -> Any:
    """A transfer's part of the load: its pool's layer at each of SGLang's steps (SGLang's own rule: the
    transfer's ``layer_mapper``, else the step; a pool without a mapper that is not the first has no layer
    beyond its own), prepared by the pool (``prepare_load``)."""
    mapper, pool = transfer.layer_mapper, transfer.host_pool
    ids = [mapper(layer_id) if mapper is not None else layer_id for layer_id in range(layers)]
    if transfer is not primary and mapper is None:
        ids = [None if layer_id >= pool.layer_num else layer_id for layer_id in ids]
    return pool.prepare_load(transfer.device_pool, transfer.host_indices, transfer.device_indices, io_backend, ids,
                             is_draft=transfer.is_draft)  # fmt: skip


def _wait(self: Any, layer_index: int, _original: Any = None) -> None:
    load: LayerLoad | None = getattr(self, "_hicache_load", None)
    if load is None:
        return _original(self, layer_index)
    try:
        load.wait(layer_index)
    except (LayerLoadError, LayerLoadTimeout):
        settle(load)
        raise


def settle(load: LayerLoad) -> bool:
    """Before SGLang handles a load's error (and may free or reuse its rows): cancel what is not submitted
    yet, and wait (bounded) until every copy the load enqueued has finished. False, logged, past the bound."""
    load.cancel("abandoned by SGLang's forward")
    if load.wait_settled():
        return True
    log.error("hicache: %s did not settle within %g s after it failed (%s); its copies may still write its rows",
              load.what, load.loader.timeout_s, load.loader.describe_state())  # fmt: skip
    return False


def _finish_event(self: Any) -> Any:
    load: LayerLoad | None = getattr(self, "_hicache_load", None)
    return self.load_events[-1] if load is None else load.finish_event


def install() -> None:
    """Serve hicache pools' layer-wise loads through hicache's layer loader (idempotent)."""
    if _installed or mode() == "sglang":
        return
    from sglang.srt.mem_cache.l2_transfer import L2TransferEngine

    events = _event_class()
    original_submit = L2TransferEngine.submit_host_to_device
    original_wait = events.wait

    def submit(self, transfers, *, transfer_layer_id_max, start_event=None, on_layer_done=None):
        return submit_host_to_device(self, transfers, transfer_layer_id_max=transfer_layer_id_max,
                                     start_event=start_event, on_layer_done=on_layer_done,
                                     _original=original_submit)  # fmt: skip

    def wait(self, layer_index):
        return _wait(self, layer_index, _original=original_wait)

    def complete(self, layer_index):
        # SGLang's own submission records its events; a load of hicache's carries its own.
        self._hicache_load = None
        return original_complete(self, layer_index)

    original_complete = events.complete
    for owner, name, new in (
        (L2TransferEngine, "submit_host_to_device", submit),
        (events, "wait", wait),
        (events, "complete", complete),
        (events, "finish_event", property(_finish_event)),
    ):
        _installed.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, new)


def uninstall() -> None:
    """Give SGLang its own submission and events back."""
    while _installed:
        owner, name, old = _installed.pop()
        setattr(owner, name, old)


__all__ = ["CHOICES", "ENV", "install", "mode", "settle", "submit_host_to_device", "uninstall"]
