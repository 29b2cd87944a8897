"""Layer-wise loads off the caller's thread (hicache_core.loads.layer_loads), on CPU pools.

On the CPU the loader's thread runs the copies itself, so a consumer's wait is the host wait
of the GPU schedule (until its layer was submitted) without the event: the same order. The
second half models the GPU's side: streams on a few in-order hardware queues, and checks that
the loader's protocol (waits only on events already recorded) cannot deadlock whatever the
number of queues, where the retired protocol (a wait queued before the copies it waits for) can.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from hicache_core import MHADevicePool, make_host_pool
from hicache_core.loads.layer_loads import (
    ENV_TIMEOUT,
    LayerLoadCancelled,
    LayerLoader,
    LayerLoadError,
    LayerLoadTimeout,
    PendingEvent,
    layer_loader,
    timeout_from_env,
)

LAYERS = 4


def _pools(io_backend: str = "direct", layout: str = "page_first_direct"):
    dev = MHADevicePool(size=256, page_size=16, layer_num=LAYERS, head_num=2, head_dim=8, dtype=torch.bfloat16,
                        device="cpu")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for t in dev.k_buffer + dev.v_buffer:
        t.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, t.shape, generator=gen, dtype=torch.int16))
    host = make_host_pool(dev, layout=layout, io_backend=io_backend)
    return dev, host


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # compared as bits: random bf16 patterns include NaNs


def _written(dev, slots):
    return [(_bits(dev.k_buffer[layer][slots]), _bits(dev.v_buffer[layer][slots])) for layer in range(LAYERS)]


def _equal(dev, slots, written, layer) -> bool:
    k, v = written[layer]
    return torch.equal(_bits(dev.k_buffer[layer][slots]), k) and torch.equal(_bits(dev.v_buffer[layer][slots]), v)


@pytest.mark.parametrize("io_backend, layout", [("direct", "page_first_direct"), ("torch", "page_first"),
                                                ("direct", "layer_first")])  # fmt: skip
def test_submit_load_moves_every_layer_byte_exact(io_backend, layout):
    dev, host = _pools(io_backend, layout)
    src = torch.arange(32, 64)
    h = host.alloc(32)
    host.backup_from_device_all_layer(dev, h, src, io_backend)
    written = _written(dev, src)
    dst = torch.arange(128, 160)
    load = host.submit_load(dev, h, dst, io_backend)
    for layer in range(LAYERS):
        load.wait(layer)
        assert _equal(dev, dst, written, layer), layer
    load.result()
    assert load.finish_event.query() and "4/4 layers submitted, done" in repr(load)


def test_one_door_loads_the_parts_of_several_pools_step_by_step_checking_indices_once():
    """submit_loads: each step runs every part's layer in order (a pool may have no layer at a step); each
    pool's indices are checked and converted once per load, not once per layer."""
    from hicache_core.loads.pool_loads import CallPerLayer, submit_loads

    dev_a, host_a = _pools("torch", "page_first")
    dev_b, host_b = _pools()
    ha, hb = host_a.alloc(16), host_b.alloc(32)
    host_a.backup_from_device_all_layer(dev_a, ha, torch.arange(16), "torch")
    host_b.backup_from_device_all_layer(dev_b, hb, torch.arange(32), "direct")
    wa, wb = _written(dev_a, torch.arange(16)), _written(dev_b, torch.arange(32))
    steps = []
    checked = []
    check = host_a._indices

    def counting(*args, **kw):
        checked.append(args[1])  # the layer id: None for a load's one check
        return check(*args, **kw)

    host_a._indices = counting
    da, db = torch.arange(64, 80), torch.arange(96, 128)
    parts = [
        CallPerLayer(lambda i: steps.append(("first", i)), "cpu"),
        host_a.prepare_load(dev_a, ha, da, "torch", list(range(LAYERS))),
        host_b.prepare_load(dev_b, hb, db, "direct", [None, 0, None, 3]),
        CallPerLayer(lambda i: steps.append(("last", i)), "cpu"),
    ]
    load = submit_loads(parts, LAYERS, what="two pools")
    load.result()
    assert checked == [None]  # the load's one check, at prepare_load; no layer checked again
    assert steps == [(w, i) for i in range(LAYERS) for w in ("first", "last")]
    assert all(_equal(dev_a, da, wa, layer) for layer in range(LAYERS))
    assert _equal(dev_b, db, wb, 0) and _equal(dev_b, db, wb, 3)
    assert not _equal(dev_b, db, wb, 1) and not _equal(dev_b, db, wb, 2)  # no layer of b at steps 0 and 2
    with pytest.raises(ValueError, match="needs at least one part"):
        submit_loads([], LAYERS)


