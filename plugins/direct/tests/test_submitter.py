"""The worker-thread submission's ordering arithmetic (CPU), and its order on a GPU (HICACHE_TEST_DEVICE=cuda).

The stream-memory-operation gate compares 32-bit words cyclically, as ``cuStreamWaitValue32``
with ``CU_STREAM_WAIT_VALUE_GEQ`` does: ``(int32_t)(*addr - value) >= 0``. The sequence
numbers a caller stream hands out must therefore keep growing through the wrap at 2**32
and never return to 0, the value the words start at.
"""

from __future__ import annotations

import os

import pytest
import torch
from hicache_direct.submitter import MASK, next_sequence, reached

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
    assert impl.copier.thread
    impl.copier.thread_max = 0  # 256 copies per layer: the worker, whatever the default span
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
