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


@pytest.mark.parametrize("name", ["", None])
def test_a_server_that_gives_no_model_name_is_refused_with_the_fix(name):
    from hicache_sglang import NotServedError
    from hicache_sglang.storage import HicacheStorage
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                  model_name=name, extra_config={"url": "memory://x", "interface_v1": 1})  # fmt: skip
    with pytest.raises(NotServedError, match="--served-model-name NAME") as err:
        HicacheStorage(config)
    assert f"SGLang passed {name!r}" in str(err.value)


def _old_misses() -> float:
    from hicache_core import metrics

    return metrics.L3_PREFETCH.values().get(("miss", "old_weight_version"), 0)


def test_a_weight_update_moves_every_key_and_old_pages_are_misses_by_reason():
    from sglang.srt.runtime_context import get_serving

    host = _host("mha", "page_first", "kernel")
    storage = _storage(host, f"memory://sglang-wv-{uuid.uuid4().hex[:8]}")
    assert storage.store.weight_version == get_serving().weight_version == "default"  # SGLang's --weight-version
    keys = [f"{i:064x}" for i in range(11, 14)]
    assert storage.batch_set_v1(keys, torch.arange(1 * PAGE, 4 * PAGE)) == [True] * 3
    host.clear()  # SGLang's flush after the update: the radix tree and the host pool are reset
    assert storage.set_weight_version("step-2", reason="update_weights_from_disk") is True
    before = _old_misses()
    assert storage.batch_exists(keys) == 0
    assert _old_misses() == before + 1
    assert storage.batch_get_v1(keys, torch.arange(5 * PAGE, 8 * PAGE)) == [False] * 3
    # the new weights' pages are stored and found under the new version
    assert storage.batch_set_v1(keys, torch.arange(1 * PAGE, 4 * PAGE)) == [True] * 3
    assert storage.batch_exists(keys) == 3
    storage.close()


def test_the_adapter_follows_every_weight_update_entry_point_of_sglang():
    from hicache_sglang import weight_updates
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager

    for entry in ("update_weights_from_disk", "update_weights_from_distributed", "update_weights_from_tensor",
                  "update_weights_from_ipc"):  # fmt: skip
        method = getattr(SchedulerWeightUpdaterManager, entry)
        assert method.__name__ == entry and getattr(method, "__wrapped__", None) is not None, entry
    # a named version SGLang recorded is the version; anything else is unique to this update
    assert weight_updates.next_version("rl-7", "default", "rl-7", "t0k") == "rl-7"
    assert weight_updates.next_version(None, "default", "default", "t0k") == "default~unnamed-t0k"
    assert weight_updates.next_version("rl-7", "rl-7", "rl-7", "t0k") == "rl-7~unnamed-t0k"  # the name in use
    assert weight_updates.next_version("rl-8", "rl-7", "rl-7", "t0k") == "rl-7~unnamed-t0k"  # SGLang did not take it
    # a bucket before the last (flush_cache=False): the weights are partly old, the name is not theirs yet
    assert weight_updates.next_version("rl-7", "default", "rl-7", "t0k", flushes=False) == "rl-7~unnamed-t0k"


def test_an_update_moves_the_live_stores_and_a_store_attached_after_it_starts_there(monkeypatch):
    from types import SimpleNamespace

    from hicache_sglang import weight_updates

    monkeypatch.setattr(weight_updates, "_current", None)  # this process has had no update yet
    url = f"memory://sglang-attach-{uuid.uuid4().hex[:8]}"
    host = _host("mha", "page_first", "kernel")
    live = _storage(host, url)
    keys = [f"{i:064x}" for i in range(21, 23)]
    assert live.batch_set_v1(keys, torch.arange(1 * PAGE, 3 * PAGE)) == [True, True]
    host.clear()
    # what the wrapped update_weights_from_tensor does once SGLang returned (one rank: no TP group to broadcast on)
    weight_updates._follow(SimpleNamespace(), "update_weights_from_tensor", SimpleNamespace(weight_version=None),
                           "default")  # fmt: skip
    version = live.store.weight_version
    assert version.startswith("default~unnamed-") and live.batch_exists(keys) == 0
    # SGLang still reports "default" (an unnamed update leaves it): a store attached now must not key on it
    later = _storage(_host("mha", "page_first", "kernel"), url)
    assert later.store.weight_version == version and later.batch_exists(keys) == 0
    live.close()
    later.close()