def test_layers_run_on_the_loaders_thread_and_the_caller_returns_first():
    dev, host = _pools()
    h = host.alloc(16)
    host.backup_from_device_all_layer(dev, h, torch.arange(16), "direct")
    written = _written(dev, torch.arange(16))
    gate, seen = threading.Event(), []
    impl = host.implementation_for("load_to_device_per_layer")
    real = impl.load_to_device_per_layer

    def held(h_, d_, layer):
        seen.append(threading.current_thread().name)
        assert gate.wait(10)
        real(h_, d_, layer)

    impl.load_to_device_per_layer = held
    dst = torch.arange(64, 80)
    load = host.submit_load(dev, h, dst, "direct")
    assert not load.submitted(0) and not load.finish_event.query()  # the caller is back before any copy
    gate.set()
    for layer in range(LAYERS):
        load.wait(layer)
        assert _equal(dev, dst, written, layer)
    assert set(seen) == {"hicache-layer-loader-cpu"}


def test_bad_input_is_refused_before_anything_is_queued():
    dev, host = _pools()
    h = host.alloc(16)
    before = [t.clone() for t in dev.k_buffer]
    with pytest.raises(ValueError, match=r"must be 1-D and of equal length, got \(16,\) and \(8,\)"):
        host.submit_load(dev, h, torch.arange(8), "direct")
    with pytest.raises(IndexError, match=r"layer_id 9 is out of range \[0, 4\)"):
        host.submit_load(dev, h, torch.arange(16), "direct", layer_ids=[0, 9])
    with pytest.raises(ValueError, match="io_backend 'kernel' was not resolved"):
        host.submit_load(dev, h, torch.arange(16), "kernel")
    with pytest.raises(TypeError, match="host_indices must be a torch tensor"):
        host.submit_load(dev, [0, 1], torch.arange(2), "direct")
    other, _ = _pools()
    with pytest.raises(ValueError, match=r"is not the device pool the host pool \d+ \(mha, layout \w+\) was made for"):
        host.submit_load(other, h, torch.arange(16), "direct")
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(before, dev.k_buffer))


def test_a_failed_layer_raises_in_every_later_wait_and_the_next_load_runs():
    loader = LayerLoader("cpu", timeout_s=5)
    done = []

    def step(layer):
        if layer == 2:
            raise RuntimeError("planted copy failure")
        done.append(layer)

    load = loader.submit(5, step, what="planted")
    load.wait(0)
    load.wait(1)
    for layer in (2, 4):
        with pytest.raises(LayerLoadError, match=r"^planted: layer 2 failed to load \(RuntimeError: planted copy "
                                                 rf"failure\); layer {layer} and every later layer"):  # fmt: skip
            load.wait(layer)
    with pytest.raises(LayerLoadError, match="planted copy failure"):
        load.finish_event.synchronize()
    with pytest.raises(LayerLoadError):
        load.result()
    assert done == [0, 1] and isinstance(load.error, RuntimeError)
    after = loader.submit(3, done.append)
    after.result()
    assert done == [0, 1, 0, 1, 2]
    loader.close()


def test_a_slow_submitter_times_out_with_what_it_is_doing_then_finishes():
    loader = LayerLoader("cpu", timeout_s=0.2)
    release = threading.Event()

    def step(layer):
        if layer == 1:
            release.wait(10)

    load = loader.submit(3, step, what="slow")
    load.wait(0)
    with pytest.raises(LayerLoadTimeout, match=r"^slow: layer 2 was not submitted within 0.2 s \(1 of 3 layers "
                                               r"submitted; the loader's thread has been submitting layer 1 of "
                                               r"'slow' for 0\.\d+ s\); raise the bound with "
                                               r"HICACHE_LOAD_TIMEOUT_S"):  # fmt: skip
        load.wait(2)
    with pytest.raises(LayerLoadTimeout, match=r"^slow: the whole load was not submitted within 0.05 s .*; "
                                               r"the caller's timeout$"):  # fmt: skip
        load.result(timeout=0.05)
    with pytest.raises(ValueError, match="timeout must be > 0 seconds, got 0"):
        load.result(timeout=0)
    release.set()
    load.wait(2)
    load.result()
    loader.close()


