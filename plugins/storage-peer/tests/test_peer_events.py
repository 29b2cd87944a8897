"""The peer tier's KV events: its owner's own evictions removed at once, and a killed owner's pages dropped.

A peer tier's pages live in its owner's publication area, in the owner's memory: they are named by the
owner (``peer://<owner id>``), each page the area drops is removed the moment it goes (the owner's
``report_removed``), and when the owner's process dies nothing says so but silence: its publisher's
heartbeat stops, and a router drops that publisher's host and peer tiers (never its shared ones, which
other instances still load from). Real processes, a real Redis directory, real ZMQ sockets.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from peer_proc import CASE, EVENTS_HEARTBEAT, MODEL, fill, keys_for

pytest.importorskip("zmq", reason="KV events need pyzmq (pip install 'hicache-core[events]')")
pytest.importorskip("msgspec", reason="KV events need msgspec (pip install 'hicache-core[events]')")

from hicache_core.events import SGLANG, EventSubscriber, KVEventPublisher  # noqa: E402
from hicache_core.storage import make_storage  # noqa: E402
from hicache_core.storage.backend import PageStatus  # noqa: E402
from hicache_core.testing.storage_kit import make_pool  # noqa: E402

#: A router takes a publisher for gone after this many heartbeats of silence.
SILENT_HEARTBEATS = 3


def routable(sub: EventSubscriber, heartbeat: float) -> dict[tuple[str, str | None], set[Any]]:
    """What a router may route to from one publisher's events: everything while it is heard; once it was silent
    for ``SILENT_HEARTBEATS`` heartbeats, only its shared tiers (its host pool and peer area died with it)."""
    host_media = {SGLANG.media["host"]}
    dead = sub.silent_for() > SILENT_HEARTBEATS * heartbeat
    return {where: set(pages) for where, pages in sub.index.tiers.items()
            if pages and not (dead and (where[0] in host_media or str(where[1]).startswith("peer://")))}  # fmt: skip


def _area_of(pages: int) -> str:
    """``publish_bytes`` for exactly ``pages`` pages of CASE (a slot: payload and checksum row, on 64 bytes)."""
    from hicache_core.storage.pages import PageMap

    pm = PageMap(make_pool(CASE, pages=2, seed=0))
    return f"&publish_bytes={pages * -(-(pm.page_bytes + pm.trailer_bytes) // 64) * 64}"


def _settle(sub: EventSubscriber, where: tuple[str, str], want: set[Any], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while sub.index.pages(*where) != want:
        assert time.monotonic() < deadline, (len(sub.index.pages(*where)), len(want))
        sub.poll(0.02)


def test_pages_the_owners_area_drops_are_removed_at_once_and_never_announced(peer_url):
    """An area of 4 pages: each page written past it evicts the oldest, whose BlockRemoved goes out with no audit;
    a batch larger than the area returns its first pages failed (evicted before the write returned): no event
    names them held. The index is then exactly what a second instance loads."""
    publisher = KVEventPublisher("tcp://127.0.0.1:*", format="sglang", replay_endpoint="tcp://127.0.0.1:*")
    owner_host = make_pool(CASE, pages=16, seed=1)
    owner = make_storage(peer_url + _area_of(4), owner_host, model_id=MODEL)
    reader_host = make_pool(CASE, pages=16, seed=2)
    reader = make_storage(peer_url, reader_host, model_id=MODEL, serve=0)
    sub = EventSubscriber(publisher.endpoint, format="sglang", replay_endpoint=publisher.replay_endpoint)
    try:
        feed = owner.publish_events(publisher, audit_interval=None)
        assert feed.tier.kind == "peer" and feed.tier.store == f"peer://{owner.backend.owner_id}"
        where = (SGLANG.medium(feed.tier), feed.tier.store)
        assert where[0] == "EXTERNAL"
        sub.sync()
        bh = SGLANG.block_hash
        keys, later = keys_for(11, 6), keys_for(12, 6)
        src = owner_host.alloc(12 * CASE.page_size)
        fill(owner_host, src, keys + later)
        p = CASE.page_size
        for i in range(6):  # one page per write: the 5th and 6th evict the 1st and 2nd
            assert owner.write_pages(keys[i : i + 1], src[i * p : (i + 1) * p])[0].ok
        assert owner.backend.counters["evicted"] == 2 and feed.counts["removed_evicted"] == 2
        _settle(sub, where, {bh(k) for k in keys[2:]})

        # a batch of 6 into the area of 4: its first 2 are evicted by its last 2 before the write returns
        results = owner.write_pages(later, src[6 * p :])
        assert [r.ok for r in results] == [False, False, True, True, True, True], results
        assert "evicted from the publication area" in results[0].detail
        assert owner.backend.counters["evicted"] == 8
        _settle(sub, where, {bh(k) for k in later[2:]})

        # what a second instance loads is what the events say, page for page
        got = reader.read_pages(keys + later, reader_host.alloc(12 * p))
        loaded = {r.key for r in got if r.ok}
        assert loaded == set(later[2:]), [(r.key[:8], r.status) for r in got]
        assert {r.status for r in got if not r.ok} == {PageStatus.MISSING}

        # the owner closes: its area goes with it, and so do its pages
        owner.close()
        _settle(sub, where, set())
    finally:
        sub.close()
        reader.close()
        owner.close()
        publisher.close()


def test_a_killed_owner_goes_silent_and_the_router_drops_its_peer_tier_not_its_shared_one(peer_url, procs, tmp_path):
    proc = procs("events", peer_url, tmp_path / "owner", 8)
    ready = json.loads(proc.wait_for("ready.json").read_text())
    peer_where, file_where = ((m, s) for m, s in zip(ready["media"], ready["stores"]))
    assert peer_where[1].startswith("peer://") and file_where[1].startswith("file://")
    want = {SGLANG.block_hash(k) for k in ready["keys"]}
    sub = EventSubscriber(ready["endpoint"], format="sglang", replay_endpoint=ready["replay"])
    try:
        sub.sync()  # a router joining late: the snapshot holds both tiers' pages
        assert sub.index.pages(*peer_where) == want and sub.index.pages(*file_where) == want
        # alive: heartbeats keep coming while nothing is written
        until = time.monotonic() + (SILENT_HEARTBEATS + 1) * EVENTS_HEARTBEAT
        heard = 0
        while time.monotonic() < until:
            heard += sub.poll(EVENTS_HEARTBEAT)
            assert sub.silent_for() < SILENT_HEARTBEATS * EVENTS_HEARTBEAT
        assert heard >= 2 and routable(sub, EVENTS_HEARTBEAT) == {peer_where: want, file_where: want}

        proc.proc.kill()  # SIGKILL: no BlockRemoved, no goodbye; only silence
        proc.proc.wait(10)
        deadline = time.monotonic() + 10
        while sub.silent_for() <= SILENT_HEARTBEATS * EVENTS_HEARTBEAT:
            assert time.monotonic() < deadline
            assert sub.poll(EVENTS_HEARTBEAT) == 0  # nothing more comes from a dead process
        # the events alone still say the peer tier holds them (nobody could say otherwise) ...
        assert sub.index.pages(*peer_where) == want
        # ... the router's rule drops them; the file tier's pages stay routable: they are still on disk
        assert routable(sub, EVENTS_HEARTBEAT) == {file_where: want}
        disk = make_storage(f"file://{tmp_path / 'owner' / 'l3'}", make_pool(CASE, pages=16, seed=5), model_id=MODEL)
        try:
            results = disk.read_pages(ready["keys"], disk.host_pool.alloc(8 * CASE.page_size))
            assert all(r.ok for r in results), results
        finally:
            disk.close()
    finally:
        sub.close()
