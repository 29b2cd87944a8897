"""Layer-wise loads submitted off the caller's thread, deadlock-free by construction.

A server that loads a cached prefix issues every layer's load before the forward starts; the
driver's time per copy descriptor then delays the forward's first kernel by the submission
time of every layer. Here the caller hands the whole load to a submitting thread and returns:

* at the call, the caller records (or passes) a start event on its own stream;
* the submitting thread owns a stream nobody else submits to. For each job, in the order
  jobs were made, it makes that stream wait on the job's start event, submits layer after
  layer, and records one event per layer right after that layer's copies;
* a consumer that needs layer ``l`` first waits *on the host* until layer ``l`` has been
  submitted and its event recorded, then makes its stream wait on that event.

The rule that makes this deadlock-free: every GPU-side wait is enqueued after the event it
waits on was recorded. Every dependency on the GPU (stream order, event waits, and the
in-order hardware queues that streams may share) then points from work enqueued later to
work enqueued earlier, so no cycle can form, whatever the number of hardware queues
(``CUDA_DEVICE_MAX_CONNECTIONS``). The host waits are bounded (``timeout_s``) and end in an
error that names the layer, never a hang. Nothing here uses stream memory operations.

An error raised while a layer is submitted is kept by the job and raised by every wait on
that layer or a later one (and by :meth:`LayerLoad.result`) as soon as the thread met it;
the thread submits nothing more of that job, and the next job runs as usual. The layers
before the failing one were *submitted*, and their waits return; on CUDA their copies, and
whatever part of the failing layer was enqueued before it raised, may still be running when
the error is raised. So is a load whose wait timed out: its thread goes on submitting it.
Before freeing or reusing a failed or abandoned load's rows, wait until it *settled*:
:meth:`LayerLoad.wait_settled` (a host wait that returns whether it settled and never raises
the load's error) or :attr:`LayerLoad.settled_event` (an event that completes once every copy
the load enqueued has finished, error or not). The thread records that event on its stream
after the last copy it enqueued for the job, so waiting on it never waits on work not yet
submitted. :meth:`LayerLoad.cancel` stops the submission of layers not yet submitted (after a
timeout, say), so that the load settles soon. The finish event (and ``synchronize()``) raise
a failed load's error only once it settled.

On the CPU (device pools in host memory: tests, demos, CPU servers) the same thread runs the
copies themselves, so "submitted" means "done" and a wait is a host wait only: the schedule
is the same, which is what the CPU tests check.

After ``os.fork()`` the child has no loader thread: the child's :func:`layer_loader` makes a
new loader (a CUDA one raises torch's error about CUDA in a forked child at once), and a
loader or a load made before the fork raises at once in the child, saying so.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..settings.variables import LOAD_TIMEOUT as TIMEOUT

DEFAULT_TIMEOUT_S: float = TIMEOUT.default

#: On a loader's thread, what the steps of the job it runs asked to run when that job stops (:func:`at_load_end`).
_stepping = threading.local()


def at_load_end(callback: Callable[[bool], None]) -> bool:
    """From inside a layer-loader step: run ``callback(failed)`` on the loader's thread when this load stops.

    When a step raises, at once and before the load's consumers learn of the error (``failed`` True: they may
    reuse its rows once they do); else after the last step, before the job's ``finish``. A callback registered
    again (an equal one) runs once. Outside a step: nothing is registered, and False is returned. A host pool's
    verification uses it to check a run of per-layer loads that a step left open (a step may load layers itself
    and fail, or stop, before the pool's last layer)."""
    ends = getattr(_stepping, "ends", None)
    if ends is None:
        return False
    if callback not in ends:
        ends.append(callback)
    return True


def _run_ends(ends: list[Callable[[bool], None]], failed: bool) -> None:
    while ends:
        ends.pop(0)(failed)
ENV_TIMEOUT = TIMEOUT.name


class LayerLoadError(RuntimeError):
    """A layer of a submitted load failed; raised by the consumer's wait (the cause is chained)."""


class LayerLoadTimeout(TimeoutError):
    """A consumer waited longer than the loader's bound for a layer to be submitted."""


class LayerLoadCancelled(RuntimeError):
    """The cause of a cancelled load's :class:`LayerLoadError`: layers not submitted before :meth:`LayerLoad.cancel`."""


class ForkedLoaderError(RuntimeError):
    """A loader or load made before ``os.fork()`` was used in the child, where its thread does not exist."""


def timeout_from_env() -> float:
    """``HICACHE_LOAD_TIMEOUT_S`` (seconds, > 0), or the default; a bad value names the variable."""
    return TIMEOUT.read()


class LayerLoad:
    """One layer-wise load handed to a :class:`LayerLoader`: per-layer progress, events and errors.

    ``layers`` steps; ``wait(l)`` orders a stream after layer ``l`` (host wait until it was
    submitted, then an event wait); ``result()`` waits until every layer was submitted.
    ``finish_event`` and ``start_event`` stand in for CUDA events recorded by the submitting
    thread (see :class:`PendingEvent`). After an error or a timeout, ``wait_settled()`` and
    ``settled_event`` wait until every copy the load enqueued has finished (see the module's text).
    """

    def __init__(self, loader: LayerLoader, layers: int, what: str, timing: bool) -> None:
        self.loader = loader
        self.layers = layers
        self.what = what
        self.timing = timing
        self._cond = threading.Condition()
        self._submitted = 0  # layers submitted so far (their events recorded)
        self._events: list[Any] = []
        self._error: BaseException | None = None
        self._failed_layer: int | None = None
        self._done = False  # the thread is through with this job (finished or failed)
        self._start: Any = None
        self._finish: Any = None
        self._settle: Any = None  # recorded after the job's last enqueued copy (None on the CPU)
        self._cancel: str | None = None  # why the consumer cancelled the layers not yet submitted
        self.submitted_at: float | None = None  # perf_counter() when the thread took the job
        self.finish_event = PendingEvent(self, "finish")
        self.start_event = PendingEvent(self, "start")

    # ---- the submitting thread's side -------------------------------------------------------

    def _layer_done(self, event: Any) -> None:
        with self._cond:
            self._events.append(event)
            self._submitted += 1
            self._cond.notify_all()

    def _fail(self, layer: int, exc: BaseException) -> None:
        with self._cond:
            self._error, self._failed_layer = exc, layer
            self._cond.notify_all()

    def _close(self, start: Any, finish: Any, settle: Any) -> None:
        with self._cond:
            self._start, self._finish, self._settle, self._done = start, finish, settle, True
            self._cond.notify_all()

    # ---- the consumer's side ----------------------------------------------------------------

    def submitted(self, layer: int) -> bool:
        """Whether layer ``layer`` was submitted (a host-side question; no wait)."""
        return self._submitted > layer

    @property
    def error(self) -> BaseException | None:
        """The error a layer met, or ``None``."""
        return self._error

    def _await(self, ready: Callable[[], bool], what: str, timeout: float | None = None) -> None:
        self.loader._check_process(self)
        bound = self.loader.timeout_s if timeout is None else timeout
        deadline = None
        with self._cond:
            while not ready():
                if self._error is not None and (self._done or self._failed_layer is not None):
                    break
                if deadline is None:
                    deadline = time.monotonic() + bound
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LayerLoadTimeout(
                        f"{self.what}: {what} was not submitted within {bound:g} s "
                        f"({self._submitted} of {self.layers} layers submitted; {self.loader.describe_state()}); "
                        + (f"raise the bound with {ENV_TIMEOUT}" if timeout is None else "the caller's timeout")
                    )
                self._cond.wait(left)

    def _raise_for(self, layer: int) -> None:
        failed = self._failed_layer
        if self._error is not None and failed is not None and layer >= failed:
            raise LayerLoadError(
                f"{self.what}: layer {failed} failed to load ({type(self._error).__name__}: {self._error}); "
                f"layer {layer} and every later layer of this load are missing"
            ) from self._error

    def _check_layer(self, layer: int) -> int:
        if type(layer) is not int:
            layer = int(layer)
        if not 0 <= layer < self.layers:
            raise IndexError(f"{self.what}: layer {layer} is out of range [0, {self.layers})")
        return layer

    def event(self, layer: int) -> Any:
        """The event recorded right after layer ``layer``'s copies (``None`` on the CPU), once submitted."""
        layer = self._check_layer(layer)
        if self._submitted <= layer:
            self._await(lambda: self._submitted > layer, f"layer {layer}")
        self._raise_for(layer)
        return self._events[layer]

    def wait(self, layer: int, stream: Any = None) -> None:
        """Order ``stream`` (default: the current stream) after layer ``layer``'s copies.

        Waits on the host until the layer was submitted (about zero once the forward reaches it),
        then enqueues a wait on its already recorded event. Raises what the layer met."""
        event = self.event(layer)
        if event is not None:
            (stream if stream is not None else torch.cuda.current_stream(self.loader.device)).wait_event(event)

    def result(self, timeout: float | None = None) -> None:
        """Wait until every layer was submitted (not until the copies are done); raise the job's error.

        ``timeout``: seconds to wait (default: the loader's bound, ``HICACHE_LOAD_TIMEOUT_S``); past it,
        :class:`LayerLoadTimeout`."""
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if not self._done:
            self._await(lambda: self._done, "the whole load", timeout)
        if self._error is not None:
            self._raise_for(self._failed_layer or 0)

    def synchronize(self) -> None:
        """Wait until every layer's copies are done (submitted, then the last event completed).

        A failed load's error is raised once the load settled (every copy it enqueued finished)."""
        try:
            self.result()
        except LayerLoadError:
            _settle_then_raise(self)
        if self._finish is not None:
            self._finish.synchronize()

    # ---- after an error or a timeout --------------------------------------------------------

    def cancel(self, reason: str = "cancelled by its consumer") -> None:
        """Submit no layer of this load that is not submitted yet; they fail with :class:`LayerLoadCancelled`.

        A layer being submitted when this is called completes (its wait returns); the next one fails.
        Use it when the load is abandoned (after a timeout, say), then :meth:`wait_settled`. No effect on
        a load that is through."""
        self._cancel = str(reason)

    def settled(self) -> bool:
        """Whether every copy this load enqueued has finished, error or not (a host-side question; no wait).

        True once the loader's thread is through with the load and, on CUDA, the event it recorded
        after the load's last enqueued copy completed."""
        if not self._done:
            return self.loader._forked()  # a load of the parent's: no copy of it runs in this process
        return _complete(self._settle)

    def wait_settled(self, timeout: float | None = None) -> bool:
        """Wait until :meth:`settled`; ``True`` once it is, ``False`` if ``timeout`` passed first.

        ``timeout``: seconds (default: the loader's bound, ``HICACHE_LOAD_TIMEOUT_S``). Never raises the
        load's error: this is the wait before freeing or reusing a failed or abandoned load's rows. After
        ``False`` the copies may still run: keep the rows out of use (or wait again)."""
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        deadline = time.monotonic() + (self.loader.timeout_s if timeout is None else timeout)
        if not self._through(deadline):
            return False
        event = self._settle
        if event is None:
            return True
        pause = 2e-5
        while not _complete(event):  # polled rather than event.synchronize(), which has no bound
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, 1e-3)
        return True

    def _through(self, deadline: float) -> bool:
        """Host wait until the thread is through with this load (or the load is the parent's); False at ``deadline``."""
        if self._done or self.loader._forked():
            return True
        with self._cond:
            while not self._done:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    @property
    def settled_event(self) -> SettledEvent:
        """An event that completes once every copy this load enqueued has finished; never raises the load's error."""
        return SettledEvent(self)

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self._done else "in flight"
        return f"LayerLoad({self.what!r}, {self._submitted}/{self.layers} layers submitted, {state})"


