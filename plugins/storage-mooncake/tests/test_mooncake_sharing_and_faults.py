"""Mooncake Store, shared and faulted: two servers share pages; kill, restart, full, slow (a real mooncake_master)."""

from __future__ import annotations

import time

import pytest
from mooncake_server import start_holder, start_master

from hicache_core.storage import make_storage
from hicache_core.testing import storage_faults as F
from hicache_core.testing.storage_kit import make_pool, slots_of


def test_two_servers_with_two_ranks_share_pages(mooncake_master, tmp_path):
    holder = start_holder(tmp_path, mooncake_master)
    try:
        # The servers lend no memory (segment=0): pages live in the holder and outlive server A.
        url = f"mooncake://127.0.0.1:{mooncake_master.port}?segment=0&local_buffer=16MiB"
        a, b = F.two_servers_share(url, tmp_path)
        F.assert_shared(a, b)
    finally:
        holder.stop()


@pytest.fixture
def own_master(tmp_path):
    server = start_master(tmp_path)
    yield server
    if server.proc is not None and server.proc.poll() is None:
        server.resume()
    server.stop()


def _url(server, segment="64MiB"):
    return f"mooncake://127.0.0.1:{server.port}?segment={segment}&local_buffer=16MiB"


def test_master_killed_mid_backup(own_master):
    F.kill_mid_backup(_url(own_master), own_master.pause, own_master.kill)


def test_master_killed_mid_prefetch(own_master):
    F.kill_mid_prefetch(_url(own_master), own_master.pause, own_master.kill)


def test_master_restart_reconnects(own_master):
    host, backend, toks, keys, src = F.stored_pages(_url(own_master), salt=21)
    own_master.restart()  # the master's metadata is gone; the client reconnects
    deadline = time.monotonic() + 20
    while True:
        try:
            assert backend.batch_exists(keys) == 0
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    while True:  # the client remounts its segment on the new master in the background
        results = backend.write_pages(keys[:2], src[: 2 * 64])
        if all(r.ok for r in results):
            break
        assert all(r.detail for r in results if not r.ok), "a failed write says why"
        assert time.monotonic() < deadline, results
        time.sleep(0.5)
    assert backend.batch_get_into(keys[:2], slots_of([30, 31], 64)) == [True, True]


def test_store_full_refuses_or_evicts_and_counts(own_master):
    host = make_pool(F.BIG, pages=34)
    backend = make_storage(_url(own_master, segment="16MiB"), host, model_id=f"full-{time.monotonic_ns()}")
    refused, missing = F.write_until_full(backend, host, rounds=80)
    assert refused > 0 or missing > 0, "a 16 MiB store took 30 MiB without refusing or evicting"
    stats = backend.get_stats()
    assert stats.write_refused_full == refused and stats.backend["refused_full"] == refused


def test_slow_store_timeout_policy(own_master):
    # Pausing the master or a holder process does not slow reads here (same-host transfers are memcpy),
    # so the slowness is a 0.3 s delay per read call at the backend's primitive.
    F.slow_store_timeout(_url(own_master))
