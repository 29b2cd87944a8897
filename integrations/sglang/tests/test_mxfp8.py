"""MXFP8 KV inside SGLang: the FP8 K/V rows and their UE8M0 scale blocks move together through hicache.

SGLang's own ``MHATokenToKVPoolMXFP8`` on ``DEVICE`` (page size 128: scales interleaved per page,
``(pages, heads, 32, 4, sf_dim)`` per layer), SGLang's ``build_kv_host_pool`` (the adapter's) and
SGLang's ``HiCacheController``. Host bytes are read through SGLang's ``MHATokenToKVPoolMXFP8Host``
shapes: payload ``kv_buffer`` ``(2, slots, layers, heads, dim)`` (page_first), scales
``k_scale_host`` / ``v_scale_host`` ``(pages, layers, sf_page_bytes)``. The oracle for the scale
bytes is the device tensor itself, page by page.
"""

from __future__ import annotations

import threading

import pytest
import torch
from sglang_setup import DEVICE, allocator_for, fill_random, publish_settings, synchronize

PAGE, LAYERS, HEADS, DIM = 128, 3, 2, 64


def mxfp8_pool(page_size: int = PAGE, start_layer: int = 0):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolMXFP8

    return MHATokenToKVPoolMXFP8(size=4 * page_size, page_size=page_size, dtype=torch.bfloat16, head_num=HEADS,
                                 head_dim=DIM, layer_num=LAYERS, device=DEVICE, enable_memory_saver=False,
                                 start_layer=start_layer, end_layer=start_layer + LAYERS)  # fmt: skip


def build(layout: str = "page_first", io_backend: str = "kernel", start_layer: int = 0):
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler

    publish_settings(layout=layout, io_backend=io_backend, page_size=PAGE)
    dev = mxfp8_pool(start_layer=start_layer)
    allocator = allocator_for(dev)
    host = hybrid_pool_assembler.build_kv_host_pool(kv_pool=dev, page_size=PAGE, use_mla=False)
    controller = HiCacheController(token_to_kv_pool_allocator=allocator, mem_pool_host=host, page_size=PAGE,
                                   tp_group=None, load_cache_event=threading.Event(),
                                   io_backend=io_backend)  # fmt: skip
    return dev, allocator, host, controller


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)  # FP8 and E8M0 bytes: compare bytes, not values


def everything(dev) -> list[torch.Tensor]:
    return [*dev.k_buffer, *dev.v_buffer, *dev.k_scale_buffer, *dev.v_scale_buffer]


def fill(dev, seed: int) -> None:
    fill_random([t.view(torch.uint8) for t in everything(dev)], seed=seed)


@pytest.mark.parametrize("start_layer", [0, 20], ids=["rank0", "pp-start20"])  # SGLang passes stage-local layer ids
def test_mxfp8_backup_and_load_with_scales(start_layer):
    from hicache_sglang.scales import SGLangScaledMHAHostPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    dev, allocator, host, controller = build(start_layer=start_layer)
    assert (host.start_layer, host.layer_num) == (start_layer, LAYERS)
    assert type(host) is SGLangScaledMHAHostPool and isinstance(host, MHATokenToKVPoolHost)
    sf_dim = DIM // 32
    assert host.k_sf_page_bytes == host.v_sf_page_bytes == HEADS * PAGE * sf_dim
    assert tuple(host.k_scale_host.shape) == (host.page_num, LAYERS, HEADS * PAGE * sf_dim)
    # MHATokenToKVPoolMXFP8Host.get_size_per_token: payload plus each layer's scale bytes per token
    assert host.size_per_token == 2 * LAYERS * HEADS * DIM + 2 * LAYERS * HEADS * sf_dim

    fill(dev, seed=61)
    device_slots = allocator.alloc(2 * PAGE)
    dpages = (device_slots.reshape(-1, PAGE)[:, 0] // PAGE).to(dev.k_buffer[0].device)
    rows = [as_bytes(t[device_slots.to(t.device)].cpu()) for t in [*dev.k_buffer, *dev.v_buffer]]
    blocks = [as_bytes(t[dpages].cpu()).reshape(len(dpages), -1) for t in [*dev.k_scale_buffer, *dev.v_scale_buffer]]

    host_slots = controller.write(device_slots, node_id=1)
    ack = controller.ack_write_queue.pop()
    ack.finish_event.synchronize()
    synchronize()
    assert ack.num_bytes == len(device_slots) * host.size_per_token
    hpages = host_slots.reshape(-1, PAGE)[:, 0].cpu() // PAGE
    for layer in range(LAYERS):
        for part in range(2):  # page_first kv_buffer: (2, slots, layers, heads, dim)
            got = as_bytes(host.kv_buffer[part, host_slots.cpu(), layer])
            assert torch.equal(got, rows[part * LAYERS + layer]), (part, layer)
        assert torch.equal(host.k_scale_host[hpages, layer], blocks[layer]), ("k scale", layer)
        assert torch.equal(host.v_scale_host[hpages, layer], blocks[LAYERS + layer]), ("v scale", layer)
        assert torch.equal(host.k_scale_host_layers[layer][hpages], blocks[layer])

    fill(dev, seed=62)
    load_slots = controller.load(host_slots, node_id=2)
    controller.start_loading()
    controller.ack_load_queue.pop().finish_event.synchronize()
    synchronize()
    lpages = (load_slots.reshape(-1, PAGE)[:, 0] // PAGE).to(dev.k_buffer[0].device)
    for t, want in zip([*dev.k_buffer, *dev.v_buffer], rows):
        assert torch.equal(as_bytes(t[load_slots.to(t.device)].cpu()), want)
    for t, want in zip([*dev.k_scale_buffer, *dev.v_scale_buffer], blocks):
        assert torch.equal(as_bytes(t[lpages].cpu()).reshape(len(lpages), -1), want)


def test_mxfp8_has_no_l3_pages_and_storage_refuses_it():
    from hicache_sglang import NotServedError
    from hicache_sglang.storage import HicacheStorage

    _, _, host, _ = build()
    for call in (lambda: host.get_data_page(0), host.get_dummy_flat_data_page,
                 lambda: host.get_page_buffer_meta(torch.arange(PAGE))):  # fmt: skip
        with pytest.raises(NotImplementedError, match="expose no flat storage"):
            call()
    storage = object.__new__(HicacheStorage)
    with pytest.raises(NotServedError, match="cannot store the 'kv' host pool: MXFP8"):
        storage.register_mem_pool_host(host)


@pytest.mark.parametrize("layout, io_backend", [("page_first_direct", "direct"), ("layer_first", "kernel")])
def test_mxfp8_other_layouts_are_refused_at_construction(layout, io_backend):
    import hicache_core as hc

    with pytest.raises(hc.UnsupportedCombinationError, match="pool kind 'kv_scale_pages' allows only the layouts "
                                                             "page_first") as caught:  # fmt: skip
        build(layout, io_backend)
    assert "hicache-sglang serves MXFP8 K/V with interleaved scales" in "\n".join(caught.value.__notes__)


def test_per_slot_scales_are_refused_with_what_works():
    """MXFP8 below page size 128 keeps per-slot scales (KVScaleLayout.TOKEN): SGLang refuses them, so does hicache."""
    from hicache_sglang import NotServedError
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler

    publish_settings(layout="page_first", io_backend="kernel", page_size=16)
    with pytest.raises(NotServedError, match="per-slot KV scales .'token'.*--page-size 128"):
        hybrid_pool_assembler.build_kv_host_pool(kv_pool=mxfp8_pool(16), page_size=16, use_mla=False)