def test_bad_layer_and_bad_settings_are_refused(monkeypatch):
    loader = LayerLoader("cpu", timeout_s=1)
    load = loader.submit(2, lambda layer: None)
    with pytest.raises(IndexError, match=r"layer 2 is out of range \[0, 2\)"):
        load.wait(2)
    with pytest.raises(ValueError, match="layers must be an int >= 0"):
        loader.submit(-1, lambda layer: None)
    with pytest.raises(RuntimeError, match="recorded by the layer loader's thread"):
        load.finish_event.record()
    loader.close()
    with pytest.raises(RuntimeError, match=r"this layer loader \(cpu\) is closed"):
        loader.submit(1, lambda layer: None)
    for bad in ("0", "-1", "soon", "inf"):
        monkeypatch.setenv(ENV_TIMEOUT, bad)
        with pytest.raises(ValueError, match=rf"^HICACHE_LOAD_TIMEOUT_S='{bad}' is not a number of seconds > 0$"):
            timeout_from_env()
    monkeypatch.setenv(ENV_TIMEOUT, "2.5")
    assert timeout_from_env() == 2.5
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        LayerLoader("cpu", timeout_s=0)


def test_the_process_has_one_loader_per_device():
    assert layer_loader("cpu") is layer_loader(torch.device("cpu"))


def test_randomized_rounds_consumers_before_during_and_after_submission():
    """200 rounds (the GPU gate runs 1,000 on CUDA): consumers on other threads wait for random layers at
    random moments; some rounds fail at a random layer, some submit slowly. Every wait returns the right
    bytes or raises the planted error for its layer; nothing hangs (each wait is bounded)."""
    dev, host = _pools()
    rng = random.Random(7)
    h = host.alloc(32)
    src = torch.arange(32)
    host.backup_from_device_all_layer(dev, h, src, "direct")
    written = _written(dev, src)
    loader = LayerLoader("cpu", timeout_s=10)
    problems: list[str] = []
    for round_ in range(200):
        fail_at = rng.randrange(LAYERS) if rng.random() < 0.15 else None
        slow = rng.random() < 0.2
        dst = torch.arange(64, 96) if round_ % 2 else torch.arange(128, 160)
        for layer in range(LAYERS):
            dev.k_buffer[layer][dst] = 0
            dev.v_buffer[layer][dst] = 0

        def step(layer, fail_at=fail_at, slow=slow, dst=dst):
            if slow:
                time.sleep(0.0005)
            if layer == fail_at:
                raise RuntimeError(f"planted at {layer}")
            host.load_to_device_per_layer(dev, h, dst, layer, "direct")

        def consume(layer, delay, load_box, dst=dst, fail_at=fail_at, round_=round_):
            time.sleep(delay)
            while not load_box:
                time.sleep(0)
            try:
                load_box[0].wait(layer)
            except LayerLoadError as exc:
                if fail_at is None or layer < fail_at or f"planted at {fail_at}" not in str(exc.__cause__):
                    problems.append(f"round {round_} layer {layer}: unexpected {exc}")
                return
            if fail_at is not None and layer >= fail_at:
                problems.append(f"round {round_} layer {layer}: no error after the planted one at {fail_at}")
            elif not _equal(dev, dst, written, layer):
                problems.append(f"round {round_} layer {layer}: wrong bytes after the wait")

        box: list = []
        consumers = [threading.Thread(target=consume, args=(rng.randrange(LAYERS), rng.choice([0, 0.0002, 0.001]), box))
                     for _ in range(3)]  # fmt: skip
        early = rng.random() < 0.5
        if early:
            for c in consumers:
                c.start()
        box.append(loader.submit(LAYERS, step, what=f"round {round_}"))
        if not early:
            for c in consumers:
                c.start()
        for c in consumers:
            c.join(15)
            assert not c.is_alive(), f"round {round_}: a consumer hung"
        try:
            box[0].result()
        except LayerLoadError:
            assert fail_at is not None
    loader.close()
    assert not problems, problems[:5]


