"""The load checks of one load's layers, batched into one launch (:class:`CheckBatch`), and how many launches.

Host-tier verification (:mod:`hicache_core.verification.verify`) checks a load's pages after their copies: a
layer-wise load's layers, or a server's run of per-layer loads, are gathered here and checked in
one launch. This module knows its verifier only as an object (no import of :mod:`~hicache_core.verification.verify`,
which imports it).
"""

from __future__ import annotations

from typing import Any

import torch


def _version(t: torch.Tensor) -> int:
    """Torch's version counter of ``t`` (inference tensors have none: in-place writes to them cannot be seen)."""
    return 0 if t.is_inference() else t._version


class CheckBatch:
    """The load checks of one load's layers, in one launch (a layer-wise load's, or a run of per-layer loads).

    A per-layer check costs a launch per layer, and beside the next layer's copy kernel it slows the
    copy; a load's layers share their indices, so one launch over a run of layers checks the same
    bytes against the same table rows. The layers are checked in runs (:func:`check_runs` of the
    copies' ``engine``; one for a run of per-layer loads). One run is launched by :meth:`flush`, in
    order on the copies' stream (``stream``, where they are enqueued; default: the current one); a
    layer-wise load flushes after its last layer's event, so the layers' consumers do not wait for
    it. Several runs are each launched on the side stream after their last layer's copies, beside
    the later layers' copies. :meth:`flush` orders the current stream after every check. A failure is
    reported as ever, by the pool's first call after the check ran, naming each failing layer's own call.
    """

    __slots__ = ("_verifier", "_run", "_in_order", "_stream", "_raw", "_stream_args", "_hidx", "_didx", "_h", "_d",
                 "_version_sum", "_tracked", "_layers", "_seqs", "_last", "_done", "_launched")  # fmt: skip

    def __init__(self, verifier: Any, layers: int, stream: Any = None, engine: str = "sm", *,
                 raw_stream: int = 0) -> None:  # fmt: skip
        self._verifier = verifier
        runs = check_runs(engine)
        self._run = max(1, -(-layers // runs))
        self._in_order = runs == 1  # checked by flush, on the copies' stream
        self._stream = stream
        # A run of per-layer loads names its stream by handle (``raw_stream``, the current one's); the object is
        # made only where another stream must be ordered after it (``_copies_stream``), from what makes the
        # current stream's object (``torch.cuda.current_stream``'s stream id, device index and type).
        self._raw = stream.cuda_stream if stream is not None else raw_stream
        self._stream_args = (
            torch._C._cuda_getCurrentStream(verifier._device_index) if raw_stream and stream is None else None
        )
        self._hidx: torch.Tensor | None = None
        self._didx: torch.Tensor | None = None
        self._h: torch.Tensor | None = None
        self._d: torch.Tensor | None = None
        self._version_sum = 0  # of both index tensors' version counters
        self._tracked = False  # both index tensors have version counters
        self._layers: list[int] = []
        self._seqs: list[int] = []
        self._last = -1
        self._done: Any = None  # the event after the last run launched on the side stream
        self._launched = False  # a run was launched since the last flush

    def extend(self, hidx: torch.Tensor, didx: torch.Tensor, layer: int, seq: int, raw_stream: int) -> bool:
        """:meth:`add` a per-layer load of ``layer`` if it continues this run (the next layer, the same unmodified
        index tensors, the same stream: ``raw_stream``, its handle, 0 on the CPU); whether it did.

        One call, a few comparisons: in a server's host-bound loop of per-layer loads every call counts."""
        if (
            layer != self._last + 1
            or hidx is not self._hidx
            or didx is not self._didx
            or raw_stream != self._raw
            or self._version_sum
            != (hidx._version + didx._version if self._tracked else _version(hidx) + _version(didx))
        ):
            return False
        self._layers.append(layer)
        self._seqs.append(seq)
        self._last = layer
        if not self._in_order and len(self._layers) >= self._run:
            self._launch()
        return True

    def _copies_stream(self) -> Any:
        """The stream the copies were enqueued on, as a torch stream (None: the current one)."""
        if self._stream is None and self._stream_args is not None:
            sid, index, kind = self._stream_args
            self._stream = torch.cuda.Stream(stream_id=sid, device_index=index, device_type=kind)
        return self._stream

    def add(self, hidx: torch.Tensor, didx: torch.Tensor, layer: int, seq: int) -> None:
        """Note a layer just loaded (its copies enqueued on the current stream) with these indices."""
        if self._hidx is None:
            self._hidx, self._didx = hidx, didx
            self._tracked = not (hidx.is_inference() or didx.is_inference())
            self._version_sum = _version(hidx) + _version(didx)
            # The kernel's indices, taken now: host indices handed over are copied now, not at the check.
            v = self._verifier
            self._h, self._d = v._move(hidx, v.device), v._move(didx, v.device)
        self._layers.append(layer)
        self._seqs.append(seq)
        self._last = layer
        if len(self._layers) >= self._run and not self._in_order:
            self._launch()

    def _launch(self) -> None:
        if self._layers:
            layers, seqs, self._layers, self._seqs = self._layers, self._seqs, [], []
            v = self._verifier
            # In order on the current stream (the common case) needs no stream object.
            here = self._in_order and (not self._raw or self._raw == v._raw_stream_of(v._device_index))
            stream = None if here else self._copies_stream()
            done = v._check_layers(self._h, self._d, layers, seqs, stream, self._in_order, moved=True)
            self._done = done or self._done
            self._launched = True

    def flush(self, wait_host: bool = False) -> None:
        """Check the layers noted since the last run; order the current stream and the copies' stream after
        every check (what either runs next may rewrite the loaded rows), and with ``wait_host`` this thread."""
        self._launch()
        done, self._done = self._done, None
        v = self._verifier
        if done is None and self._launched and v.cuda:
            # Checked in order on the copies' stream: an event only where another stream or the host must wait.
            if wait_host or (self._raw and self._raw != v._raw_stream_of(v._device_index)):
                done = torch.cuda.Event()
                stream = self._copies_stream()
                done.record(stream if stream is not None else torch.cuda.current_stream(v.device))
        if done is not None:
            current = torch.cuda.current_stream(v.device)
            current.wait_event(done)
            if self._raw and self._raw != current.cuda_stream:
                self._copies_stream().wait_event(done)
            if wait_host:
                done.synchronize()
        self._launched = False
        self._hidx = self._didx = self._h = self._d = None


#: Runs a load's checks are launched in when its copies run on the GPU's threads; the last one follows the
#: load's last copy. One: checks beside the copies of later layers slow SM copy kernels more than one run
#: after the last copy costs (benchmarks/results/verify-profile-h200.json, docs/verification-cost.md).
CHECK_RUNS = 1
#: Runs when the copy engine moves the bytes. More than one would hide all but the last run's checks
#: behind later layers' copies while the SMs are idle, but runs queued beside the copies slowed small
#: layer-wise loads far more than that saves (docs/verification-cost.md).
CHECK_RUNS_COPY_ENGINE = 1


def check_runs(engine: str) -> int:
    """Runs a load's checks are launched in, for copies made by ``engine`` (``Implementation.engine``)."""
    return CHECK_RUNS_COPY_ENGINE if engine == "copy_engine" else CHECK_RUNS
