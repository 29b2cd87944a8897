"""Two SGLang servers share their host tiers: hicache's ``peer://`` tier through SGLang's ``dynamic`` backend.

``peer-a`` and ``peer-b`` are two instances of the same model, each with the peer tier (NIXL agents,
UCX over TCP on 127.0.0.1, the directory in a redis-server of this module's). ``peer-a`` computes a
prompt; its host tier publishes the prompt's pages (nothing is copied). ``peer-b`` then gets the same
prompt and reads those pages from ``peer-a``'s host pool instead of computing them: its outputs equal
``peer-a``'s and the server's without HiCache token for token, and its own accounting and hicache's
metrics show the pages read from the peer.

The two servers run only for this module (the fleet's live all session): before the plugin set the
UCX progress thread's poll timeout (hicache_storage_peer.agent._PROGRESS_POLL_US), an idle server
with the peer tier kept one core busy.
"""

from __future__ import annotations

import os
import time

import pytest
import workload
from conftest import Case, need, selected
from server import RedisServer, Server, start_all, stop_all

#: Both instances: write_through, so a page is published as soon as it reaches the host pool.
PEER = Case("pfd-direct-p16-wt-peer", "page_first_direct", "direct", 16, "write_through", storage="hicache-peer")
NAMES = ("peer-a", "peer-b")
PREFIX = "e2e-peer:"


@pytest.fixture(scope="module")
def peers(fleet):
    """The directory's redis-server and the two servers, started together, stopped after this module."""
    if selected(list(NAMES)) != list(NAMES):
        pytest.skip(f"HICACHE_E2E_ONLY leaves out server(s) {', '.join(NAMES)}")
    need(fleet, f"base-p{PEER.page_size}")  # the outputs without HiCache
    redis = RedisServer(os.path.join(fleet.root, "peer-redis")).start()
    url = f"peer://127.0.0.1:{redis.port}/0?prefix={PREFIX}&insecure=1"  # a trusted test setup: no key, no password
    # UCX over TCP on loopback, as between two machines without RDMA (the plugin's tests do the same);
    # hicache's metrics reach /metrics every second instead of every 5.
    env = {"UCX_TLS": "tcp,self", "HICACHE_METRICS_INTERVAL": "1"}
    servers = [Server(name, fleet.model, PEER.args(url), fleet.log_dir, env=env) for name in NAMES]
    try:
        start_all(servers, len(servers))
        yield redis, servers
    finally:
        stop_all(servers)
        redis.stop()


def _holders(redis_server) -> dict[bytes, set[bytes]]:
    """The directory: each published page key with the owners holding it."""
    import redis

    r = redis.Redis(host="127.0.0.1", port=redis_server.port, db=0)
    try:
        return {key: set(r.hkeys(key)) for key in r.scan_iter(match=f"{PREFIX}page:*", count=1000)}
    finally:
        r.close()


def _published(redis_server, at_least: int, timeout: float = 60.0) -> dict[bytes, set[bytes]]:
    """The directory once it lists ``at_least`` pages (the owner publishes from SGLang's backup thread)."""
    deadline = time.monotonic() + timeout
    while True:
        holders = _holders(redis_server)
        if len(holders) >= at_least or time.monotonic() > deadline:
            return holders
        time.sleep(0.5)


def _counter(server, name: str, at_least: float, timeout: float = 30.0, **labels: str) -> float:
    """A metric of hicache's once it reached ``at_least`` (each scheduler mirrors them every few seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        value = server.counter(name, **labels)
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def test_second_instance_serves_the_prompt_from_the_first_ones_host_tier(fleet, peers):
    directory, (a, b) = peers
    a.check_up()
    b.check_up()
    prompt = fleet.prompts.first
    pages = len(prompt) // PEER.page_size
    assert not _holders(directory), "the directory lists pages before either instance computed any"

    first = a.generate(prompt, workload.NEW_TOKENS)
    assert first["meta_info"]["cached_tokens"] == 0, first["meta_info"]
    assert first["output_ids"] == fleet.baseline(PEER.page_size).first, "peer-a's own computation differs"
    holders = _published(directory, pages)
    assert len(holders) >= pages, f"peer-a published {len(holders)} pages, expected at least {pages}"
    owners = set().union(*holders.values())
    assert len(owners) == 1, f"pages published by {owners}: only peer-a has computed anything"

    second = b.generate(prompt, workload.NEW_TOKENS)
    details = second["meta_info"].get("cached_tokens_details") or {}
    # SGLang's accounting: the prompt's whole pages came from storage (the peer tier), none from its own tiers.
    assert details.get("storage", 0) >= pages * PEER.page_size, details
    assert details.get("device", 0) == 0 and details.get("host", 0) == 0, details
    assert second["meta_info"]["cached_tokens"] >= pages * PEER.page_size, second["meta_info"]
    assert second["output_ids"] == first["output_ids"], "pages read from peer-a's host tier gave other tokens"

    # hicache's metrics: peer-b read the pages through its (only) L3 tier, peer-a published them, and
    # SGLang counted them as storage hits; peer-b published nothing of its own for that prompt.
    assert _counter(b, "sglang:hicache_l3_pages_total", pages, op="read", outcome="ok") >= pages
    assert b.counter("sglang:hicache_l3_pages_total", op="read", outcome="corrupt") == 0
    assert _counter(a, "sglang:hicache_l3_pages_total", pages, op="write", outcome="ok") >= pages
    assert b.counter("sglang:cached_tokens_total", cache_source="storage") >= pages * PEER.page_size
    assert set().union(*_holders(directory).values()) == owners, "peer-b published pages it read from peer-a"
    assert "Creating dynamic storage backend 'hicache' (hicache_sglang.storage.HicacheStorage)" in b.log()
