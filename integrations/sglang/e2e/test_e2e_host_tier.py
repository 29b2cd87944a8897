"""Requests served from hicache's host tier by SGLang's real server, token for token as without HiCache."""

from __future__ import annotations

import os
import re

import pytest
import workload
from conftest import BY_NAME, CASE_IDS, CASES, need
from hicache_sglang.identity import PREFIX

OPS = ("backup_from_device_all_layer", "backup_from_device_per_layer", "load_to_device_per_layer")
#: The fleet's servers no later module needs live: the cases without L3 (test_e2e_storage restarts the others)
#: and the page-size-1 baseline, whose outcome the storage tests compare with (the peer and weight-update
#: modules use base-p16's server).
DONE_AFTER_THIS_MODULE = ["base-p1", *(c.name for c in CASES if not c.storage)]


@pytest.fixture(scope="module", autouse=True)
def _retire_servers_done_here(fleet):
    yield
    fleet.retire(DONE_AFTER_THIS_MODULE)


def _whole_pages(tokens: int, page_size: int) -> int:
    return tokens // page_size * page_size


@pytest.mark.parametrize("name", CASE_IDS)
def test_identity_line(fleet, name):
    """The adapter's one line per pool names hicache's classes, the resolved layout and io backend, and every op."""
    need(fleet, name)
    case = BY_NAME[name]
    log = fleet.server(name).log()
    lines = [line for line in log.splitlines() if PREFIX in line]
    assert len(lines) == 1, f"expected one identity line for the one KV host pool, got {lines}"
    line = lines[0]
    layout, io = case.expected
    assert "'kv' hicache_sglang.pool.SGLangMHAHostPool over hicache_core.pool.host_pool.HostPool, pool kind mha" in line
    assert f"layout {layout}, io backend {io}," in line, line
    assert f"page size {case.page_size};" in line, line
    impls = dict(re.findall(r"(\w+)=([\w.]+)", line.split("implementations:", 1)[1]))
    assert sorted(impls) == sorted(OPS), line
    if io == "direct":
        assert set(impls.values()) == {"direct.copy_engine"}, line
    else:
        assert all(v.startswith(("kernel.", "jit.")) for v in impls.values()), line


@pytest.mark.parametrize("name", CASE_IDS)
def test_host_tier_serves_equal_outputs(fleet, name):
    """Prefix evicted to the host tier comes back from it; outputs equal the server's without HiCache."""
    need(fleet, name, f"base-p{BY_NAME[name].page_size}")
    case = BY_NAME[name]
    base = fleet.baseline(case.page_size)
    got = fleet.outcome(name)
    # SGLang's own accounting: the prefix (whole pages of it) came from the host, none of it from the device.
    assert got.again_cached.get("host", 0) >= _whole_pages(workload.PREFIX_TOKENS, case.page_size), got.again_cached
    assert got.again_cached.get("device", 0) == 0, got.again_cached
    assert got.first == base.first
    assert got.again == base.again, "the prefix served from the host tier gave other tokens than without HiCache"
    assert got.batch == base.batch, "concurrent requests on a host-tier prefix gave other tokens than without HiCache"
    assert sum(c.get("host", 0) for c in got.batch_cached) >= _whole_pages(160, case.page_size), got.batch_cached
    # and the baseline really recomputed: nothing of it came from a host tier it does not have
    assert base.again_cached.get("host", 0) == 0, base.again_cached


@pytest.mark.parametrize("name", CASE_IDS)
def test_sglang_counters_show_host_hits(fleet, name):
    """/metrics (--enable-metrics): host hits, load-backs and backups counted by SGLang itself."""
    need(fleet, name)
    fleet.outcome(name)
    srv = fleet.server(name)
    page = BY_NAME[name].page_size
    assert srv.counter("sglang:cached_tokens_total", cache_source="host") >= _whole_pages(workload.PREFIX_TOKENS, page)
    assert srv.counter("sglang:load_back_tokens_total", pool="kv") >= _whole_pages(workload.PREFIX_TOKENS, page)
    assert srv.counter("sglang:hicache_backup_tokens_total", pool="kv") >= workload.PREFIX_TOKENS


@pytest.mark.parametrize("name", ["lf-direct-p1-wt", "lf-kernel-p16-wb"])
def test_negative_control_corrupted_load_changes_outputs(fleet, name):
    """Bytes flipped on the way back from the host tier change the outputs: the equality above is not vacuous."""
    need(fleet, name, f"base-p{BY_NAME[name].page_size}")
    base = fleet.baseline(BY_NAME[name].page_size)
    fleet.outcome(name)
    srv = fleet.server(name)
    flag = fleet.corrupt_flag(name)
    open(flag, "w").close()
    try:
        bad = workload.evict_and_resend(srv, fleet.prompts, seed=101)
    finally:
        os.remove(flag)
    assert (bad["meta_info"]["cached_tokens_details"] or {}).get("host", 0) > 0, bad["meta_info"]
    assert bad["output_ids"] != base.again, "corrupted host-tier bytes did not change the outputs"
    good = workload.evict_and_resend(srv, fleet.prompts, seed=202)
    assert (good["meta_info"]["cached_tokens_details"] or {}).get("host", 0) > 0, good["meta_info"]
    assert good["output_ids"] == base.again
