"""Shared pieces of the L3 sharing and fault tests: run by each storage plugin's tests."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from ..storage.backend import PageStatus
from ..storage.controller import PrefetchTimeout, StorageController
from ..storage.keys import page_hashes
from ..storage.make import make_storage
from .storage_kit import StorageCase, make_pool, page_bytes, pool_image, slots_of
from .storage_procs import run_ranks, server, start_ranks

BIG = StorageCase("mha", "page_first", "plain", 64)  # 12 KiB pages


def two_servers_share(url: str, workdir: Path, *, ranks: int = 2, n_pages: int = 12, options: dict | None = None,
                      model_id: str = "shared-model") -> tuple[list[dict], list[dict]]:  # fmt: skip
    """Server A (``ranks`` gloo processes) backs a prefix up and exits; server B (fresh pools) prefetches it.

    B's processes start beside A's, so that their start (imports, gloo) overlaps A's work, but open the
    store only once every process of A has exited.
    """
    a_done = workdir / "a-exited"
    b = start_ranks(server, ranks, workdir / "b", url=url, role="prefetch", model_id=model_id, seed=3,
                    n_pages=n_pages, options=options, start_after=str(a_done))  # fmt: skip
    try:
        a = run_ranks(server, ranks, workdir / "a", timeout=180, url=url, role="backup", model_id=model_id, seed=3,
                      n_pages=n_pages, options=options)  # fmt: skip
        a_done.touch()
        return a, b.join(180)
    finally:
        b.kill()


def assert_shared(a: list[dict], b: list[dict], n_pages: int = 12) -> None:
    for rank in a:
        assert rank["written"] + rank["stats"]["backup_pages_already_stored"] == n_pages, rank
        assert not rank["failed"], rank
    pids = {r["pid"] for r in a}
    for rank in b:
        assert rank["pid"] not in pids
        assert rank["local"] == rank["agreed"] == rank["completed"] == n_pages, rank
        assert rank["same"] == [True] * n_pages, "prefetched bytes differ from what server A computed"


def stored_pages(url: str, n_pages: int = 16, salt: int = 1, **options: Any):
    """A pool, a bound page store and ``n_pages`` stored pages (keys, source slots)."""
    host = make_pool(BIG, pages=2 * n_pages + 2, seed=salt)
    store = make_storage(url, host, model_id=f"faults-{salt}-{time.monotonic_ns()}", **options)
    toks = [(salt * 13 + i) % 30000 for i in range(n_pages * BIG.page_size)]
    keys = page_hashes(toks, BIG.page_size)
    src = host.alloc(n_pages * BIG.page_size)
    results = store.write_pages(keys, src)
    assert all(r.ok for r in results), results[:2]
    return host, store, toks, keys, src


def kill_mid_backup(url: str, pause, kill, **options: Any) -> None:
    """The server stops answering, then dies, while a backup is in flight: pages fail, nothing hangs."""
    host = make_pool(BIG, pages=34, seed=5)
    store = make_storage(url, host, model_id=f"kill-b-{time.monotonic_ns()}", **options)
    before = pool_image(host)
    with StorageController(store, op_timeout=30) as ctl:
        pause()
        future = ctl.backup(list(range(32 * 64)), host.alloc(32 * 64))
        time.sleep(0.5)
        kill()
        result = future.result(60)
    assert result.failed, "pages written to a dead server must report failure"
    assert all(r.status in (PageStatus.ERROR, PageStatus.SKIPPED, PageStatus.TIMEOUT) for r in result.failed)
    assert result.stored_prefix < 32
    for name, image in before.items():  # a backup only reads the pool
        assert (pool_image(host)[name] == image).all()


def kill_mid_prefetch(url: str, pause, kill, **options: Any) -> None:
    """The server dies while a prefetch is in flight: the pages fail, their slots are freed, the pool is intact."""
    host, store, toks, keys, src = stored_pages(url, salt=7, **options)
    before = pool_image(host)
    free = host.available_size()
    with StorageController(store, prefetch_policy="wait_complete", batch_pages=4, op_timeout=30) as ctl:
        pause()
        future = ctl.prefetch(toks)
        time.sleep(0.5)
        kill()
        res = future.result(60)
    assert res.completed == 0 or res.completed < len(keys), res
    assert host.available_size() == free - res.completed * BIG.page_size
    failed = [r for r in res.results if not r.ok]
    assert failed or res.error, "the failure is reported"
    after = pool_image(host)
    if not store.backend.capabilities.zero_copy:
        for name, image in before.items():
            assert (after[name] == image).all(), "a failed non-zero-copy read touched the pool"
    for i in range(len(keys)):  # the stored source pages are never touched
        assert (page_bytes(host, int(src[i * 64]) // 64) == _page_of(before, host, int(src[i * 64]) // 64)).all()


def _page_of(image, host, page):
    from .cases import as_bytes
    from .storage_kit import flat_from

    return as_bytes(flat_from(image, host, page))


def slow_store_timeout(url: str, slow_down=None, **options: Any) -> None:
    """A slow store: the ``timeout`` policy returns, within its limit (plus the batch in flight), what arrived.

    ``slow_down(stop_event, slowed_event)`` makes the real server slow (pauses it for longer than the
    1 s limit), sets ``slowed_event`` once it is, and keeps it slow until ``stop_event`` is set or its
    pause runs out. It is started when the prefetch's first batch has arrived, and that batch's read
    returns only once the server is slow: the first batch is the part that arrives, and no gap between
    two pauses on a busy machine can let the whole prefix through. Without one, each read call of the
    store is delayed by 0.3 s at the primitive (for stores a test cannot pause).
    """
    host, store, toks, keys, src = stored_pages(url, n_pages=16, salt=9, **options)
    name = "get_objects_into" if store.backend.capabilities.zero_copy else "get_objects"
    real = getattr(store.backend, name)
    stop, slowed = threading.Event(), threading.Event()
    slower: list[threading.Thread] = []

    if slow_down is None:

        def read(*args):
            time.sleep(0.3)
            return real(*args)

    else:

        def read(*args):
            out = real(*args)
            if not slower:  # the first batch is in: the server is slowed before it is handed over
                slower.append(threading.Thread(target=slow_down, args=(stop, slowed), daemon=True))
                slower[0].start()
                assert slowed.wait(10), "the store was not slowed within 10 s"
            return out

    setattr(store.backend, name, read)
    limit = PrefetchTimeout(base_s=1.0, per_ki_token_s=0.0, max_s=1.0)
    with StorageController(store, prefetch_policy="timeout", prefetch_timeout=limit, batch_pages=2,
                           op_timeout=30) as ctl:  # fmt: skip
        try:
            t0 = time.monotonic()
            res = ctl.prefetch(toks).result(30)
            waited = time.monotonic() - t0
        finally:
            stop.set()
            for thread in slower:
                thread.join(10)
    assert res.terminated, res
    assert 0 < res.completed < len(keys), f"expected part of the prefix, got {res.completed} of {len(keys)}"
    assert waited < 1.0 + 3.0, waited
    for i in range(res.completed):
        assert (page_bytes(host, int(src[i * 64]) // 64) == page_bytes(host, int(res.host_indices[i * 64]) // 64)).all()


def write_until_full(store, host, rounds: int = 40) -> tuple[int, int]:
    """Write fresh keys until the store refuses or evicts; returns (refused, missing among earlier keys)."""
    first: list[str] = []
    refused = 0
    slots = slots_of(list(range(1, 33)), 64)
    for r in range(rounds):
        keys = page_hashes([(r * 7919 + i) % 30000 for i in range(32 * 64)], 64, prior_hash=f"{r:064x}")
        results = store.write_pages(keys, slots)
        refused += sum(x.status is PageStatus.FULL for x in results)
        if not first:
            first = keys
        if refused:
            break
    present = store.backend.exists_objects(store.namespace.keys(first))
    return refused, present.count(False)
