"""file://, shared and faulted: two servers share pages; a writer killed mid-backup; restart; capacity; slow store."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

from hicache_core.storage import make_storage
from hicache_core.storage.backend import PageStatus
from hicache_core.testing import storage_faults as F
from hicache_core.testing.storage_kit import flipped_payload, make_pool, slots_of


def test_two_servers_with_two_ranks_share_pages_and_survive_restart(tmp_path):
    url = f"file://{tmp_path}/l3"
    a, b = F.two_servers_share(url, tmp_path)  # server A exits before server B starts: durable pages
    F.assert_shared(a, b)


def _writer(url: str, ready) -> None:
    host = make_pool(F.BIG, pages=66, seed=31)
    backend = make_storage(url, host, model_id="killed-writer")
    keys = [f"{i:064x}" for i in range(10_000)]
    ready.set()
    for start in range(0, len(keys), 64):  # until killed
        backend.write_pages(keys[start : start + 64], slots_of(list(range(1, 65)), 64))


def test_writer_killed_mid_backup_leaves_only_whole_pages(tmp_path):
    url = f"file://{tmp_path}/l3"
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_writer, args=(url, ready))
    proc.start()
    assert ready.wait(60)
    time.sleep(1.0)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    host = make_pool(F.BIG, pages=66, seed=32)
    backend = make_storage(url, host, model_id="killed-writer")
    keys = [f"{i:064x}" for i in range(10_000)]
    stored = backend.backend.exists_objects(backend.namespace.keys(keys))
    n = stored.count(True)
    assert n > 0, "the writer wrote nothing in a second"
    present = [k for k, s in zip(keys, stored) if s][:64]
    results = backend.read_pages(present, slots_of(list(range(1, len(present) + 1)), 64))
    assert all(r.ok for r in results), [r for r in results if not r.ok][:2]  # never a torn page
    assert not list((tmp_path / "l3").glob("*/*/.*.tmp")), "the dead writer's temporary files are cleaned up"


def test_capacity_evicts_least_recently_used_and_refuses_oversized(tmp_path):
    host = make_pool(F.BIG, pages=34)
    # One page's bytes on disk: 12288 of payload and the header block, and a verifying pool's checksum row.
    probe = make_storage(f"file://{tmp_path}/probe", host, model_id="cap")
    assert probe.write_pages(["f" * 64], slots_of([1], 64))[0].ok
    page = probe.get_stats().backend["used_bytes"]
    assert page == 12288 + 4096 + probe.pages.trailer_bytes, page
    backend = make_storage(f"file://{tmp_path}/l3?capacity={10 * page}", host, model_id="cap")
    keys = [f"{i:064x}" for i in range(12)]
    assert all(r.ok for r in backend.write_pages(keys[:10], slots_of(list(range(1, 11)), 64)))
    assert backend.read_pages(keys[:1], slots_of([20], 64))[0].ok  # page 0 becomes the most recent
    assert all(r.ok for r in backend.write_pages(keys[10:], slots_of([11, 12], 64)))
    stats = backend.get_stats().backend
    assert stats["evicted"] == 2 and stats["used_bytes"] <= 10 * page
    assert backend.backend.exists_objects(backend.namespace.keys(keys)) == [True, False, False] + [True] * 9
    small = make_storage(f"file://{tmp_path}/l4?capacity=1000", host, model_id="cap")
    (r,) = small.write_pages(keys[:1], slots_of([1], 64))
    assert r.status is PageStatus.FULL and small.get_stats().write_refused_full == 1


def test_slow_store_timeout_policy(tmp_path):
    F.slow_store_timeout(f"file://{tmp_path}/l3")


def test_corrupted_file_is_a_counted_miss_through_the_controller(tmp_path):
    from hicache_core.storage import StorageController

    host, backend, toks, keys, src = F.stored_pages(f"file://{tmp_path}/l3", salt=17)
    path = backend.backend.path_of(backend.namespace.key(keys[2]))
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with StorageController(backend, prefetch_policy="wait_complete") as ctl:
        res = ctl.prefetch(toks).result(30)
    flipped, counter = flipped_payload(backend)
    assert res.completed == 2 and res.results[2].status is flipped
    assert getattr(backend.get_stats(), counter) == 1
