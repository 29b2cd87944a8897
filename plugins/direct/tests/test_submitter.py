"""The worker-thread submission's ordering arithmetic (CPU), and its order on a GPU (HICACHE_TEST_DEVICE=cuda).

The stream-memory-operation gate compares 32-bit words cyclically, as ``cuStreamWaitValue32``
with ``CU_STREAM_WAIT_VALUE_GEQ`` does: ``(int32_t)(*addr - value) >= 0``. The sequence
numbers a caller stream hands out must therefore keep growing through the wrap at 2**32
and never return to 0, the value the words start at.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections import deque
from collections.abc import Callable

import pytest
import torch
from hicache_direct.memcpy import CopyError
from hicache_direct.submitter import MASK, SubmitThread, next_sequence, reached

import hicache_core as hc


def test_sequence_numbers_grow_through_the_wrap_and_skip_zero():
    assert next_sequence(0) == 1
    assert next_sequence(MASK - 1) == MASK
    assert next_sequence(MASK) == 1  # 0 is what a fresh word holds: never a target


@pytest.mark.parametrize("start", [0, 5, MASK - 3, (1 << 31) - 2])
def test_a_later_number_is_reached_only_once_written(start):
    seq = start
    history = []
    for _ in range(8):
        seq = next_sequence(seq)
        history.append(seq)
    for i, target in enumerate(history):
        for j, word in enumerate(history):
            assert reached(word, target) == (j >= i), (word, target)


def test_a_fresh_word_has_not_reached_a_new_gates_first_number():
    assert not reached(0, next_sequence(0))


# ---- the worker's bookkeeping against a modelled device (CPU) ------------------------------------------
#
# FakeGPU runs each stream's operations in order, as soon as they can run, on the calling thread: a write
# or a copy runs at once, a wait once its word has reached the value. What is queued on the legacy stream
# (0) lands late, as a pageable cudaMemcpy's DMA may: only when a side stream's first wait is queued (the
# worker thread is slower than a DMA) or when something synchronises the legacy stream. That is the
# schedule that hung the H200 while the zeros of a new gate went through the legacy stream.


class FakeGPU:
    def __init__(self, garbage: int = 0xDEADBEEF) -> None:
        self.lock = threading.RLock()
        self.mem: dict[int, int] = {}
        self.queues: dict[int, deque] = {0: deque()}
        self.callers: set[int] = set()
        self.ran: list[tuple[int, tuple]] = []
        self.garbage = garbage
        self.legacy_used = False
        self.device = 0
        self.set_device: list[int] = []
        self._handle, self._addr = 0x100, 0x10000

    def stream(self) -> int:
        with self.lock:
            handle, self._handle = self._handle, self._handle + 0x10
            self.queues[handle] = deque()
            return handle

    def enqueue(self, stream: int, op: tuple) -> None:
        with self.lock:
            if stream == 0:
                self.legacy_used = True
            self.queues[stream].append(op)
            self.run(hold_legacy=True)

    def _runnable(self, op: tuple) -> bool:
        return op[0] != "wait" or reached(self.mem[op[1]], op[2])

    def _execute(self, stream: int, op: tuple) -> None:
        kind = op[0]
        if kind in ("write", "set"):
            for i, value in enumerate(op[2] if kind == "set" else [op[2]]):
                self.mem[op[1] + 4 * i] = value
        elif kind == "read":
            values = [self.mem[op[1] + 4 * i] for i in range(len(op[2]))]
            for i, value in enumerate(values):
                op[2][i] = value
        self.ran.append((stream, op))

    def run(self, hold_legacy: bool = False) -> None:
        with self.lock:
            progress = True
            while progress:
                progress = False
                for stream, q in self.queues.items():
                    if stream == 0 and hold_legacy:
                        continue
                    while q and self._runnable(q[0]):
                        self._execute(stream, q.popleft())
                        progress = True

    def stuck(self) -> dict[int, tuple]:
        """Run everything that can run (the legacy stream too); what is left waits forever."""
        self.run()
        return {stream: q[0] for stream, q in self.queues.items() if q}

    def copies(self, stream: int) -> list:
        return [op[1] for s, op in self.ran if s == stream and op[0] == "copy"]


def _words(src, size: int) -> list[int]:
    raw = bytes(getattr(src, "_obj", src))[: size.value]  # a byref() or the array itself
    return [int.from_bytes(raw[i : i + 4], "little") for i in range(0, len(raw), 4)]


class FakeRuntime:
    """The CUDA runtime calls the submitter makes, on a FakeGPU (arguments as the submitter passes them)."""

    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu = gpu

    def cudaGetDevice(self, ref):
        ref._obj.value = self.gpu.device
        return 0

    def cudaSetDevice(self, device):
        device = getattr(device, "value", device)
        self.gpu.set_device.append(device)
        self.gpu.device = device
        return 0

    def cudaStreamCreateWithFlags(self, ref, flags):
        ref._obj.value = self.gpu.stream()
        return 0

    def cudaMalloc(self, ref, size):
        gpu = self.gpu
        with gpu.lock:
            addr, gpu._addr = gpu._addr, gpu._addr + 0x100
            for i in range(0, size.value, 4):
                gpu.mem[addr + i] = gpu.garbage
        ref._obj.value = addr
        return 0

    def cudaMemsetAsync(self, ptr, value, size, stream):
        assert value.value == 0
        self.gpu.enqueue(stream.value, ("set", ptr.value, [0] * (size.value // 4)))
        return 0

    def cudaMemcpy(self, dst, src, size, kind):
        # Pageable to device: the legacy stream is synchronised, the bytes staged, the DMA left queued.
        assert kind == 1
        self.cudaStreamSynchronize(ctypes.c_void_p(0))
        self.gpu.enqueue(0, ("set", dst.value, _words(src, size)))
        return 0

    def cudaMemcpyAsync(self, dst, src, size, kind, stream):
        if kind == 1:
            self.gpu.enqueue(stream.value or 0, ("set", dst.value, _words(src, size)))
        else:
            self.gpu.enqueue(stream.value or 0, ("read", src.value, dst._obj))
        return 0

    def cudaStreamSynchronize(self, stream):
        handle = stream.value or 0
        self.gpu.run(hold_legacy=handle != 0)
        return 0 if not self.gpu.queues[handle] else 999  # a real one would never return


class FakeOps:
    """cuStreamWriteValue32 / cuStreamWaitValue32 on the FakeGPU; ``refuse`` fails chosen writes."""

    def __init__(self, gpu: FakeGPU, refuse: Callable[[int, int], bool] | None = None) -> None:
        self.gpu = gpu
        self.refuse = refuse

    def write(self, stream, addr, value, flags):
        if self.refuse is not None and self.refuse(stream, value):
            return 1
        self.gpu.enqueue(stream, ("write", addr, value))
        return 0

    def wait(self, stream, addr, value, flags):
        gpu = self.gpu
        with gpu.lock:
            if stream not in gpu.callers:
                gpu.run()  # the worker is slower than a DMA: what the legacy stream holds has landed
            gpu.enqueue(stream, ("wait", addr, value))
        return 0


class FakeCopier:
    def __init__(self, gpu: FakeGPU, index: int = 0) -> None:
        self.gpu = gpu
        self._lib = FakeRuntime(gpu)
        self.index = index

    def _submit(self, batch, describe, stream):
        self.gpu.enqueue(stream, ("copy", batch))


@pytest.fixture
def fake():
    gpu = FakeGPU()
    workers = []

    def make(refuse=None, index=0):
        worker = SubmitThread(FakeCopier(gpu, index), FakeOps(gpu, refuse))
        workers.append(worker)
        return worker

    yield gpu, make
    for worker in workers:
        worker.close(timeout=5)


def _caller(gpu: FakeGPU) -> int:
    stream = gpu.stream()
    gpu.callers.add(stream)
    return stream


def test_a_new_gates_words_are_zero_on_the_device_before_it_is_used(fake):
    """cudaMalloc'd words hold garbage; the zeros have landed when the gate is made, and the legacy
    stream (whose pageable copies land late, after the non-blocking streams' work) is never used."""
    gpu, make = fake
    worker = make()
    stream = _caller(gpu)
    gate = worker._gate(stream)
    assert gpu.mem[gate.start] == 0 and gpu.mem[gate.done] == 0
    assert not any(gpu.queues.values()), gpu.queues
    assert not gpu.legacy_used
    assert gate.side != stream and gate.side in gpu.queues
    assert worker._gate(stream) is gate


def test_first_jobs_of_a_gate_finish_when_the_legacy_stream_is_slow(fake):
    """The H200 hang's schedule: the caller's stream writes start = 1 at once, the zeros of a legacy-stream
    copy would land after it, then the worker queues its wait. Every stream must still finish."""
    gpu, make = fake
    worker = make()
    stream = _caller(gpu)
    for n in range(3):
        worker.submit(stream, lambda n=n: f"batch {n}", lambda *a: "")
    worker.flush(timeout=5)
    assert worker.submitted == 3
    assert gpu.stuck() == {}
    gate = worker._gates[stream]
    assert gpu.copies(gate.side) == ["batch 0", "batch 1", "batch 2"]
    assert (gpu.mem[gate.start], gpu.mem[gate.done]) == (3, 3)
    assert not gpu.legacy_used


def test_copies_wait_for_the_callers_stream_and_hold_what_follows_on_it(fake):
    """A caller's stream held back by earlier work: the copies wait for it, and what the caller queues
    after the call (a layer's event) runs only after the copies."""
    gpu, make = fake
    worker = make()
    stream = _caller(gpu)
    hold = 0x900000
    gpu.mem[hold] = 0
    gpu.enqueue(stream, ("wait", hold, 1))  # a producer not yet done
    worker.submit(stream, lambda: "layer 0", lambda *a: "")
    gpu.enqueue(stream, ("copy", "event after layer 0"))
    worker.flush(timeout=5)
    gate = worker._gates[stream]
    assert gpu.copies(gate.side) == []  # submitted, but held behind the side stream's wait
    assert worker.words() == {stream: (1, 0, 0)}
    gpu.mem[hold] = 1
    assert gpu.stuck() == {}
    order = [op[1] for s, op in gpu.ran if op[0] == "copy"]
    assert order == ["layer 0", "event after layer 0"]
    assert worker.words() == {stream: (1, 1, 1)}


def test_two_streams_have_their_own_gates_and_side_streams(fake):
    gpu, make = fake
    worker = make()
    a, b = _caller(gpu), _caller(gpu)
    for n in range(4):
        worker.submit(a if n % 2 == 0 else b, lambda n=n: n, lambda *x: "")
    worker.flush(timeout=5)
    assert gpu.stuck() == {}
    ga, gb = worker._gates[a], worker._gates[b]
    assert ga.side != gb.side and ga.start != gb.start
    assert gpu.copies(ga.side) == [0, 2] and gpu.copies(gb.side) == [1, 3]
    assert (gpu.mem[ga.done], gpu.mem[gb.done]) == (2, 2)


def test_a_refused_done_write_is_released_in_side_stream_order_and_raised(fake):
    """The worker's write of done = 1 refused: the word is written from the host on the side stream (never
    the legacy stream, whose synchronisation could wait on a blocking stream gated on a later job), the
    later jobs go on, and the error is raised by flush."""
    gpu, make = fake
    worker = make(refuse=lambda stream, value: stream not in gpu.callers and value == 1)
    stream = _caller(gpu)
    worker.submit(stream, lambda: "first", lambda *a: "")
    worker.submit(stream, lambda: "second", lambda *a: "")
    with pytest.raises(CopyError, match="cuStreamWriteValue32 failed with CUDA error 1 on direct's side stream"):
        worker.flush(timeout=5)
    assert gpu.stuck() == {}
    gate = worker._gates[stream]
    assert gpu.copies(gate.side) == ["first", "second"]
    assert gpu.mem[gate.done] == 2
    assert not gpu.legacy_used


def test_a_gate_is_made_on_the_copiers_device_and_the_callers_device_restored(fake):
    gpu, make = fake
    worker = make(index=0)
    gpu.device = 1
    worker._gate(_caller(gpu))
    assert gpu.set_device == [0, 1] and gpu.device == 1


def test_one_hardware_queue_refuses_the_worker_before_anything_is_queued(fake, monkeypatch):
    """With CUDA_DEVICE_MAX_CONNECTIONS=1 every stream runs through one queue in submission order: the
    caller's wait for done would sit ahead of the side stream's copies for good."""
    from hicache_direct.submitter import StreamOpsRefused

    gpu, make = fake
    worker = make()
    stream = _caller(gpu)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(StreamOpsRefused, match="CUDA_DEVICE_MAX_CONNECTIONS=1: every stream shares one hardware"):
        worker.submit(stream, lambda: "never", lambda *a: "")
    assert worker._gates == {} and worker._pending == 0 and worker._thread is None
    assert not any(gpu.queues.values()) and gpu.ran == []
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    worker.submit(stream, lambda: "layer 0", lambda *a: "")
    worker.flush(timeout=5)
    assert gpu.stuck() == {} and gpu.copies(worker._gates[stream].side) == ["layer 0"]


def test_the_trace_names_a_stream_left_waiting(fake, tmp_path, monkeypatch):
    import hicache_direct.submitter as submitter

    gpu, make = fake
    worker = make()
    stream = _caller(gpu)
    hold = 0x900000
    gpu.mem[hold] = 0
    gpu.enqueue(stream, ("wait", hold, 1))
    worker.submit(stream, lambda: "layer 0", lambda *a: "")
    worker.flush(timeout=5)
    trace = tmp_path / "trace.txt"
    monkeypatch.setattr(submitter, "_TRACE", str(trace))
    worker._trace_words()
    assert f"idle with stream {stream:#x} waiting: seq 1, start 0, done 0: held on the caller's stream" in (
        trace.read_text()
    )
    gpu.mem[hold] = 1
    gpu.stuck()
    trace.write_text("")
    worker._trace_words()
    assert trace.read_text() == ""


def _cuda() -> bool:
    return os.environ.get("HICACHE_TEST_DEVICE") == "cuda" and torch.cuda.is_available()


@pytest.mark.skipif(not _cuda(), reason="needs CUDA (HICACHE_TEST_DEVICE=cuda): the worker gates real streams")
@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_worker_loads_land_before_each_layers_event_with_the_stream_held_back(layout):
    """32 layers x 128 pages on a held-back load stream, from the worker; a consumer stream copies each
    layer's rows right after that layer's event; every copy equals the host bytes."""
    page, pages, layers = 64, 128, 32
    dev = hc.MHADevicePool(2 * pages * page, page, torch.bfloat16, 2, 16, layers, "cuda")
    host = hc.make_host_pool(dev, layout=layout, io_backend="direct", size=dev.size + page)
    twin = hc.MHADevicePool(2 * pages * page, page, torch.bfloat16, 2, 16, layers, "cuda")
    ref = hc.make_host_pool(twin, layout=layout, io_backend="reference", size=dev.size + page)
    gen = torch.Generator().manual_seed(3)
    for t in host.plan.host_buffers.values():
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=gen))
    for name, t in host.plan.host_buffers.items():
        ref.plan.host_buffers[name].copy_(t)
    hp = torch.randperm(host.page_num, generator=gen)[:pages]
    dp = torch.randperm(dev.size // page, generator=gen)[:pages]
    h = (hp[:, None] * page + torch.arange(page)).reshape(-1)
    d = (dp[:, None] * page + torch.arange(page)).reshape(-1)
    impl = host.implementation_for(hc.LOAD)
    assert not impl.copier.thread  # opt-in: off by default (it can deadlock, see memcpy.CudaCopier.thread)
    impl.copier.thread, impl.copier.thread_max = True, 0  # 256 copies per layer: the worker, whatever the default span
    for layer in range(layers):
        ref.load_to_device_per_layer(twin, h, d.cuda(), layer, "reference")
    torch.cuda.synchronize()
    for t in dev.k_buffer + dev.v_buffer:
        t.fill_(7)
    load, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    events = [torch.cuda.Event() for _ in range(layers)]
    rows = d.cuda()
    seen = []
    with torch.cuda.stream(load):
        torch.cuda._sleep(20_000_000)
        for layer in range(layers):
            host.load_to_device_per_layer(dev, h, d, layer, "direct")
            events[layer].record(load)
    with torch.cuda.stream(consumer):
        for layer in range(layers):
            consumer.wait_event(events[layer])
            seen.append((dev.k_buffer[layer][rows].clone(), dev.v_buffer[layer][rows].clone()))
    torch.cuda.synchronize()
    impl.flush()
    assert impl.copier._worker is not None and impl.copier._worker.submitted >= layers
    for layer in range(layers):  # as int16: random bf16 bytes hold NaNs, which never compare equal
        assert torch.equal(seen[layer][0].view(torch.int16), twin.k_buffer[layer][rows].view(torch.int16)), layer
        assert torch.equal(seen[layer][1].view(torch.int16), twin.v_buffer[layer][rows].view(torch.int16)), layer


@pytest.mark.skipif(not _cuda(), reason="needs CUDA (HICACHE_TEST_DEVICE=cuda): the worker gates real streams")
def test_every_new_gates_first_call_finishes_on_an_idle_stream():
    """The H200 hang's window, opened 40 times: a new gate (new words) and its first call on an idle
    stream, whose write of start runs at once. Each call's event must complete (polled, never a hang),
    and the bytes land."""
    import time

    page, pages, layers = 64, 32, 2
    dev = hc.MHADevicePool(2 * pages * page, page, torch.bfloat16, 2, 16, layers, "cuda")
    host = hc.make_host_pool(dev, layout="page_first_direct", io_backend="direct", size=dev.size + page)
    gen = torch.Generator().manual_seed(11)
    for t in host.plan.host_buffers.values():
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=gen))
    hp = torch.randperm(host.page_num, generator=gen)[:pages]
    dp = torch.randperm(dev.size // page, generator=gen)[:pages]
    h = (hp[:, None] * page + torch.arange(page)).reshape(-1)
    d = (dp[:, None] * page + torch.arange(page)).reshape(-1)
    copier = host.implementation_for(hc.LOAD).copier
    copier.thread, copier.thread_min, copier.thread_max = True, 1, 0
    stream = torch.cuda.Stream()
    for attempt in range(40):
        if copier._worker is not None:
            copier._worker.close(timeout=10)
            copier._worker = None  # the next call makes a new worker: a new gate, new words
        event = torch.cuda.Event()
        with torch.cuda.stream(stream):
            host.load_to_device_per_layer(dev, h, d, attempt % layers, "direct")
            event.record(stream)
        worker = copier._worker
        assert worker is not None and copier.no_thread is None, copier.thread_path
        deadline = time.monotonic() + 10
        while not event.query():
            assert time.monotonic() < deadline, f"attempt {attempt}: stream still waiting, words {worker.words()}"
            time.sleep(0.001)
        assert worker.submitted == 1
    torch.cuda.synchronize()
    rows = d.cuda()
    layer = 39 % layers
    expect = torch.empty_like(dev.k_buffer[layer][rows])
    ref_dev = hc.MHADevicePool(2 * pages * page, page, torch.bfloat16, 2, 16, layers, "cuda")
    ref = hc.make_host_pool(ref_dev, layout="page_first_direct", io_backend="reference", size=dev.size + page)
    for name, t in host.plan.host_buffers.items():
        ref.plan.host_buffers[name].copy_(t)
    ref.load_to_device_per_layer(ref_dev, h, rows, layer, "reference")
    torch.cuda.synchronize()
    expect.copy_(ref_dev.k_buffer[layer][rows])
    assert torch.equal(dev.k_buffer[layer][rows].view(torch.int16), expect.view(torch.int16))