def test_pending_event_answers_like_a_cuda_event_on_the_cpu():
    loader = LayerLoader("cpu", timeout_s=5)
    gate = threading.Event()
    load = loader.submit(1, lambda layer: gate.wait(5))
    assert isinstance(load.finish_event, PendingEvent) and load.finish_event.query() is False
    gate.set()
    load.finish_event.synchronize()
    load.finish_event.wait()
    assert load.finish_event.query() is True and load.start_event.elapsed_time(load.finish_event) == 0.0
    loader.close()


# ---- the GPU's side, modelled ------------------------------------------------------------------------------


class Gpu:
    """Streams mapped onto ``queues`` in-order hardware queues (stream ``s`` on queue ``s % queues``, as
    streams beyond CUDA_DEVICE_MAX_CONNECTIONS share them). An operation runs once everything before it in
    its queue ran and, for a wait, its condition holds: an event wait needs the event's last record, as of
    when the wait was enqueued, to have run (CUDA's semantics; no record yet: nothing to wait for); a
    value wait (stream memory operations) needs a word written later by anyone."""

    def __init__(self, queues: int) -> None:
        self.queues = [[] for _ in range(queues)]
        self.recorded: dict[str, int] = {}  # event -> id of its latest record op
        self.ran: set[int] = set()
        self.words: dict[str, int] = {}
        self.next_id = 0

    def enqueue(self, stream: int, op: tuple) -> None:
        self.next_id += 1
        if op[0] == "record":
            self.recorded[op[1]] = self.next_id
        if op[0] == "wait_event":
            op = ("wait_record", self.recorded.get(op[1]))
        self.queues[stream % len(self.queues)].append((self.next_id, op))

    def drain(self) -> bool:
        """Run until nothing can run; True when every queue is empty (False: a deadlock)."""
        progress = True
        while progress:
            progress = False
            for q in self.queues:
                while q:
                    op_id, op = q[0]
                    if op[0] == "wait_record" and op[1] is not None and op[1] not in self.ran:
                        break
                    if op[0] == "wait_value" and self.words.get(op[1], 0) < op[2]:
                        break
                    if op[0] == "write_value":
                        self.words[op[1]] = op[2]
                    q.pop(0)
                    self.ran.add(op_id)
                    progress = True
        return not any(self.queues)


def _loader_schedule(gpu: Gpu, layers: int, consumers: int, rng: random.Random) -> None:
    """The loader's protocol: a consumer enqueues its wait for layer l only once the loader's thread
    recorded l's event (the host wait); the loader's stream waits only on the caller's start event."""
    caller, loader, streams = 0, 1, list(range(2, 2 + consumers))
    gpu.enqueue(caller, ("record", "start"))
    gpu.enqueue(loader, ("wait_event", "start"))
    wanted = {s: sorted(rng.sample(range(layers), k=min(layers, 3))) for s in streams}
    submitted = 0
    while submitted < layers or any(wanted.values()):
        if submitted < layers and rng.random() < 0.5:
            gpu.enqueue(loader, ("copy", submitted))
            gpu.enqueue(loader, ("record", f"layer{submitted}"))
            submitted += 1
            continue
        s = rng.choice(streams)
        if wanted[s] and wanted[s][0] < submitted:  # the host wait has returned for this layer
            layer = wanted[s].pop(0)
            gpu.enqueue(s, ("wait_event", f"layer{layer}"))
            gpu.enqueue(s, ("compute", layer))
        elif submitted >= layers and wanted[s]:
            continue


def _retired_schedule(gpu: Gpu, layers: int, consumers: int, rng: random.Random) -> None:
    """The retired worker: the caller's stream waits on a value the worker's stream writes after its
    copies, and consumers wait on the caller's stream; all of it enqueued before the worker's copies."""
    caller, worker, streams = 0, 1, list(range(2, 2 + consumers))
    gpu.enqueue(caller, ("write_value", "start", 1))
    gpu.enqueue(caller, ("wait_value", "done", 1))
    gpu.enqueue(caller, ("record", "after_load"))
    for s in streams:
        gpu.enqueue(s, ("wait_event", "after_load"))
        gpu.enqueue(s, ("compute", 0))
    gpu.enqueue(worker, ("wait_value", "start", 1))
    for layer in range(layers):
        gpu.enqueue(worker, ("copy", layer))
    gpu.enqueue(worker, ("write_value", "done", 1))


