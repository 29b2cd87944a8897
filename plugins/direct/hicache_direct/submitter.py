"""Copy submission off the caller's thread, gated on the caller's stream by stream memory operations.

The driver spends about a microsecond per descriptor in ``cudaMemcpyBatchAsync``, so a
server that issues every layer's load before the forward (SGLang's
``submit_host_to_device`` loops over the layers on the scheduler thread) pays 32 layers
x 256 descriptors of driver time before its first GEMM is even queued. Here the caller
pays two stream memory operations per call and a queue put; a worker thread submits
the copies on a side stream of its own.

Order, per call on the caller's stream ``S`` with side stream ``W`` and the call's
sequence number ``n`` (``S`` and ``W`` each have one 32-bit word, ``start`` and
``done``, in device memory):

* the caller, before it returns: ``S: write start = n``, ``S: wait until done >= n``;
* the worker, later: ``W: wait until start >= n``, the copies, ``W: write done = n``.

So the copies begin only once ``S`` has reached the call (what came before it on ``S``,
a producer of a backup's source or a user of a load's destination, is done), and
nothing queued on ``S`` after the call (the event a server records after each layer)
runs before the copies are done: the same order as copies queued on ``S`` itself.
One side stream per caller stream, jobs in the order the caller made them, so each
word only grows (the comparison is cyclic, ``(int32)(value - n) >= 0``, so wrapping at
2**32 is harmless). The side stream is made with ``cudaStreamCreateWithFlags``, never
taken from torch's stream pool, which may hand out the caller's own stream again (the
worker's waits would then queue behind the caller's wait: a deadlock). A new gate's words are
zeroed on its side stream, and the host waits for that stream before the gate is used: nothing
here goes through the legacy stream, whose pageable copies may land after the non-blocking
streams' first write (see :meth:`SubmitThread._new_gate`).

Errors: bad indices are refused by the caller (bounds are checked before the job is
queued). A copy the driver refuses in the worker still writes ``done`` (else ``S``
would wait forever), and the error is raised by the copier's next call and by
:meth:`SubmitThread.flush`, naming the run. Streams under graph capture, the legacy and
per-thread default streams, and calls of few copies are submitted on the caller's
thread as before.

One caveat: the worker needs the GIL between driver calls. A thread that blocks on the
GPU while holding the GIL (a C extension that synchronises without releasing it) before
the worker has submitted would wait forever; torch's own synchronising calls release
the GIL. A worse one, measured on the H200 (``scripts/gpu/direct_aliasing_check.py``): the caller's
wait for ``done`` is queued before the worker's copies, so a stream that shares a hardware queue
with the side stream and waits on that wait (a consumer of a layer's event) holds the copies back
for ever, with 2, 8 or 32 CUDA_DEVICE_MAX_CONNECTIONS. The worker is therefore opt-in
(``HICACHE_DIRECT_THREAD=1``), for processes that know their streams.

A second caveat, from the driver's documentation of stream memory operations: the order they
set up is invisible to CUDA's scheduler, which may serialise work "in an improper order". The
device runs streams through a few hardware work queues (``CUDA_DEVICE_MAX_CONNECTIONS``; SGLang
sets 8), streams beyond that share one, and a shared queue runs in submission order. Here the
caller's wait for ``done`` (and whatever the server queues after the call that depends on it,
such as a consumer's wait for a layer's event) is submitted *before* the worker's copies that
release it; if the side stream shares a queue with such a stream, its copies sit behind that
wait forever. No CUDA-visible dependency can express a wait for work not yet submitted, so this
cannot be ruled out where streams outnumber the queues; with one queue it is certain, and the
worker is refused (:class:`StreamOpsRefused`, so the copier stays on the caller's thread).
``scripts/gpu/direct_aliasing_check.py`` measures whether it happens with the default queues.

A caller's stream that waits on a ``done`` word nobody writes would hang the server with no
error at all, so where the worker's own write of ``done`` fails, it waits for its side stream
and writes the word from the host instead (the error is still raised by the next call).
``HICACHE_DIRECT_TRACE=<file>`` appends one line per job step (sequence number, streams, the
driver's return codes) to that file, for a hang that has to be read after the fact; with it, a
worker idle for 10 s reads each gate's words and names every stream still waiting, with its
last sequence number and both words (:meth:`SubmitThread.words`).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import queue
import threading
import weakref
from collections.abc import Callable

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ (cyclic: (int32_t)(*addr - value) >= 0)
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: the write follows a memory fence
_NON_BLOCKING = 1  # cudaStreamNonBlocking: no implicit sync with the legacy default stream
_H2D, _D2H = 1, 2  # cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost
MASK = (1 << 32) - 1
_TRACE = os.environ.get("HICACHE_DIRECT_TRACE") or None
_TRACE_IDLE_S = 10.0  # with a trace: how long the worker idles before it reads the words of waiting streams


def _trace(what: str) -> None:
    if _TRACE is not None:
        with open(_TRACE, "a") as f:
            f.write(f"{threading.current_thread().name} {what}\n")


def next_sequence(value: int) -> int:
    """The sequence number after ``value`` (32-bit, cyclic, never 0: the words start at 0)."""
    value = (value + 1) & MASK
    return value or 1


def reached(word: int, target: int) -> bool:
    """What ``cuStreamWaitValue32(GEQ)`` tests: ``(int32_t)(word - target) >= 0``."""
    diff = (word - target) & MASK
    return diff < (1 << 31)


@functools.lru_cache(maxsize=1)
def libcuda() -> ctypes.CDLL:
    """The CUDA driver library (already loaded by the runtime torch uses)."""
    return ctypes.CDLL("libcuda.so.1")


class StreamOps:
    """``cuStreamWriteValue32`` and ``cuStreamWaitValue32`` through ctypes (the ``_v2`` entry points
    where exported: CUDA 12 made them the default and kept the old names as aliases)."""

    def __init__(self) -> None:
        lib = libcuda()
        self.write = self._bind(lib, "cuStreamWriteValue32")
        self.wait = self._bind(lib, "cuStreamWaitValue32")

    @staticmethod
    def _bind(lib: ctypes.CDLL, name: str):
        fn = getattr(lib, name + "_v2", None) or getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
        return fn


class StreamOpsRefused(RuntimeError):
    """The driver refused a stream memory operation on the caller's stream (nothing was queued)."""