class PendingEvent:
    """A CUDA event the submitting thread records later, usable where a ``torch.cuda.Event`` is.

    ``query()`` is ``False`` until the event is recorded and complete; ``wait(stream)`` and
    ``synchronize()`` first wait on the host until it is recorded (bounded), so that no stream
    ever waits on an event not yet recorded. Each raises the load's error, if it met one, once
    the load settled (every copy it enqueued finished): ``query()`` answers ``False`` until then,
    ``wait`` and ``synchronize`` wait for it (bounded), so whoever frees the rows on that error
    frees them after the copies.
    """

    def __init__(self, load: LayerLoad, which: str) -> None:
        self._load = load
        self._which = which

    def _event(self, block: bool) -> Any:
        load = self._load
        if not load._done:
            if not block:
                return None
            load._await(lambda: load._done, f"the {self._which} of the load")
        if load._error is not None:
            _settle_then_raise(load)
        return load._start if self._which == "start" else load._finish

    def query(self) -> bool:
        load = self._load
        if not load._done or (load._error is not None and not load.settled()):
            return False
        event = self._event(False)
        return True if event is None else bool(event.query())

    def wait(self, stream: Any = None) -> None:
        event = self._event(True)
        if event is not None:
            (stream if stream is not None else torch.cuda.current_stream(self._load.loader.device)).wait_event(event)

    def synchronize(self) -> None:
        event = self._event(True)
        if event is not None:
            event.synchronize()

    def record(self, stream: Any = None) -> None:
        raise RuntimeError("a PendingEvent is recorded by the layer loader's thread, not by its users")

    def elapsed_time(self, end: Any) -> float:
        """Milliseconds between this event and ``end`` (both recorded with timing; see ``LayerLoader.submit``)."""
        start = self._event(True)
        other = end._event(True) if isinstance(end, PendingEvent) else end
        if start is None or other is None:
            return 0.0
        return start.elapsed_time(other)

    def __repr__(self) -> str:
        return f"PendingEvent({self._which} of {self._load!r})"