@pytest.mark.parametrize("queues", [1, 2, 8, 32])
def test_model_the_loaders_protocol_never_deadlocks(queues):
    rng = random.Random(queues)
    for _ in range(300):
        gpu = Gpu(queues)
        _loader_schedule(gpu, layers=8, consumers=32, rng=rng)
        assert gpu.drain(), "deadlock in the loader's protocol"


@pytest.mark.parametrize("queues", [1, 2, 8, 32])
def test_model_the_retired_protocol_deadlocks_where_queues_are_shared(queues):
    """The model is not vacuous: the retired worker's order deadlocks once a consumer shares the
    worker's queue (the H200 showed it at 2, 8 and 32 connections with 32 consumer streams)."""
    gpu = Gpu(queues)
    _retired_schedule(gpu, layers=8, consumers=32, rng=random.Random(0))
    assert gpu.drain() is False


# ---- after an error or a timeout: waiting out the copies a load enqueued --------------------------------------


def test_a_failed_loads_error_comes_at_once_and_wait_settled_waits_out_what_it_enqueued():
    """Layer 2 fails while work the load enqueued is still running (its finish step, as a verifying pool's
    checks are; on CUDA, the earlier layers' copies): the layer wait raises at once, the settle waits do not
    raise, and they return only after that work wrote its last byte."""
    loader = LayerLoader("cpu", timeout_s=5)
    rows = torch.zeros(8, dtype=torch.int64)
    gate, finished = threading.Event(), []

    def step(layer):
        if layer == 2:
            raise RuntimeError("planted copy failure")
        rows[layer] = layer + 1

    def finish():  # work of the load that runs after the failing layer
        assert gate.wait(10)
        time.sleep(0.05)
        rows[7] = 99
        finished.append(time.monotonic())

    load = loader.submit(4, step, what="planted", finish=finish)
    with pytest.raises(LayerLoadError, match=r"^planted: layer 2 failed to load \(RuntimeError: planted copy failure"):
        load.wait(3)
    assert not load.settled() and not load.settled_event.query() and not finished
    assert load.finish_event.query() is False  # not yet: it raises the error only once the load settled
    assert load.wait_settled(timeout=0.05) is False
    threading.Timer(0.05, gate.set).start()
    assert load.wait_settled() is True
    assert finished and rows.tolist() == [1, 2, 0, 0, 0, 0, 0, 99]  # nothing wrote after the wait returned
    assert load.settled() and load.settled_event.query() and "settled" in repr(load.settled_event)
    load.settled_event.synchronize()  # never raises the load's error
    load.settled_event.wait()
    with pytest.raises(LayerLoadError, match="planted copy failure"):
        load.finish_event.query()
    loader.close()


def test_synchronize_and_the_finish_event_raise_a_failure_only_once_the_load_settled():
    loader = LayerLoader("cpu", timeout_s=5)
    gate, finished, raised = threading.Event(), [], []

    def step(layer):
        raise RuntimeError("planted at layer 0")

    def finish():
        assert gate.wait(10)
        finished.append(time.monotonic())

    def consume(wait):
        try:
            wait()
        except LayerLoadError as exc:
            raised.append((time.monotonic(), str(exc)))

    for wait_on in ("load", "finish_event"):
        gate.clear()
        finished.clear()
        raised.clear()
        load = loader.submit(3, step, what="planted", finish=finish)
        wait = load.synchronize if wait_on == "load" else load.finish_event.synchronize
        consumer = threading.Thread(target=consume, args=(wait,))
        consumer.start()
        consumer.join(0.2)
        assert consumer.is_alive() and not raised, f"{wait_on}: raised before the load settled"
        gate.set()
        consumer.join(10)
        assert len(raised) == 1 and raised[0][0] >= finished[0], wait_on
        assert "layer 0 failed to load (RuntimeError: planted at layer 0)" in raised[0][1]
    loader.close()


