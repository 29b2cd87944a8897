"""hicache's L3 tier as SGLang's ``dynamic`` storage backend (``hicache_sglang.storage.HicacheStorage``).

The host pool is the one SGLang's own ``build_kv_host_pool`` makes with the adapter installed; the
calls are the ones SGLang's controller makes (``register_mem_pool_host``, ``batch_exists``,
``batch_set_v1`` / ``batch_get_v1`` on host slots, the flat ``set`` / ``get``). Pages land byte-exact.
"""

from __future__ import annotations

import uuid

import pytest
import torch
from sglang_setup import PP_START, device_pool, publish_settings

PAGE = 4


def _host(kind: str, layout: str, io_backend: str):
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler

    publish_settings(layout=layout, io_backend=io_backend, page_size=PAGE)
    dev = device_pool(kind, PAGE, start_layer=PP_START)
    host = hybrid_pool_assembler.build_kv_host_pool(kv_pool=dev, page_size=PAGE, use_mla=kind == "mla")
    raw = host.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(7)))
    return host


def _storage(host, url: str):
    from hicache_sglang.storage import HicacheStorage
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                  model_name="m", extra_config={"url": url, "interface_v1": 1})  # fmt: skip
    storage = HicacheStorage(config)
    storage.register_mem_pool_host(host)
    return storage


def _page(host, slot: int) -> torch.Tensor:
    return host.get_data_page(slot, flat=True).contiguous().view(torch.uint8).clone()


@pytest.mark.parametrize("kind, layout, io_backend", [("mha", "page_first", "kernel"),
                                                      ("mla", "page_first_direct", "direct")])  # fmt: skip
def test_pages_go_out_and_come_back_through_sglangs_calls(kind, layout, io_backend):
    from hicache_core.storage import PageStore

    host = _host(kind, layout, io_backend)
    storage = _storage(host, f"memory://sglang-{uuid.uuid4().hex[:8]}")
    assert isinstance(storage.store, PageStore) and storage.store.host_pool is host.core
    keys = [f"{i:064x}" for i in range(1, 4)]
    out = torch.arange(1 * PAGE, 3 * PAGE)  # pages 1 and 2
    assert storage.batch_set_v1(keys[:2], out) == [True, True]
    assert storage.batch_exists(keys) == 2
    back = torch.arange(5 * PAGE, 7 * PAGE)
    assert storage.batch_get_v1(keys[:2], back) == [True, True]
    for src, dst in ((1, 5), (2, 6)):
        assert torch.equal(_page(host, src * PAGE), _page(host, dst * PAGE))
    assert storage.set(keys[2], host.get_data_page(3 * PAGE, flat=True))
    got = storage.get(keys[2])
    assert got is not None and torch.equal(got.contiguous().view(torch.uint8), _page(host, 3 * PAGE))
    assert storage.get("f" * 64) is None
    storage.close()
    assert storage.store is None