class SettledEvent:
    """Completes once every copy a load enqueued has finished, whether the load succeeded, failed or timed out.

    Usable where a ``torch.cuda.Event`` is waited on: ``query()`` (never raises); ``wait(stream)``
    and ``synchronize()`` first wait on the host until the loader's thread is through with the load
    (bounded: :class:`LayerLoadTimeout` if the thread does not get through it in time, the one
    thing they raise), then on the event the thread recorded after the load's last copy. None of
    them raises the load's error (see :meth:`LayerLoad.wait_settled`).
    """

    def __init__(self, load: LayerLoad) -> None:
        self._load = load

    def query(self) -> bool:
        return self._load.settled()

    def _late(self, what: str) -> LayerLoadTimeout:
        load = self._load
        return LayerLoadTimeout(f"{load.what}: {what} within {load.loader.timeout_s:g} s ({load._submitted} of "
                                f"{load.layers} layers submitted; {load.loader.describe_state()}); its copies may "
                                "still run: keep its rows out of use")  # fmt: skip

    def wait(self, stream: Any = None) -> None:
        """Order ``stream`` (default: the current stream) after every copy of the load (host wait until recorded)."""
        load = self._load
        if not load._through(time.monotonic() + load.loader.timeout_s):
            raise self._late("the loader's thread was not through with it")
        if load._settle is not None:
            (stream if stream is not None else torch.cuda.current_stream(load.loader.device)).wait_event(load._settle)

    def synchronize(self) -> None:
        """Wait on the host until every copy of the load finished."""
        if not self._load.wait_settled():
            raise self._late("its copies did not all finish")

    def record(self, stream: Any = None) -> None:
        raise RuntimeError("a SettledEvent is recorded by the layer loader's thread, not by its users")

    def __repr__(self) -> str:
        return f"SettledEvent({'settled' if self.query() else 'not settled'}, {self._load!r})"


