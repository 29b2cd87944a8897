"""SGLang's HiCacheController drives a hicache host pool: write, ack, load, layer-done counting.

The pool is the one SGLang's own ``build_kv_host_pool`` returns once the adapter is
installed; the controller, its L2 transfer engine and its LayerDoneCounter are SGLang's.
Every check is on bytes: the host rows (read through SGLang's host shapes) and the
device rows after a round trip. ``start_layer=20`` is a pipeline-parallel rank: SGLang
passes layer ids local to its device pool there.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from sglang_setup import (
    KIND_PAIR_IDS,
    KIND_PAIRS,
    LAYERS,
    PP_START,
    allocator_for,
    device_layers,
    device_pool,
    device_rows,
    fill_random,
    host_rows,
    publish_settings,
    synchronize,
)

CASES, CASE_IDS = KIND_PAIRS, KIND_PAIR_IDS


def build(kind: str, layout: str, io_backend: str, page_size: int, start_layer: int):
    import hicache_sglang
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler

    publish_settings(layout=layout, io_backend=io_backend, page_size=page_size)
    dev = device_pool(kind, page_size, start_layer=start_layer)
    allocator = allocator_for(dev)
    host = hybrid_pool_assembler.build_kv_host_pool(kv_pool=dev, page_size=page_size, use_mla=kind == "mla")
    assert isinstance(host, hicache_sglang.SGLangHostPool), type(host)
    controller = HiCacheController(
        token_to_kv_pool_allocator=allocator,
        mem_pool_host=host,
        page_size=page_size,
        tp_group=None,
        load_cache_event=threading.Event(),
        io_backend=io_backend,
    )
    return dev, allocator, host, controller


@pytest.mark.parametrize("start_layer", [0, PP_START], ids=["rank0", "pp-start20"])
@pytest.mark.parametrize("page_size", [1, 16], ids=["page1", "page16"])
@pytest.mark.parametrize("kind, layout, io_backend", CASES, ids=CASE_IDS)
def test_write_then_load_back(kind, layout, io_backend, page_size, start_layer):
    dev, allocator, host, controller = build(kind, layout, io_backend, page_size, start_layer)
    assert host.layout == layout and host.io_backend == io_backend
    assert (host.start_layer, host.layer_num) == (start_layer, LAYERS)
    fill_random(device_layers(dev), seed=1)
    device_indices = allocator.alloc(4 * page_size)
    written = [device_rows(dev, kind, layer, device_indices) for layer in range(LAYERS)]

    host_indices = controller.write(device_indices, node_id=1)
    assert host_indices is not None and len(host_indices) == len(device_indices)
    ack = controller.ack_write_queue.pop()
    ack.finish_event.synchronize()
    assert ack.node_ids == [1] and ack.num_tokens == len(device_indices)
    assert ack.num_bytes == len(device_indices) * host.size_per_token
    for layer in range(LAYERS):  # host bytes, where SGLang's shapes say they are
        assert all(torch.equal(h, d) for h, d in zip(host_rows(host, kind, layer, host_indices), written[layer]))

    load_indices = controller.load(host_indices, node_id=2)
    assert load_indices is not None and not bool(torch.isin(load_indices, device_indices).any())
    fill_random(device_layers(dev), seed=2)  # the load, not leftovers, must put the bytes there
    producer = controller.start_loading()
    ack = controller.ack_load_queue.pop()
    ack.finish_event.synchronize()
    assert producer >= 0 and ack.node_ids == [2]
    for layer in range(LAYERS):
        assert all(torch.equal(a, b) for a, b in zip(device_rows(dev, kind, layer, load_indices), written[layer]))


@pytest.mark.parametrize("kind, layout, io_backend", [CASES[1], CASES[-2]], ids=[CASE_IDS[1], CASE_IDS[-2]])
def test_layer_done_counter(kind, layout, io_backend):
    """Each layer's event completes after that layer's bytes landed and before the next layer moves.

    SGLang's forward pass waits on these events per layer (``get_key_buffer`` ->
    ``LayerDoneCounter.wait_until``), so the order is what makes overlap safe.
    """
    page_size = 16
    dev, allocator, host, controller = build(kind, layout, io_backend, page_size, PP_START)
    fill_random(device_layers(dev), seed=3)
    device_indices = allocator.alloc(2 * page_size)
    written = [device_rows(dev, kind, layer, device_indices) for layer in range(LAYERS)]
    host_indices = controller.write(device_indices, node_id=1)
    controller.ack_write_queue.pop().finish_event.synchronize()
    load_indices = controller.load(host_indices, node_id=2)
    fill_random(device_layers(dev), seed=4)

    seen = []
    counter = controller.layer_done_counter
    events = counter.events[(counter.producer_index + 1) % counter.num_counters]
    complete = events.complete

    def observed_complete(layer_index: int) -> None:
        synchronize()  # on a GPU the copies are queued on the load stream; look at what landed
        loaded = [all(torch.equal(a, b) for a, b in zip(device_rows(dev, kind, layer, load_indices), written[layer]))
                  for layer in range(LAYERS)]  # fmt: skip
        seen.append((layer_index, loaded))
        complete(layer_index)

    events.complete = observed_complete
    producer = controller.start_loading()
    counter.set_consumer(producer)
    assert [layer for layer, _ in seen] == list(range(LAYERS))
    for layer, loaded in seen:
        assert loaded == [i <= layer for i in range(LAYERS)], f"at layer {layer}'s event: {loaded}"
    # The forward's side: SGLang's device pool waits on the counter by absolute layer id.
    for layer in range(LAYERS):
        buffer = dev.get_key_buffer(PP_START + layer)
        got = buffer[load_indices.to(buffer.device)].view(torch.uint8).cpu().reshape(len(load_indices), -1)
        assert torch.equal(got, written[layer][0])
    controller.ack_load_queue.pop().finish_event.synchronize()


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_local_layer_ids_address_the_stage_layers(kind, monkeypatch):
    """SGLang passes layer ids local to the device pool, and the pool's layer map is the one translation.

    On a rank whose device pool starts at model layer 20, local id 0 moves model layer 20; the absolute id
    20 is outside the device pool: nothing moves (as in SGLang's own pools), and HICACHE_VALIDATE reports it.
    """
    dev, allocator, host, controller = build(kind, "layer_first", "direct", 1, PP_START)
    fill_random(device_layers(dev), seed=5)
    slots = allocator.alloc(4)
    h = host.alloc(4)
    host.backup_from_device_all_layer(dev, h, slots, "direct")
    before = device_rows(dev, kind, 0, slots)
    fill_random(device_layers(dev), seed=6)
    host.load_to_device_per_layer(dev, h, slots, PP_START, "direct")  # an absolute id: not this stage's numbering
    assert not any(torch.equal(a, b) for a, b in zip(device_rows(dev, kind, 0, slots), before))
    monkeypatch.setattr(host.core, "validate", True)
    with pytest.raises(
        ValueError,
        match=rf"layer_id {PP_START} is outside the device pool's layers \[0, {LAYERS}\) "
        r"\(SGLang's layer ids, local to the device pool\): the call would be a no-op",
    ):
        host.load_to_device_per_layer(dev, h, slots, PP_START, "direct")
    host.load_to_device_per_layer(dev, h, slots, 0, "direct")  # local 0 is model layer 20
    assert all(torch.equal(a, b) for a, b in zip(device_rows(dev, kind, 0, slots), before))


def _loaded_into(kind: str, layout: str, io_backend: str, seed: int):
    """A controller with 2 pages written to the host tier and queued for loading into fresh slots."""
    page_size = 16
    dev, allocator, host, controller = build(kind, layout, io_backend, page_size, PP_START)
    fill_random(device_layers(dev), seed=seed)
    device_indices = allocator.alloc(2 * page_size)
    written = [device_rows(dev, kind, layer, device_indices) for layer in range(LAYERS)]
    host_indices = controller.write(device_indices, node_id=1)
    controller.ack_write_queue.pop().finish_event.synchronize()
    load_indices = controller.load(host_indices, node_id=2)
    fill_random(device_layers(dev), seed=seed + 1)
    return dev, host, controller, written, load_indices


def _plant(monkeypatch, host, wrap) -> None:
    """Run ``wrap(copy, h, d, layer)`` in place of the hicache pool's per-layer load implementation (host layers)."""
    impl = host.core.implementation_for("load_to_device_per_layer")
    copy = impl.load_to_device_per_layer
    monkeypatch.setattr(impl, "load_to_device_per_layer", lambda h, d, layer: wrap(copy, h, d, layer))


@pytest.mark.parametrize("kind, layout, io_backend", [CASES[1], CASES[-2]], ids=[CASE_IDS[1], CASE_IDS[-2]])
def test_layer_loads_are_submitted_off_the_scheduler_thread(kind, layout, io_backend, monkeypatch):
    """hicache's pools: SGLang's start_loading returns before the copies; the forward's per-layer wait
    (get_key_buffer -> LayerDoneCounter.wait_until) returns only once that layer's bytes are there."""
    from hicache_core.loads.layer_loads import PendingEvent

    dev, host, controller, written, load_indices = _loaded_into(kind, layout, io_backend, seed=11)
    threads, gate = [], threading.Event()

    def slow(copy, h, d, layer):
        threads.append(threading.current_thread().name)
        gate.wait(10)  # held until the scheduler thread has returned from start_loading
        copy(h, d, layer)

    _plant(monkeypatch, host, slow)
    producer = controller.start_loading()
    counter = controller.layer_done_counter
    counter.set_consumer(producer)
    ack = controller.ack_load_queue[-1]
    assert isinstance(ack.finish_event, PendingEvent) and not ack.finish_event.query()
    gate.set()
    for layer in range(LAYERS):
        buffer = dev.get_key_buffer(PP_START + layer)  # SGLang's forward side: waits for this layer
        got = buffer[load_indices.to(buffer.device)].view(torch.uint8).cpu().reshape(len(load_indices), -1)
        assert torch.equal(got, written[layer][0]), f"layer {layer}"
    controller.ack_load_queue.pop().finish_event.synchronize()
    assert counter.events[producer].finish_event.query()
    assert threads and all(name.startswith("hicache-layer-loader") for name in threads), threads
    for layer in range(LAYERS):
        assert all(torch.equal(a, b) for a, b in zip(device_rows(dev, kind, layer, load_indices), written[layer]))


def test_a_failed_layer_raises_in_the_forwards_wait(monkeypatch):
    """A layer whose copies fail: the layers before it are there, its wait and later ones raise, naming it."""
    from hicache_core.loads.layer_loads import LayerLoadError

    dev, host, controller, written, load_indices = _loaded_into("mha", "page_first_direct", "direct", seed=21)

    def failing(copy, h, d, layer):
        if layer == 1:
            raise RuntimeError("planted copy failure")
        copy(h, d, layer)

    _plant(monkeypatch, host, failing)
    producer = controller.start_loading()
    controller.layer_done_counter.set_consumer(producer)
    load = controller.layer_done_counter.events[producer]._hicache_load
    buffer = dev.get_key_buffer(PP_START)
    got = buffer[load_indices.to(buffer.device)].view(torch.uint8).cpu().reshape(len(load_indices), -1)
    assert torch.equal(got, written[0][0])
    for layer in (1, 2):
        with pytest.raises(LayerLoadError, match=r"layer 1 failed to load \(TransferError: .*: planted copy failure"):
            dev.get_key_buffer(PP_START + layer)
        assert load.settled()  # SGLang learns of the error once every copy of the load finished
    with pytest.raises(LayerLoadError, match="planted copy failure"):
        controller.ack_load_queue.pop().finish_event.synchronize()


def test_a_timed_out_layer_wait_cancels_the_load_and_raises_once_it_settled(monkeypatch):
    """The forward gives up on a layer (a timeout): the adapter cancels the rest of the load and raises only once
    the layer being copied is through, so SGLang never frees rows a copy still writes; no later layer is copied."""
    from hicache_core.loads.layer_loads import LayerLoadError, LayerLoadTimeout, layer_loader

    dev, host, controller, written, load_indices = _loaded_into("mha", "page_first_direct", "direct", seed=41)
    gate, copied = threading.Event(), []

    def held(copy, h, d, layer):
        if layer == 1:
            assert gate.wait(10)
        copy(h, d, layer)
        copied.append((layer, time.monotonic()))

    _plant(monkeypatch, host, held)
    monkeypatch.setattr(layer_loader(dev.device), "timeout_s", 0.5)
    producer = controller.start_loading()
    controller.layer_done_counter.set_consumer(producer)
    load = controller.layer_done_counter.events[producer]._hicache_load
    dev.get_key_buffer(PP_START)
    # Layer 1's copy goes through halfway into the settle wait: the wait for layer 2 times out at 0.5 s, and the
    # adapter then waits up to 0.5 s more for the load to settle. (With the gate at the settle wait's very end,
    # 0.4 s for a 0.2 s timeout, the copy missed it by milliseconds on a loaded machine: CI of 5270719.)
    threading.Timer(0.75, gate.set).start()
    with pytest.raises(LayerLoadTimeout, match="layer 2 was not submitted within 0.5 s"):
        dev.get_key_buffer(PP_START + 2)
    raised_at = time.monotonic()
    assert [layer for layer, _ in copied] == [0, 1] and raised_at >= copied[-1][1]
    assert load.settled()
    assert all(torch.equal(a, b) for a, b in zip(device_rows(dev, "mha", 1, load_indices), written[1]))
    with pytest.raises(LayerLoadError, match=r"layer 2 failed to load \(LayerLoadCancelled: abandoned by SGLang's "
                                             r"forward before layer 2 was submitted\)"):  # fmt: skip
        controller.ack_load_queue.pop().finish_event.synchronize()


def test_sglang_own_submission_on_request(monkeypatch):
    """HICACHE_SGLANG_LAYER_LOADS=sglang keeps SGLang's submission (its events, on the scheduler thread);
    any other value is refused, naming the variable and the allowed values."""
    from hicache_sglang import layer_loads

    layer_loads.uninstall()
    try:
        monkeypatch.setenv(layer_loads.ENV, "fast")
        with pytest.raises(ValueError, match=r"^HICACHE_SGLANG_LAYER_LOADS='fast' is not one of: 'hicache', "
                                             r"'sglang'$"):  # fmt: skip
            layer_loads.install()
        monkeypatch.setenv(layer_loads.ENV, "sglang")
        layer_loads.install()
        dev, host, controller, written, load_indices = _loaded_into("mla", "page_first", "kernel", seed=31)
        producer = controller.start_loading()
        ack = controller.ack_load_queue.pop()
        assert type(ack.finish_event).__name__ != "PendingEvent"
        ack.finish_event.synchronize()
        assert producer >= 0
        for layer in range(LAYERS):
            assert all(torch.equal(a, b) for a, b in zip(device_rows(dev, "mla", layer, load_indices),
                                                         written[layer]))  # fmt: skip
    finally:
        layer_loads.uninstall()
        monkeypatch.delenv(layer_loads.ENV)
        layer_loads.install()
