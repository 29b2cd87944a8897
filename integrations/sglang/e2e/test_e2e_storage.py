"""L3 through the real server, across a restart: SGLang's ``file`` storage backend on hicache host
pools, and hicache's own tier (``file://``, ``redis://``, ``s3://`` on a real SeaweedFS) plugged into
SGLang's ``dynamic`` backend (``hicache_sglang.storage``).

Each storage server of the fleet has served the workload, writing its host pages to the store.
It is stopped, a new server is started on the same store, and the prefix is sent again: it
must come from storage (SGLang's ``cached_tokens_details``) and give the same tokens as the
server without HiCache.
"""

from __future__ import annotations

import os
import time

import pytest
import workload
from conftest import BY_NAME, PARALLEL, STORAGE_CASES, need


def _stored(fleet, case) -> int:
    """Objects in the case's store: files (SGLang's file backend, hicache's file://), Redis keys, or S3 objects."""
    if case.storage == "hicache-redis":
        return fleet.redis.keys()
    if case.storage == "hicache-s3":
        return fleet.s3.count(case.name)
    return sum(len(files) for _, _, files in os.walk(fleet.storage_dir(case.name)))


def _one_page_header(fleet, case):
    """The header of one page the case's server stored (hicache's file:// and redis:// tiers)."""
    from hicache_core.storage.page_format import HEADER_SIZE, unpack_header

    if case.storage == "hicache-redis":
        import redis

        client = redis.Redis(host="127.0.0.1", port=fleet.redis.port)
        data = client.getrange(next(iter(client.scan_iter(count=100))), 0, HEADER_SIZE - 1)
    else:
        path = next(os.path.join(d, f) for d, _, files in os.walk(fleet.storage_dir(case.name)) for f in files)
        with open(path, "rb") as f:
            data = f.read(HEADER_SIZE)
    return unpack_header(data)


def _settle_all(counts: dict[str, tuple], timeout: float = 90.0):
    """Each store's object count once SGLang's backup thread stopped adding to it (and it holds at least its
    minimum), yielded as ``name`` as soon as that store settles: all stores are watched at once.

    ``counts`` maps a name to ``(count, at_least)``; a store not settled within ``timeout`` fails the fixture."""
    deadline = time.monotonic() + timeout
    last = {name: -1 for name in counts}
    since = {name: time.monotonic() for name in counts}
    while last:
        now = time.monotonic()
        for name in list(last):
            count, at_least = counts[name]
            n = count()
            if n != last[name]:
                last[name], since[name] = n, now
            elif n >= at_least and now - since[name] > 3:
                del last[name]
                yield name
        if not last:
            return
        if time.monotonic() > deadline:
            left = ", ".join(f"{n}: {last[n]} objects, expected at least {counts[n][1]}" for n in last)
            raise AssertionError(f"stores not settled after {timeout:.0f} s: {left}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def restarted(fleet):
    """Every storage server, after its workload and its store settled, stopped and started again.

    The stores settle side by side, and each server is restarted as soon as its own store settled (at most
    ``PARALLEL`` starting at once), so one store's wait overlaps another server's start."""
    present = [c for c in STORAGE_CASES if c.name in fleet.servers]
    fresh: dict[str, object] = {}
    waiting: dict[str, tuple] = {}
    for case in present:
        try:
            fleet.outcome(case.name)
            fleet.server(case.name)
        except AssertionError as exc:  # that case's test reports it; the others still run
            fresh[case.name] = exc
            continue
        waiting[case.name] = (lambda case=case: _stored(fleet, case), workload.PREFIX_TOKENS // case.page_size)
    starting: list = []
    for name in _settle_all(waiting):
        case = BY_NAME[name]
        first = fleet.servers[name]
        first.stop()
        first.error = "stopped by test_e2e_storage (restarted on the same store)"
        while len(starting) >= PARALLEL:
            starting.pop(0).wait_ready()
        fresh[name] = fleet.servers[f"{name}-restart"] = fleet.new_server(f"{name}-restart", case).start()
        starting.append(fresh[name])
    for srv in starting:
        srv.wait_ready()
    return fresh


@pytest.mark.parametrize("name", [c.name for c in STORAGE_CASES])
def test_restart_serves_prefix_from_storage(fleet, restarted, name):
    case = BY_NAME[name]
    need(fleet, name, f"base-p{case.page_size}")
    base = fleet.baseline(case.page_size)
    again = restarted[name]
    if isinstance(again, AssertionError):
        raise again
    again.check_up()
    pages = workload.PREFIX_TOKENS // case.page_size
    r = again.generate(fleet.prompts.again, workload.NEW_TOKENS)
    details = r["meta_info"].get("cached_tokens_details") or {}
    assert details.get("storage", 0) >= pages * case.page_size, details
    assert r["output_ids"] == base.again, "the prefix loaded from L3 gave other tokens than without HiCache"
    assert again.counter("sglang:cached_tokens_total", cache_source="storage") >= pages * case.page_size
    if case.storage.startswith("hicache-"):
        assert "Creating dynamic storage backend 'hicache' (hicache_sglang.storage.HicacheStorage)" in again.log()
    if case.as_gpu_server:  # the pages were written as a GPU server writes them: keyed, with their checksum rows
        header = _one_page_header(fleet, case)
        assert header.keyed and header.verify_words > 0, header