def _complete(event: Any) -> bool:
    """Whether a recorded event completed (``None``: nothing to wait for)."""
    if event is None:
        return True
    try:
        return bool(event.query())
    except RuntimeError:
        # A sticky CUDA error (the context is lost): no work of this process runs on the device any more.
        return True


def _settle_then_raise(load: LayerLoad) -> None:
    """Raise ``load``'s error once it settled (bounded by the loader's timeout; the message says if it did not)."""
    settled = load.wait_settled()
    try:
        load._raise_for(load._failed_layer or 0)
    except LayerLoadError as exc:
        if settled:
            raise
        raise LayerLoadError(
            f"{exc}; its copies had not all finished after {load.loader.timeout_s:g} s, keep its rows out of use "
            "until settled_event completes"
        ) from load._error


class _Job:
    __slots__ = ("load", "step", "start", "keep", "finish")

    def __init__(self, load: LayerLoad, step: Callable[[int], None], start: Any, keep: tuple,
                 finish: Callable[[], None] | None) -> None:  # fmt: skip
        self.load, self.step, self.start, self.keep, self.finish = load, step, start, keep, finish


class LayerLoader:
    """A submitting thread with a stream of its own, for one device; jobs run in the order made.

    Use :func:`layer_loader` for the process's loader of a device. :meth:`submit` returns at once
    with a :class:`LayerLoad`; the thread calls ``step(layer)`` for each layer with its own stream
    current (``step`` enqueues that layer's copies on the current stream, as a synchronous
    per-layer call does) and records the layer's event after it.
    """

    def __init__(self, device: torch.device | str, timeout_s: float | None = None) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.cuda = device.type == "cuda"
        self.timeout_s = timeout_from_env() if timeout_s is None else float(timeout_s)
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        # A stream of the thread's own (not from torch's pool, which may hand the same stream to someone
        # else): only this thread enqueues on it, so jobs follow each other on it in the order made.
        self.stream = _own_stream(device) if self.cuda else None
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._current: tuple[LayerLoad, int, float] | None = None
        self._closed = False
        self._pid = os.getpid()  # the process whose thread this is (see _after_fork_in_child)
        self._thread = threading.Thread(target=self._run, name=f"hicache-layer-loader-{device}", daemon=True)
        self._thread.start()

    def submit(self, layers: int, step: Callable[[int], None], *, start_event: Any = None,
               keep: Iterable[Any] = (), timing: bool = False, what: str = "layer-wise load",
               finish: Callable[[], None] | None = None) -> LayerLoad:  # fmt: skip
        """Hand a load of ``layers`` layers to the thread; returns at once.

        ``start_event``: an event the caller already recorded after whatever the copies must follow
        (a producer of the destination's pages, say), or a tuple of them; ``None`` records one now on
        the caller's current stream. ``keep``: tensors the copies read (indices) that must stay allocated until
        they are submitted; CUDA ones are also marked as used on the loader's stream.
        ``timing``: record the start and finish events with timing, for ``elapsed_time``.
        ``finish``: called on the thread after the last layer's step (or the one that failed), on the
        loader's stream, before the finish event: work that follows the whole load (its checks, say).
        Layer events do not wait for it; an error it raises is the last layer's.
        """
        if self._closed or self._pid != _this_process:
            self._check_process(None)
            raise RuntimeError(f"this layer loader ({self.device}) is closed")
        if type(layers) is not int or layers < 0:
            raise ValueError(f"layers must be an int >= 0, got {layers!r}")
        if self.cuda and start_event is None:
            start_event = torch.cuda.Event()
            start_event.record(torch.cuda.current_stream(self.device))
        load = LayerLoad(self, layers, what, timing)
        self._queue.put(_Job(load, step, start_event, tuple(keep), finish))
        return load

    def _forked(self) -> bool:
        """Whether this loader was made in a parent process (its thread is not in this one)."""
        return self._pid != _this_process

    def _check_process(self, load: LayerLoad | None) -> None:
        """Raise :class:`ForkedLoaderError` at once where this loader belongs to the process this one forked from."""
        if self._pid != _this_process:
            what = f"{load.what!r} was submitted" if load is not None else f"this layer loader ({self.device}) was made"
            raise ForkedLoaderError(
                f"{what} in process {self._pid}, which forked this one ({_this_process}); its thread and copies "
                "stay in that process. Take this process's loader with layer_loader(device) and submit again"
            )

    def describe_state(self) -> str:
        """What the thread is doing now, in words (for timeouts)."""
        current = self._current
        if not self._thread.is_alive():
            return "the loader's thread is not running"
        if current is None:
            return "the loader's thread is idle"
        load, layer, since = current
        busy = time.monotonic() - since
        return f"the loader's thread has been submitting layer {layer} of {load.what!r} for {busy:.3f} s"

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking jobs; the thread ends after the jobs already queued."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                if self.cuda:
                    with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                        self._run_job(job)
                else:
                    self._run_job(job)
            except BaseException as exc:  # noqa: BLE001 - the job carries it to its consumers
                load = job.load
                if load._error is None:
                    load._fail(load._submitted, exc)
                load._close(None, None, self._settle_marker())
            finally:
                self._current = None

    def _run_job(self, job: _Job) -> None:
        load, stream = job.load, self.stream
        load.submitted_at = time.perf_counter()
        start = finish = None
        if stream is not None:
            for start_event in job.start if isinstance(job.start, tuple) else (job.start,):
                if start_event is not None:
                    stream.wait_event(start_event)  # recorded by the caller before it submitted this job
            if load.timing:
                start = torch.cuda.Event(enable_timing=True)
                start.record(stream)
        ends = _stepping.ends = []
        try:
            for layer in range(load.layers):
                if load._cancel is not None:
                    try:
                        _run_ends(ends, failed=True)
                    finally:
                        load._fail(layer, LayerLoadCancelled(f"{load._cancel} before layer {layer} was submitted"))
                    break
                self._current = (load, layer, time.monotonic())
                try:
                    job.step(layer)
                except BaseException as exc:  # noqa: BLE001 - raised by the consumer's wait, not here
                    try:
                        _run_ends(ends, failed=True)
                    finally:
                        load._fail(layer, exc)
                    break
                event = None
                if stream is not None:
                    event = torch.cuda.Event()
                    event.record(stream)
                load._layer_done(event)
            _run_ends(ends, failed=False)
        finally:
            _stepping.ends = None
        if job.finish is not None:
            try:
                job.finish()
            except BaseException as exc:  # noqa: BLE001 - raised by the consumer's wait, not here
                if load._error is None:
                    load._fail(load.layers - 1, exc)
        if stream is not None:
            for t in job.keep:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(stream)
            finish = torch.cuda.Event(enable_timing=load.timing)
            finish.record(stream)  # after every copy the job enqueued, failed or not: it is also the settle event
        job.keep = ()
        load._close(start, finish, finish)

    def _settle_marker(self) -> Any:
        """After a job failed outside its steps: an event after whatever it enqueued, or a host wait for it."""
        if self.stream is None:
            return None
        try:
            event = torch.cuda.Event()
            event.record(self.stream)
            return event
        except BaseException:  # noqa: BLE001 - no event to give: wait here instead, before the consumers learn
            try:
                self.stream.synchronize()
            except BaseException:  # noqa: BLE001 - a lost context: nothing of this process runs on the device
                pass
            return None