def test_a_timed_out_load_is_cancelled_and_settles_before_its_rows_are_reused():
    """A consumer that gives up on a slow load (its wait timed out) cancels it: the layer being submitted
    completes, no later layer is submitted, and wait_settled returns once the thread is through with it."""
    loader = LayerLoader("cpu", timeout_s=0.2)
    release, stepped = threading.Event(), []

    def step(layer):
        stepped.append(layer)
        if layer == 1:
            assert release.wait(10)

    load = loader.submit(4, step, what="slow")
    load.wait(0)
    with pytest.raises(LayerLoadTimeout, match="^slow: layer 3 was not submitted within 0.2 s"):
        load.wait(3)
    load.cancel("the request was aborted")
    assert load.wait_settled(timeout=0.05) is False  # layer 1 is still being submitted
    with pytest.raises(LayerLoadTimeout, match=r"the loader's thread was not through with it within 0.2 s .*keep "
                                               r"its rows out of use"):  # fmt: skip
        load.settled_event.wait()
    release.set()
    assert load.wait_settled() is True and stepped == [0, 1]
    load.wait(1)  # the layer being submitted when it was cancelled completed
    with pytest.raises(LayerLoadError, match=r"layer 2 failed to load \(LayerLoadCancelled: the request was "
                                             r"aborted before layer 2 was submitted\)") as caught:  # fmt: skip
        load.wait(3)
    assert isinstance(caught.value.__cause__, LayerLoadCancelled)
    after = loader.submit(2, stepped.append)
    after.result()
    assert stepped == [0, 1, 0, 1]
    load.cancel()  # no effect on a load that is through
    loader.close()


def test_a_successful_load_settles_with_its_last_layer():
    dev, host = _pools()
    h = host.alloc(16)
    host.backup_from_device_all_layer(dev, h, torch.arange(16), "direct")
    written = _written(dev, torch.arange(16))
    dst = torch.arange(32, 48)
    load = host.submit_load(dev, h, dst, "direct")
    load.settled_event.synchronize()
    assert load.settled() and load.wait_settled() and load.finish_event.query()
    assert all(_equal(dev, dst, written, layer) for layer in range(LAYERS))
    with pytest.raises(ValueError, match="timeout must be > 0 seconds, got -1"):
        load.wait_settled(timeout=-1)
    with pytest.raises(RuntimeError, match="recorded by the layer loader's thread"):
        load.settled_event.record()


# ---- os.fork(): the child gets a loader of its own --------------------------------------------------------------


def _in_forked_child(run, timeout_s: float = 30.0) -> dict:
    """``run()`` in a child made by os.fork() (multiprocessing's fork start method); its dict of answers, or the
    traceback it raised. Bounded: a child still running after ``timeout_s`` is killed and reported."""
    import multiprocessing
    import traceback

    ctx = multiprocessing.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)

    def child() -> None:
        try:
            writer.send(run())
        except BaseException:  # noqa: BLE001 - the parent reports it
            writer.send({"raised": traceback.format_exc()})

    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    writer.close()
    try:
        if not reader.poll(timeout_s):
            pytest.fail(f"the forked child gave no answer within {timeout_s:g} s (a loader wait hung?)")
        answer = reader.recv()
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
    assert "raised" not in answer, answer["raised"]
    return answer


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")  # Python 3.12+ warns of fork beside threads
def test_a_forked_child_gets_a_working_loader_and_a_clear_error_for_the_parents():
    dev, _host = _pools()
    written = _written(dev, torch.arange(16))
    parents = layer_loader("cpu")
    parents.submit(1, lambda layer: None).result()  # the parent's loader thread is running
    gate = threading.Event()
    held = parents.submit(2, lambda layer: gate.wait(10), what="held in the parent")  # in flight at the fork
    cuda_in_parent = torch.cuda.is_initialized()

    def run() -> dict:
        import os

        from hicache_core.loads.layer_loads import ForkedLoaderError

        answers: dict = {"pid": os.getpid()}
        mine = layer_loader("cpu")
        answers["new loader"] = mine is not parents and mine._thread.is_alive()
        t0 = time.monotonic()
        if cuda_in_parent:
            # The parent pinned its pool, so CUDA is initialised there: a forked child may make no CUDA call
            # (the driver's rule), and building a host pool asks CUDA whether its memory is pinned. The child's
            # own loader runs a job of its own instead.
            done: list[int] = []
            job = mine.submit(LAYERS, done.append, what="the child's own job")
            job.result()
            answers["loaded in"] = time.monotonic() - t0
            answers["bytes"] = done == list(range(LAYERS))
            answers["settled"] = job.wait_settled()
        else:
            # The parent's host pool is not in a forked child (MADV_DONTFORK): the child builds its own.
            host = make_host_pool(dev, layout="page_first_direct", io_backend="direct")
            h = host.alloc(16)
            host.backup_from_device_all_layer(dev, h, torch.arange(16), "direct")
            dst = torch.arange(64, 80)
            load = host.submit_load(dev, h, dst, "direct")  # through layer_loader(): the child's own loader
            for layer in range(LAYERS):
                load.wait(layer)
            answers["loaded in"] = time.monotonic() - t0
            answers["bytes"] = all(_equal(dev, dst, written, layer) for layer in range(LAYERS))
            answers["settled"] = load.wait_settled()
        for name, call in (("submit", lambda: parents.submit(1, lambda layer: None)), ("wait", lambda: held.wait(1))):
            t0 = time.monotonic()
            try:
                call()
                answers[name] = "no error"
            except ForkedLoaderError as exc:
                answers[name] = str(exc)
            answers[name + " in"] = time.monotonic() - t0
        answers["held settles"] = held.wait_settled(timeout=1) and held.settled_event.query()
        return answers

    try:
        got = _in_forked_child(run)
    finally:
        gate.set()
    assert got["new loader"] and got["bytes"] and got["settled"], got
    assert got["loaded in"] < 10 and got["submit in"] < 1 and got["wait in"] < 1, got
    assert got["submit"].startswith("this layer loader (cpu) was made in process ")
    assert f"which forked this one ({got['pid']}); its thread and copies stay in that process. Take this " \
           "process's loader with layer_loader(device) and submit again" in got["submit"]  # fmt: skip
    assert got["wait"].startswith("'held in the parent' was submitted in process "), got["wait"]
    assert got["held settles"], "a load of the parent's has no copy running in the child"
    held.result()  # the parent's loader is untouched by the child
    assert layer_loader("cpu") is parents


