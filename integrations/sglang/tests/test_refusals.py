"""What the adapter does not serve is refused when SGLang builds the pool, with a clear error; bad calls raise."""

from __future__ import annotations

import pytest
import torch
from sglang_setup import (
    DEVICE,
    LAYERS,
    PP_START,
    allocator_for,
    device_layers,
    fill_random,
    mha_pool,
    mla_pool,
    publish_settings,
)


def build(pool, *, mla: bool = False, **kw):
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler

    return hybrid_pool_assembler.build_kv_host_pool(kv_pool=pool, page_size=pool.page_size, use_mla=mla, **kw)


@pytest.mark.parametrize("kind, layout", [("mla", "page_first_kv_split"), ("mha", "page_head")])
def test_direct_with_a_layout_sglangs_controller_cannot_drive(kind, layout):
    from hicache_sglang import NotServedError

    publish_settings(layout=layout, io_backend="direct", page_size=4)
    pool = mla_pool(4) if kind == "mla" else mha_pool(4)
    with pytest.raises(NotServedError, match=rf"io backend 'direct' only with layouts layer_first and "
                                             rf"page_first_direct .*'kv' host pool \(.*layout '{layout}'"):  # fmt: skip
        build(pool, mla=kind == "mla")


def test_an_io_backend_no_plugin_serves():
    from hicache_core import UnsupportedCombinationError

    publish_settings(layout="page_first_direct", io_backend="kernel_ascend", page_size=4)
    with pytest.raises(UnsupportedCombinationError, match="kernel_ascend"):
        build(mha_pool(4))


def test_decode_context_parallelism():
    from hicache_sglang import NotServedError
    from sglang.srt.runtime_context import get_parallel

    publish_settings(layout="layer_first", io_backend="kernel", page_size=4)
    with get_parallel().override(dcp_enabled=True, attn_dcp_size=2):
        with pytest.raises(NotServedError, match=r"does not serve decode context parallelism \(--dcp-size > 1\)"):
            build(mla_pool(4), mla=True)


def test_page_interleaved_pool():
    from hicache_sglang import NotServedError
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveKVPoolMixin

    class Interleaved(PageInterleaveKVPoolMixin, MHATokenToKVPool):
        """An MHA pool of the page-interleaved family (its shard state is never reached)."""

    publish_settings(layout="page_first", io_backend="kernel", page_size=4)
    pool = Interleaved(size=32, page_size=4, dtype=torch.bfloat16, head_num=2, head_dim=16, layer_num=LAYERS,
                       device=DEVICE, enable_memory_saver=False)  # fmt: skip
    with pytest.raises(NotServedError, match="does not serve page-interleaved KV pools"):
        build(pool)


def test_layer_sharded_mha_pool():
    """SGLang makes LayerSplit pools for DSA MLA models only (test_dsa.py serves them); an MHA one is refused."""
    from hicache_sglang import NotServedError

    publish_settings(layout="layer_first", io_backend="kernel", page_size=4)
    pool = mha_pool(4)
    pool.layer_shard_enabled = True  # what SGLang's context-parallel LayerSplit pools set
    with pytest.raises(NotServedError, match="serves layer-sharded .* device pools for MLA rows only"):
        build(pool)


# Per-slot scales (KVScaleLayout.TOKEN: FP4, and MXFP8 below page size 128) stay refused; test_mxfp8.py serves
# MXFP8 at page size 128.
@pytest.mark.parametrize("name, match", [("MHATokenToKVPoolFP4", r"keeps per-slot KV scales \('token'"),
                                         ("MHATokenToKVPoolMXFP8", r"scales .*--page-size 128")])  # fmt: skip
def test_kv_with_separate_scales(name, match):
    from hicache_sglang import NotServedError
    from sglang.srt.mem_cache import memory_pool

    publish_settings(layout="page_first", io_backend="kernel", page_size=4)
    pool = getattr(memory_pool, name)(size=32, page_size=4, dtype=torch.bfloat16, head_num=2, head_dim=32,
                                      layer_num=LAYERS, device=DEVICE, enable_memory_saver=False)  # fmt: skip
    with pytest.raises(NotServedError, match=match):
        build(pool)


def test_mla_with_fp4_block_scales():
    from hicache_sglang import NotServedError
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPoolFP4

    publish_settings(layout="page_first", io_backend="kernel", page_size=4)
    pool = MLATokenToKVPoolFP4(size=32, page_size=4, dtype=torch.bfloat16, kv_lora_rank=64, qk_rope_head_dim=32,
                               layer_num=LAYERS, device=DEVICE, enable_memory_saver=False)  # fmt: skip
    with pytest.raises(NotServedError, match="keeps per-slot FP4 block scales .* refuses too .* serves MXFP8"):
        build(pool, mla=True)


