"""Leases on redis://: Redis evicts by its own LFU, and the lease keeper's touches keep protected pages ahead."""

from __future__ import annotations

import pytest

from hicache_core.retention import Retain
from hicache_core.storage import make_storage
from hicache_core.testing import storage_faults as F
from hicache_core.testing.servers import start_redis
from hicache_core.testing.storage_kit import make_pool, slots_of


@pytest.mark.parametrize("leased", [False, True])
def test_redis_lfu_keeps_a_leased_prefix_it_would_evict(tmp_path, monkeypatch, leased):
    monkeypatch.setenv("HICACHE_LEASE_TOUCH_S", "0.05")
    server = start_redis(tmp_path, "--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lfu")
    try:
        host = make_pool(F.BIG, pages=40, seed=21)
        store = make_storage(f"redis://127.0.0.1:{server.port}/0", host, model_id=f"lease-{leased}")
        session = [f"{0xA000 + i:064x}" for i in range(8)]
        assert all(r.ok for r in store.write_pages(session, slots_of(list(range(1, 9)), 64)))
        if leased:
            grant = store.retain(session, Retain(90, "10m", "agent"))
            assert grant.eviction == "touched" and grant.protected == 8
            store._keeper.touch_now()
            store._keeper.touch_now()
        flood = [f"{0xB0000 + i:064x}" for i in range(600)]  # about 7 MiB of pages into 3 MiB
        for start in range(0, len(flood), 24):
            store.write_pages(flood[start : start + 24], slots_of(list(range(10, 34)), 64))
            if leased:
                store._keeper.touch_now()
        assert store.get_stats().backend["evicted_keys"] > 300
        present = store.backend.exists_objects(store.namespace.keys(session))
        if leased:
            assert present == [True] * 8
            assert all(r.ok for r in store.read_pages(session, slots_of(list(range(1, 9)), 64)))
            assert store.leases.stats()["dropped_under_lease"] == 0
        else:
            assert present.count(True) < 8, present  # LFU took some of the same pages without a lease
        store.close()
    finally:
        server.stop()
