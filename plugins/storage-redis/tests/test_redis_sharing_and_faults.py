"""Redis, shared and faulted: two servers share pages; kill, restart, full and slow stores (real redis-server)."""

from __future__ import annotations

import time

import pytest

from hicache_core.storage import make_storage
from hicache_core.storage.backend import PageStatus
from hicache_core.testing import storage_faults as F
from hicache_core.testing.servers import start_redis
from hicache_core.testing.storage_kit import flipped_payload, slots_of


def test_two_servers_with_two_ranks_share_pages(redis_url, tmp_path):
    a, b = F.two_servers_share(redis_url, tmp_path)
    F.assert_shared(a, b)


@pytest.fixture
def own_redis(tmp_path):
    server = start_redis(tmp_path)
    yield server
    server.resume() if server.proc and server.proc.poll() is None else None
    server.stop()


def _url(server, **q):
    extra = "".join(f"&{k}={v}" for k, v in q.items())
    return f"redis://127.0.0.1:{server.port}/0?timeout=5{extra}"


def test_server_killed_mid_backup(own_redis):
    F.kill_mid_backup(_url(own_redis), own_redis.pause, own_redis.kill)


def test_server_killed_mid_prefetch(own_redis):
    F.kill_mid_prefetch(_url(own_redis), own_redis.pause, own_redis.kill)


def test_server_restart_reconnects(own_redis):
    host, backend, toks, keys, src = F.stored_pages(_url(own_redis), salt=11)
    own_redis.restart()  # same port; Redis without persistence comes back empty
    assert backend.batch_exists(keys) == 0
    assert all(r.ok for r in backend.write_pages(keys[:2], src[: 2 * 64]))
    assert backend.batch_get_into(keys[:2], slots_of([30, 31], 64)) == [True, True]


def test_store_full_refuses_and_counts(tmp_path):
    server = start_redis(tmp_path, "--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
    try:
        host, backend = _bound(server)
        refused, _ = F.write_until_full(backend, host)
        assert refused > 0
        stats = backend.get_stats()
        assert stats.write_refused_full == refused and stats.backend["refused_full"] == refused
        (last,) = backend.write_pages(["f" * 64], slots_of([1], 64))
        assert last.status is PageStatus.FULL and "maxmemory" in last.detail
    finally:
        server.stop()


def test_store_full_evicts_and_counts(tmp_path):
    server = start_redis(tmp_path, "--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru")
    try:
        host, backend = _bound(server)
        refused, missing = F.write_until_full(backend, host, rounds=20)
        assert refused == 0 and missing > 0
        assert backend.get_stats().backend["evicted_keys"] > 0
    finally:
        server.stop()


def _bound(server):
    from hicache_core.testing.storage_kit import make_pool

    host = make_pool(F.BIG, pages=34)
    return host, make_storage(_url(server), host, model_id=f"full-{time.monotonic_ns()}")


def test_slow_store_timeout_policy(own_redis):
    import redis

    admin = redis.Redis(port=own_redis.port)

    def slow_down(stop, slowed):
        admin.execute_command("CLIENT", "PAUSE", 1500, "ALL")  # every client waits 1.5 s: past the 1 s limit
        slowed.set()

    F.slow_store_timeout(_url(own_redis), slow_down)


def test_corrupted_value_counted_through_the_controller(redis_url):
    from hicache_core.storage import StorageController

    host, backend, toks, keys, src = F.stored_pages(redis_url, salt=13)
    k = backend.backend._k(backend.namespace.key(keys[3]))
    backend.backend.client.setrange(k, 500, b"\x00\x01\x02")
    with StorageController(backend, prefetch_policy="wait_complete") as ctl:
        res = ctl.prefetch(toks).result(30)
    flipped, counter = flipped_payload(backend)
    assert res.completed == 3 and res.results[3].status is flipped
    assert getattr(backend.get_stats(), counter) == 1