def test_packed_fp8_rows_cannot_split():
    from hicache_sglang import NotServedError
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    pool = MLATokenToKVPool(size=32, page_size=4, dtype=torch.float8_e4m3fn, kv_lora_rank=512, qk_rope_head_dim=64,
                            layer_num=LAYERS, device=DEVICE, enable_memory_saver=False, use_dsa=True,
                            override_kv_cache_dim=656)  # fmt: skip
    publish_settings(layout="page_first_kv_split", io_backend="kernel", page_size=4)
    with pytest.raises(NotServedError, match="packs FP8 DSA rows of 656 bytes"):
        build(pool, mla=True)
    publish_settings(layout="page_first", io_backend="kernel", page_size=4)  # whole rows move as bytes
    host = build(pool, mla=True)
    assert (host.kv_buffer.dtype, host.kv_buffer.shape[-1], host.dsa_kv_cache_store_fp8) == (torch.uint8, 656, True)
    with pytest.raises(NotServedError, match="override_kv_cache_dim=576 differs from the device rows' width 656"):
        build(pool, mla=True, override_kv_cache_dim=576)


def test_page_size_other_than_the_device_pools():
    from hicache_sglang import NotServedError
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler

    publish_settings(layout="page_first", io_backend="kernel", page_size=4)
    with pytest.raises(NotServedError, match="page_size 8 differs from the device pool's 4"):
        hybrid_pool_assembler.build_kv_host_pool(kv_pool=mha_pool(4), page_size=8, use_mla=False)


class TestCalls:
    """Calls SGLang could make wrongly: a foreign device pool, a draft id out of range, a layer outside the pool."""

    @pytest.fixture
    def pools(self, monkeypatch, request):
        monkeypatch.setenv("HICACHE_VALIDATE", "1" if getattr(request, "param", False) else "0")
        publish_settings(layout="layer_first", io_backend="direct", page_size=1)
        dev = mha_pool(1, start_layer=PP_START)
        draft = mha_pool(1, layers=1, start_layer=PP_START + LAYERS)
        host = build(dev, mtp_draft_device_pools=(draft,))
        fill_random(device_layers(dev) + device_layers(draft), seed=51)
        slots = allocator_for(dev).alloc(4)
        return dev, draft, host, host.alloc(4), slots

    def test_foreign_device_pool(self, pools):
        dev, draft, host, h, d = pools
        with pytest.raises(ValueError, match="is not the device pool the 'kv' host pool"):
            host.load_to_device_per_layer(mha_pool(1, start_layer=PP_START), h, d, 0, "direct")
        with pytest.raises(ValueError, match="is not the device pool the 'kv' host pool"):
            host.backup_from_device_all_layer(draft, h, d, "direct")
        with pytest.raises(ValueError, match="is not draft pool 0 the 'kv' host pool"):
            host.load_to_device_per_layer(dev, h, d, LAYERS, "direct", is_draft=True)

    def test_draft_layer_out_of_range(self, pools):
        dev, draft, host, h, d = pools
        with pytest.raises(IndexError, match=r"draft layer_id 4 is out of range: the draft layers of the 'kv' host "
                                              r"pool .* are \[3, 4\)"):  # fmt: skip
            host.load_to_device_per_layer(draft, h, d, LAYERS + 1, "direct", is_draft=True)

    @pytest.mark.parametrize("pools", [False, True], indirect=True, ids=["quiet", "HICACHE_VALIDATE"])
    @pytest.mark.parametrize("layer_id", [-1, LAYERS])
    def test_layer_outside_the_device_pool(self, pools, layer_id, request):
        """SGLang's own pools return for such a layer; so does this one, unless HICACHE_VALIDATE asks for a report."""
        dev, draft, host, h, d = pools
        before = [t.view(torch.uint8).clone() for t in device_layers(dev)]
        if host.core.validate:
            with pytest.raises(ValueError, match=rf"layer_id {layer_id} is outside the device pool's layers \[0, 3\) "
                                                 r"\(SGLang's layer ids, local to the device pool\): the call would "
                                                 r"be a no-op"):  # fmt: skip
                host.load_to_device_per_layer(dev, h, d, layer_id, "direct")
        else:
            host.load_to_device_per_layer(dev, h, d, layer_id, "direct")
        assert all(torch.equal(a, b.view(torch.uint8)) for a, b in zip(before, device_layers(dev)))
