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
from server import start_all


def _stored(fleet, case) -> int:
    """Objects in the case's store: files (SGLang's file backend, hicache's file://), Redis keys, or S3 objects."""
    if case.storage == "hicache-redis":
        return fleet.redis.keys()
    if case.storage == "hicache-s3":
        return fleet.s3.count(case.name)
    return sum(len(files) for _, _, files in os.walk(fleet.storage_dir(case.name)))


def _settled(count, at_least: int, timeout: float = 90.0) -> int:
    """The number of stored objects once SGLang's backup thread stopped adding any (and at least ``at_least``)."""
    deadline = time.monotonic() + timeout
    last, stable_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = count()
        if n != last:
            last, stable_since = n, time.monotonic()
        elif n >= at_least and time.monotonic() - stable_since > 3:
            return n
        time.sleep(0.5)
    raise AssertionError(f"{last} objects stored after {timeout:.0f} s, expected at least {at_least}, settled")


@pytest.fixture(scope="module")
def restarted(fleet):
    """Every storage server, after its workload and its store settled, stopped and started again (in parallel)."""
    present = [c for c in STORAGE_CASES if c.name in fleet.servers]
    fresh: dict[str, object] = {}
    for case in present:
        try:
            fleet.outcome(case.name)
            first = fleet.server(case.name)
        except AssertionError as exc:  # that case's test reports it; the others still run
            fresh[case.name] = exc
            continue
        _settled(lambda case=case: _stored(fleet, case), workload.PREFIX_TOKENS // case.page_size)
        first.stop()
        first.error = "stopped by test_e2e_storage (restarted on the same store)"
        fresh[case.name] = fleet.servers[f"{case.name}-restart"] = fleet.new_server(f"{case.name}-restart", case)
    start_all([s for s in fresh.values() if not isinstance(s, AssertionError)], PARALLEL)
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