class _Gate:
    """One caller stream's side stream, its two device words, and the last sequence number used."""

    __slots__ = ("stream", "side", "start", "done", "seq")

    def __init__(self, stream: int, side: int, words: int) -> None:
        self.stream, self.side = stream, side
        self.start, self.done = words, words + 4
        self.seq = 0


class SubmitThread:
    """A worker thread that submits one copier's jobs on per-caller-stream side streams (module docstring).

    ``submit(stream, make_batch, describe)`` is what the caller's thread runs; ``make_batch``
    builds the copy list in the worker (so it owns the descriptor buffers it fills), and
    ``copier._submit(batch, describe, side)`` submits it there.
    """

    def __init__(self, copier, ops: StreamOps | None = None) -> None:
        self.copier = copier
        self.ops = ops if ops is not None else StreamOps()
        self._gates: dict[int, _Gate] = {}
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.submitted = 0
        self._probe: ctypes.c_void_p | None = None
        _live.add(self)

    # ---- the caller's side ---------------------------------------------------------------------

    def submit(self, stream: int, make_batch: Callable, describe: Callable) -> None:
        """Gate ``stream`` on the job and queue it; raises :class:`StreamOpsRefused` (before anything is
        queued) where the driver refuses a stream memory operation."""
        gate = self._gates.get(stream) or self._gate(stream)
        with self._lock:  # two caller threads on one stream: numbers in the order they reach the stream
            seq = gate.seq = next_sequence(gate.seq)
            err = self.ops.write(stream, gate.start, seq, _WRITE_DEFAULT)
            if err:
                raise StreamOpsRefused(f"cuStreamWriteValue32 failed with CUDA error {err}")
            err = self.ops.wait(stream, gate.done, seq, _WAIT_GEQ)
            if err:  # the start word moved ahead alone: harmless, the worker's waits only need it to grow
                raise StreamOpsRefused(f"cuStreamWaitValue32 failed with CUDA error {err}")
            with self._idle:
                self._pending += 1
            self._jobs.put((gate, seq, make_batch, describe))
        _trace(f"queued seq {seq} on stream {stream:#x} (side {gate.side:#x})")
        if self._thread is None:
            self._start()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued job is submitted (not copied), then raise a worker error if any."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0, timeout)
        self.raise_error()

    def raise_error(self) -> None:
        error = self.error
        if error is not None:
            self.error = None
            from .memcpy import CopyError

            raise CopyError(f"an earlier copy submitted from direct's worker thread failed (its stream went on, "
                            f"those bytes did not move): {error}") from error  # fmt: skip

    def _gate(self, stream: int) -> _Gate:
        lib = self.copier._lib
        with self._lock:
            gate = self._gates.get(stream)
            if gate is not None:
                return gate
            if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip() == "1":
                raise StreamOpsRefused(
                    "CUDA_DEVICE_MAX_CONNECTIONS=1: every stream shares one hardware queue, so the side stream's "
                    "copies would queue behind the caller's wait for them (a deadlock)"
                )
            gate = self._gates[stream] = self._new_gate(lib, stream)
        return gate

    def _new_gate(self, lib, stream: int) -> _Gate:
        """A side stream and two zeroed words on the copier's device, the zeros landed before it returns.

        The zeros go on the side stream itself and the host waits for that stream: a plain
        ``cudaMemcpy`` from pageable memory returns once the bytes are staged, and its DMA then
        runs on the legacy stream, which the non-blocking caller and side streams never wait
        for, so it could land after the first call's ``S: write start = 1`` (the side stream
        then waits for ``start >= 1`` forever, and ``S`` for ``done``, with no job left on the
        host). Nothing here touches the legacy stream.
        """
        device = ctypes.c_int(-1)
        self._check(lib.cudaGetDevice(ctypes.byref(device)), "cudaGetDevice")
        switch = device.value != self.copier.index  # the stream and words belong to the copier's device
        if switch:
            self._check(lib.cudaSetDevice(ctypes.c_int(self.copier.index)), "cudaSetDevice")
        try:
            side = ctypes.c_void_p(0)
            words = ctypes.c_void_p(0)
            self._check(lib.cudaStreamCreateWithFlags(ctypes.byref(side), ctypes.c_uint(_NON_BLOCKING)),
                        "cudaStreamCreateWithFlags")  # fmt: skip
            self._check(lib.cudaMalloc(ctypes.byref(words), ctypes.c_size_t(8)), "cudaMalloc")
            self._check(lib.cudaMemsetAsync(words, ctypes.c_int(0), ctypes.c_size_t(8), side), "cudaMemsetAsync")
            self._check(lib.cudaStreamSynchronize(side), "cudaStreamSynchronize")
        finally:
            if switch:
                lib.cudaSetDevice(device)
        _trace(f"gate for stream {stream:#x}: side {side.value:#x}, words {words.value:#x} zeroed")
        return _Gate(stream, side.value, words.value)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hicache-direct-submit", daemon=True)
                self._thread.start()

    def _check(self, err: int, what: str) -> None:
        if err:
            from .memcpy import CopyError

            raise CopyError(f"{what} failed with CUDA error {err}")

    # ---- the worker's side ---------------------------------------------------------------------

    def _run(self) -> None:
        copier = self.copier
        copier._lib.cudaSetDevice(copier.index)
        ops = self.ops
        while True:
            if _TRACE is None:
                job = self._jobs.get()
            else:
                try:
                    job = self._jobs.get(timeout=_TRACE_IDLE_S)
                except queue.Empty:  # idle: where a stream still waits, its words say on which side
                    self._trace_words()
                    continue
            if job is None:
                return
            gate, seq, make_batch, describe = job
            try:
                self._check(ops.wait(gate.side, gate.start, seq, _WAIT_GEQ), "cuStreamWaitValue32")
                copier._submit(make_batch(), describe, gate.side)
                _trace(f"submitted seq {seq} on side {gate.side:#x}")
            except BaseException as exc:  # noqa: BLE001 - reported by the next call; the stream must go on
                _trace(f"seq {seq} failed: {exc!r}")
                if self.error is None:
                    self.error = exc
            finally:
                err = ops.write(gate.side, gate.done, seq, _WRITE_DEFAULT)
                if err:
                    self._release_from_host(gate, seq, err)
                self.submitted += 1
                with self._idle:
                    self._pending -= 1
                    if self._pending == 0:
                        self._idle.notify_all()

    def _release_from_host(self, gate: _Gate, seq: int, err: int) -> None:
        """The worker could not queue its write of ``done``: once the side stream has run what it
        was given, write the word from the host, so that the caller's stream goes on (and the
        error is raised by the next call rather than as a hang)."""
        lib = self.copier._lib
        side = ctypes.c_void_p(gate.side)
        sync_err = lib.cudaStreamSynchronize(side)
        word = ctypes.c_uint32(seq)
        # On the side stream and waited for (as the zeros of a new gate): a legacy-stream copy could
        # land after the next job's write of done = seq + 1 and take the word back.
        copy_err = lib.cudaMemcpyAsync(ctypes.c_void_p(gate.done), ctypes.byref(word), ctypes.c_size_t(4), _H2D, side)
        copy_err = copy_err or lib.cudaStreamSynchronize(side)
        _trace(f"seq {seq}: done write refused ({err}); side synchronised ({sync_err}), done written from the "
               f"host ({copy_err})")  # fmt: skip
        if self.error is None:
            self.error = RuntimeError(
                f"cuStreamWriteValue32 failed with CUDA error {err} on direct's side stream; the caller's stream "
                f"was released from the host ({'ok' if not copy_err else f'that failed too: CUDA error {copy_err}'})"
            )

    def words(self) -> dict[int, tuple[int, int, int]]:
        """``{caller stream: (last sequence number, start word, done word)}``, read from the device on a
        stream of its own (so it answers while the caller's and side streams are blocked)."""
        lib = self.copier._lib
        probe = self._probe
        if probe is None:
            handle = ctypes.c_void_p(0)
            self._check(lib.cudaStreamCreateWithFlags(ctypes.byref(handle), ctypes.c_uint(_NON_BLOCKING)),
                        "cudaStreamCreateWithFlags")  # fmt: skip
            probe = self._probe = handle
        out = {}
        for stream, gate in list(self._gates.items()):
            pair = (ctypes.c_uint32 * 2)(0, 0)
            self._check(lib.cudaMemcpyAsync(ctypes.byref(pair), ctypes.c_void_p(gate.start), ctypes.c_size_t(8),
                                            _D2H, probe), "cudaMemcpyAsync")  # fmt: skip
            self._check(lib.cudaStreamSynchronize(probe), "cudaStreamSynchronize")
            out[stream] = (gate.seq, pair[0], pair[1])
        return out

    def _trace_words(self) -> None:
        try:
            state = self.words()
        except Exception as exc:  # noqa: BLE001 - a diagnostic only
            _trace(f"idle: reading the words failed: {exc!r}")
            return
        for stream, (seq, start, done) in state.items():
            if not reached(done, seq):
                # start reached: the side stream holds (its wait or the copies); else the caller's stream never
                # wrote start (held by what came before on it), or a late write took the word back.
                where = "the side stream" if reached(start, seq) else "the caller's stream or the start word"
                _trace(f"idle with stream {stream:#x} waiting: seq {seq}, start {start}, done {done}: held on {where}")

    def close(self, timeout: float = 30.0) -> None:
        """Submit what is queued, then end the worker (at exit: streams waiting on it go on)."""
        if self._thread is not None:
            with self._idle:
                self._idle.wait_for(lambda: self._pending == 0, timeout)
            self._jobs.put(None)
            self._thread.join(timeout)
            self._thread = None


_live: weakref.WeakSet[SubmitThread] = weakref.WeakSet()


@atexit.register
def _drain_at_exit() -> None:
    for worker in list(_live):
        worker.close(timeout=10.0)


__all__ = ["MASK", "StreamOps", "StreamOpsRefused", "SubmitThread", "libcuda", "next_sequence", "reached"]
