"""Leases on the peer tier: the owner's publication area evicts in lease order, and a reader still finds the
leased pages byte for byte after the area turned over."""

from __future__ import annotations

import torch
from peer_proc import CASE, MODEL, fill, keys_for, page_content
from test_peer_tier import area_of, page_of, reader_store

from hicache_core.retention import Retain
from hicache_core.storage import make_storage
from hicache_core.testing.storage_kit import make_pool


def test_the_publication_area_keeps_a_leased_session_while_others_turn_over(peer_url):
    owner_host = make_pool(CASE, pages=40, seed=3)
    owner = make_storage(peer_url + area_of(8), owner_host, model_id=MODEL)
    host, store, slots = reader_store(peer_url)
    try:
        session, unleased, flood = keys_for(11, 4), keys_for(12, 4), keys_for(13, 12)
        src = owner_host.alloc(20 * CASE.page_size)
        fill(owner_host, src, session + unleased + flood)
        assert all(r.ok for r in owner.write_pages(session, src[: 4 * CASE.page_size]))
        assert all(r.ok for r in owner.write_pages(unleased, src[4 * CASE.page_size : 8 * CASE.page_size]))
        grant = owner.retain(session, Retain(80, "5m", "agent"))
        assert (grant.eviction, grant.protected, grant.capped) == ("ordered", 4, 0)  # 4 of 8 slots: the cap
        for start in range(0, 12, 4):  # 12 more pages through an area of 8: every ordinary page turns over
            chunk = src[(8 + start) * CASE.page_size : (12 + start) * CASE.page_size]
            assert all(r.ok for r in owner.write_pages(flood[start : start + 4], chunk))
        assert owner.backend.counters["evicted"] == 12
        assert store.batch_exists(unleased) == 0
        results = store.read_pages(session, slots[: 4 * CASE.page_size])
        assert all(r.ok for r in results), results
        for i, key in enumerate(session):
            assert torch.equal(page_of(host, slots, i), page_content(host, key))
        stats = owner.leases.stats()
        assert (stats["pages_protected"], stats["dropped_under_lease"]) == (4, 0)
    finally:
        store.close()
        owner.close()
