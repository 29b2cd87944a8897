"""One way to submit a layer-wise load: parts of one or more host pools, each checked once, copied off the caller.

:func:`submit_loads` is the door every layer-wise load goes through (``HostPool.submit_load``, and
the SGLang and vLLM adapters). A load is a number of steps (layers, in the caller's order) and
one part per host pool it fills:

* :class:`PoolLoad` (``HostPool.prepare_load``): the pool's indices are checked and put where its
  implementation wants them once, at submission, on the caller's thread, and each step's layer id
  is mapped to its host layer once; the loader's thread then numbers and copies each layer, and
  tells the pool's observers (verification checks the load's layers in one launch after the last).
* :class:`CallPerLayer`: a step that is a plain call (a pool whose per-layer load does more than
  a copy, SGLang's test delay), made on the loader's thread.

The layer loader (:mod:`hicache_core.loads.layer_loads`) runs the steps and, after the last one, each
part's ``finish``; when a step raises, every part ``abandon``s first (the layers loaded so far are
checked, and the thread waits for it, before the load's consumers learn of the error).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..plugins.implementation import LOAD, Implementation
from .layer_loads import LayerLoad, layer_loader


class PoolLoad:
    """One host pool's part of a layer-wise load, made by ``HostPool.prepare_load`` (indices checked once).

    ``layers[i]``: ``(layer_id, host layer)`` of step ``i``, or ``None`` where the pool has no layer
    at that step (or does not own it). ``h``, ``d``: the checked indices, where the implementation
    wants them (``None``: nothing moves).
    """

    def __init__(self, pool: Any, impl: Implementation, device_pool: Any, io_backend: str,
                 keep: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor | None, d: torch.Tensor | None,
                 layers: list[tuple[int, int] | None], watches: list, ready: Any = None) -> None:  # fmt: skip
        self.pool, self.impl, self.device_pool, self.io_backend = pool, impl, device_pool, io_backend
        #: Allocated until the copies are submitted (the converted indices too: made on another stream).
        self.keep = (*keep, *(t for t in (h, d) if t is not None))
        #: The event after the indices' conversion (CUDA), which the copies follow.
        self.ready = ready
        self.h, self.d = h, d
        self.layers = layers
        self.items = keep[0].shape[0]
        self.device = pool.plan.device
        self._watches = watches
        self._adds = tuple(w.add for w in watches)

    def step(self, i: int) -> None:
        """Copy this part's layer of step ``i`` (on the loader's thread and stream)."""
        mapped = self.layers[i]
        if mapped is None or self.h is None:
            return
        layer_id, layer = mapped
        self.pool._per_layer(LOAD, self.device_pool, self.h, self.d, layer_id, self.io_backend, False,
                             (self.impl, self.h, self.d, layer, self._adds, self.items))  # fmt: skip

    def abandon(self) -> None:
        """The load failed: check the layers loaded so far, and wait for it (the consumers may reuse the rows)."""
        for watch in self._watches:
            watch.flush(wait_host=True)

    def finish(self) -> None:
        """After the last step: what follows the whole load (verification's check of its layers)."""
        for watch in self._watches:
            watch.flush()


class CallPerLayer:
    """A part whose step is ``call(i)``, run on the loader's thread with its stream current."""

    ready = None

    def __init__(self, call: Callable[[int], None], device: torch.device | str, keep: Iterable[Any] = ()) -> None:
        self.call = call
        self.device = torch.device(device)
        self.keep = tuple(keep)

    def step(self, i: int) -> None:
        self.call(i)

    def abandon(self) -> None:
        """Nothing of its own: a pool call that raised already settled what it had started."""

    def finish(self) -> None:
        """Nothing follows its steps."""


def submit_loads(parts: Sequence[PoolLoad | CallPerLayer], layers: int, *, start_event: Any = None,
                 keep: Iterable[Any] = (), timing: bool = False, what: str = "layer-wise load",
                 ) -> LayerLoad:  # fmt: skip
    """Hand a layer-wise load of ``layers`` steps to the device's layer loader; returns at once.

    Each step runs every part's step in order. The copies follow ``start_event`` (already recorded;
    default: what the caller's current stream holds now) and each part's converted indices. ``keep``: tensors the copies
    read that must stay allocated until they are submitted (each part's indices are kept already).
    ``timing``: the load's start and finish events time it. See :mod:`hicache_core.loads.layer_loads` for the
    load's waits, errors and events.
    """
    if not parts:
        raise ValueError("a layer-wise load needs at least one part")
    devices = {str(p.device) for p in parts}
    if len(devices) != 1:
        raise ValueError(f"the parts of one layer-wise load must be on one device, got {sorted(devices)}")
    device = parts[0].device
    readies = tuple(p.ready for p in parts if p.ready is not None)
    if readies:  # the copies follow the parts' converted indices too
        if start_event is None:
            start_event = torch.cuda.Event()
            start_event.record(torch.cuda.current_stream(device))
        start_event = (start_event, *readies)

    def step(i: int) -> None:
        try:
            for part in parts:
                part.step(i)
        except BaseException:
            for part in parts:
                part.abandon()
            raise

    def finish() -> None:
        for part in parts:
            part.finish()

    kept = (*keep, *(t for part in parts for t in part.keep))
    return layer_loader(device).submit(layers, step, start_event=start_event, keep=kept, timing=timing, what=what,
                                       finish=finish)  # fmt: skip


__all__ = ["CallPerLayer", "PoolLoad", "submit_loads"]