def _own_stream(device: torch.device) -> torch.cuda.Stream:
    """A new non-blocking stream of the device, made for this loader alone."""
    with torch.cuda.device(device):
        # torch.cuda.Stream() takes one from a small shared pool; a stream made with a priority
        # outside the pool's is still pooled, so go through cudaStreamCreateWithFlags instead.
        ptr = _create_stream()
        if ptr is None:
            return torch.cuda.Stream(device)
        return torch.cuda.ExternalStream(ptr, device=device)


def _create_stream() -> int | None:
    """``cudaStreamCreateWithFlags(cudaStreamNonBlocking)`` through the CUDA runtime torch loaded."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart" in line})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        handle = ctypes.c_void_p()
        if lib.cudaStreamCreateWithFlags(ctypes.byref(handle), ctypes.c_uint(1)) == 0 and handle.value:
            return handle.value
    return None


_loaders: dict[str, LayerLoader] = {}
_loaders_lock = threading.Lock()
_this_process = os.getpid()


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads: its first layer_loader() call makes its own loader."""
    global _loaders_lock, _this_process
    _this_process = os.getpid()
    _loaders_lock = threading.Lock()  # a parent thread may have held it at the fork
    _loaders.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def layer_loader(device: torch.device | str) -> LayerLoader:
    """The process's layer loader for ``device`` (made on first use; one thread and stream per device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    loader = _loaders.get(key)
    if loader is None or loader._closed:
        with _loaders_lock:
            loader = _loaders.get(key)
            if loader is None or loader._closed:
                loader = _loaders[key] = LayerLoader(device)
    return loader


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ENV_TIMEOUT",
    "ForkedLoaderError",
    "LayerLoad",
    "LayerLoadCancelled",
    "LayerLoadError",
    "LayerLoadTimeout",
    "LayerLoader",
    "PendingEvent",
    "SettledEvent",
    "at_load_end",
    "layer_loader",
]