# ---- on CUDA: a failed load's copies run on after the error, and the settle waits wait them out -------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the loader's stream")


@needs_cuda
def test_on_cuda_a_failed_loads_earlier_copies_run_on_and_the_settle_waits_wait_them_out():
    loader = LayerLoader("cuda", timeout_s=30)
    src = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    dst = [torch.zeros_like(src) for _ in range(3)]

    def step(layer):  # on the loader's stream; layer 1's copy queued behind about half a second of GPU time
        if layer == 2:
            raise RuntimeError("planted copy failure")
        if layer == 1:
            torch.cuda._sleep(1_000_000_000)
        dst[layer].copy_(src, non_blocking=True)

    for wait_on in ("host", "stream"):
        for t in dst:
            t.zero_()
        torch.cuda.synchronize()
        load = loader.submit(3, step, what="planted")
        with pytest.raises(LayerLoadError, match=r"^planted: layer 2 failed to load \(RuntimeError: planted copy"):
            load.wait(2)
        assert not load.settled() and not load.settled_event.query()  # layer 1's copy has not run yet
        assert load.finish_event.query() is False
        if wait_on == "host":
            assert load.wait_settled() is True
            got = [t.clone() for t in dst]
        else:
            consumer = torch.cuda.Stream()
            load.settled_event.wait(consumer)  # enqueued after the event was recorded: no wait on unsubmitted work
            with torch.cuda.stream(consumer):
                got = [t.clone() for t in dst]
            consumer.synchronize()
        assert torch.equal(got[0], src) and torch.equal(got[1], src) and not got[2].any(), wait_on
        assert load.settled() and load.settled_event.query()
        with pytest.raises(LayerLoadError, match="planted copy failure"):
            load.finish_event.synchronize()
    loader.close()


@needs_cuda
@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
def test_on_cuda_a_forked_child_gets_torchs_error_at_once_not_a_timeout():
    layer_loader("cuda").submit(1, lambda layer: None).result()  # CUDA is initialised in the parent

    def run() -> dict:
        t0 = time.monotonic()
        try:
            layer_loader("cuda")
            return {"error": None, "in": time.monotonic() - t0}
        except RuntimeError as exc:
            return {"error": str(exc), "in": time.monotonic() - t0}

    got = _in_forked_child(run)
    assert got["error"] and "forked subprocess" in got["error"] and got["in"] < 5, got
