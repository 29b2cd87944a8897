"""Retention: leases' terms, the eviction order they give a tier, the cap, decay and ends; file:// honouring them.

The expected orders are written from the rules of docs/retention.md (superseded first, ordinary pages least
recently used first, protected pages lightest first, the cap protecting the heaviest leases' heads), not from
the book's code.
"""

from __future__ import annotations

import pytest
import torch

from hicache_core.retention import LeaseBook, Retain, RetentionQueue, parse_ttl, retain_from_cache_control
from hicache_core.storage import make_storage
from hicache_core.testing import storage_faults as F
from hicache_core.testing.storage_kit import make_pool, page_bytes, slots_of, tokens


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tier(capacity: int, cap: float = 0.5, decay: float = 0.5) -> tuple[RetentionQueue, LeaseBook, Clock]:
    clock = Clock()
    book = LeaseBook("test", capacity=capacity, cap=cap, decay=decay, clock=clock)
    queue = RetentionQueue()
    queue.attach(book)
    return queue, book, clock


# ---- terms ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, seconds", [("300", 300.0), (45, 45.0), ("30s", 30.0), ("5m", 300.0),
                                           ("1h", 3600.0), ("250ms", 0.25), (" 2 m ", 120.0)])  # fmt: skip
def test_ttl_texts(text, seconds):
    assert parse_ttl(text) == seconds


@pytest.mark.parametrize("bad, message", [
    ("0", "finite number of seconds > 0"), (-1, "> 0"), (float("inf"), "finite"), (float("nan"), "finite"),
    ("5 minutes", "'30s', '5m', '1h'"), (True, "seconds or a text"), ([5], "got list"),
    ("25h", "over the longest allowed, 86400 s (HICACHE_LEASE_MAX_TTL_S)"),
])  # fmt: skip
def test_bad_ttls_are_refused_with_what_they_were(bad, message):
    with pytest.raises(ValueError) as err:
        parse_ttl(bad)
    assert message in str(err.value)


def test_retain_checks_every_field():
    with pytest.raises(ValueError, match=r"priority is 0..100, got 101"):
        Retain(101, 60)
    with pytest.raises(ValueError, match=r"integer 0..100, got 5.5"):
        Retain(5.5, 60)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty text"):
        Retain(5, 60, session="")
    assert Retain(0, "5m", "s").ttl_s == 300.0


def test_cache_control_as_dynamo_passes_it():
    r = retain_from_cache_control({"type": "ephemeral", "ttl": "1h"}, session="abc")
    assert (r.priority, r.ttl_s, r.session) == (50, 3600.0, "abc")
    assert retain_from_cache_control({"type": "ephemeral"}).ttl_s == 300.0  # Anthropic's default
    assert retain_from_cache_control(None) is None
    with pytest.raises(ValueError, match="type 'persistent' is not supported"):
        retain_from_cache_control({"type": "persistent"})
    with pytest.raises(ValueError, match=r"fields hicache does not know: \['pin'\]"):
        retain_from_cache_control({"type": "ephemeral", "pin": True})


# ---- the order of evictions -----------------------------------------------------------------------


def test_without_leases_the_tier_is_lru():
    queue, _, _ = tier(10)
    for k in "abcdef":
        queue.add(k, 1)
    queue.touch(["a"])
    assert queue.evict(3) == ["b", "c", "d"]
    assert queue.keys() == ["e", "f", "a"]


def test_superseded_first_then_lru_then_protected_lightest_first():
    queue, book, _ = tier(20, cap=1.0)
    for k in "abcdefghij":
        queue.add(k, 1)
    book.retain(["a", "b"], Retain(80, 60, "s1"))
    book.retain(["c", "d"], Retain(30, 60, "s2"))
    book.retain(["i", "j"], Retain(60, 60, "s3"))
    book.supersede("s3")
    # superseded i, j; then ordinary e, f, g, h (LRU); then s2 (30) before s1 (80)
    assert queue.evict(10) == ["i", "j", "e", "f", "g", "h", "c", "d", "a", "b"]
    assert book.stats()["dropped_under_lease"] == 6


def test_the_cap_protects_the_heaviest_leases_heads_only():
    queue, book, _ = tier(10, cap=0.4)  # 4 pages may be protected
    for k in range(10):
        queue.add(k, 1)
    g1 = book.retain([0, 1, 2], Retain(90, 60, "s1"))
    g2 = book.retain([3, 4, 5], Retain(50, 60, "s2"))
    assert (g1.protected, g1.capped) == (3, 0)
    assert (g2.protected, g2.capped) == (1, 2)  # its head, page 3, fits under the cap
    first, protected = book.rank()
    assert set(protected) == {0, 1, 2, 3} and not first
    # Ordinary pages by recency, the capped pages 4 and 5 among them, then 3 (lighter), then s1.
    assert queue.evict(7) == [4, 5, 6, 7, 8, 9, 3]
    assert "over the tier's retention cap (40% of the capacity)" in book.why_dropped(4)
    assert "every ordinary page was gone and its lease weighed least" in book.why_dropped(3)


def test_a_write_is_never_refused_because_of_leases():
    queue, book, _ = tier(4, cap=1.0)
    for k in range(4):
        queue.add(k, 1)
    book.retain([0, 1, 2, 3], Retain(100, 600))
    queue.add(9, 1)
    assert queue.evict(queue.used - 4, skip=(9,)) == [0]  # the lightest (all equal: its head) goes
    assert 9 in queue and len(queue) == 4


def test_priority_holds_for_the_ttl_then_decays_to_the_end():
    _, book, clock = tier(10, decay=0.5)
    book.retain(["a"], Retain(80, 100))
    assert book.weight_of("a") == 80
    clock.now += 100
    assert book.weight_of("a") == 80
    clock.now += 25  # half way through the 50 s of decay
    assert book.weight_of("a") == pytest.approx(40)
    clock.now += 25
    assert book.weight_of("a") is None and len(book) == 0 and book.stats()["ended"] == 1


def test_a_hit_on_a_leases_last_page_refreshes_it_and_a_shared_head_refreshes_nobody():
    queue, book, clock = tier(10)
    for k in ["sys", "a1", "a2", "b1"]:
        queue.add(k, 1)
    book.retain(["sys", "a1", "a2"], Retain(50, 100, "A"))
    book.retain(["sys", "b1"], Retain(50, 100, "B"))
    clock.now += 90
    queue.touch(["sys", "b1"])  # session B continues; A's pages are untouched but the shared head
    clock.now += 60  # A: 150 s idle, past its TTL and half its decay; B: 60 s since its refresh
    assert book.weight_of("a1") is None and book.weight_of("a2") is None  # A ended: 100 s TTL + 50 s decay
    assert book.weight_of("b1") == 50 and book.weight_of("sys") == 50
    assert book.session_of("b1") == "B"
    assert book.stats()["refreshed"] == 1


def test_refresh_session_and_release():
    _, book, clock = tier(10)
    book.retain([1, 2], Retain(50, 10, "A"))
    book.retain([3], Retain(50, 10, "A"))
    clock.now += 9
    assert book.refresh_session("A") == 2
    clock.now += 9
    assert len(book) == 2
    assert book.release(session="A") == 2 and len(book) == 0
    with pytest.raises(ValueError, match="one of session= or lease_id="):
        book.release()


def test_supersede_keeps_the_pages_it_is_told_to():
    queue, book, _ = tier(10, cap=1.0)
    for k in range(6):
        queue.add(k, 1)
    book.retain([0, 1, 2, 3], Retain(70, 60, "A"))
    book.retain([0, 1, 4, 5], Retain(70, 60, "A"), supersede=True)  # the session rewrote its history after 1
    first, protected = book.rank()
    assert first == {2, 3} and set(protected) == {0, 1, 4, 5}
    assert queue.evict(2) == [2, 3]
    assert "superseded" in book.why_dropped(2)


def test_no_lease_outlives_its_end_and_the_book_does_not_grow():
    queue, book, clock = tier(1000, cap=0.5)
    for turn in range(2000):  # a long day of short sessions, each leasing its pages once and leaving
        keys = [(turn, i) for i in range(4)]
        for k in keys:
            queue.add(k, 1)
        queue.evict(queue.used - 1000)
        book.retain(keys, Retain(50, 30, f"s{turn}"))
        clock.now += 7.0
        s = book.stats()
        assert s["leases_past_end"] == 0
        assert s["leases"] <= 7  # 30 s of TTL and 15 of decay, a session every 7 s
        assert s["pages_leased"] <= 28
    assert book.stats()["ended"] >= 1990


def test_bad_book_settings_are_refused():
    with pytest.raises(ValueError, match=r"0 to 1; got 1.5 \(HICACHE_RETENTION_CAP\)"):
        LeaseBook("t", capacity=10, cap=1.5)
    with pytest.raises(ValueError, match="at least one page"):
        LeaseBook("t", capacity=10).retain([], Retain(1, 1))


# ---- file:// honours the leases ---------------------------------------------------------------------


def _page_bytes(tmp_path, host) -> int:
    probe = make_storage(f"file://{tmp_path}/probe", host, model_id="ret")
    assert probe.write_pages(["f" * 64], slots_of([1], 64))[0].ok
    return probe.get_stats().backend["used_bytes"]


@pytest.mark.parametrize("leased", [False, True])
def test_file_store_keeps_a_leased_prefix_that_lru_would_evict(tmp_path, leased):
    host = make_pool(F.BIG, pages=40, seed=7)
    page = _page_bytes(tmp_path, host)
    store = make_storage(f"file://{tmp_path}/l3?capacity={10 * page}", host, model_id="ret")
    session = [f"{i:064x}" for i in range(4)]
    assert all(r.ok for r in store.write_pages(session, slots_of([1, 2, 3, 4], 64), parent=None))
    if leased:
        grant = store.retain(session, Retain(90, "10m", "agent-1"))
        assert (grant.pages, grant.protected, grant.capped, grant.eviction) == (4, 4, 0, "ordered")
    flood = [f"{0xF000 + i:064x}" for i in range(12)]
    for start in range(0, 12, 3):
        assert all(r.ok for r in store.write_pages(flood[start : start + 3], slots_of([5, 6, 7], 64)))
    present = store.backend.exists_objects(store.namespace.keys(session))
    if leased:
        assert present == [True] * 4
        results = store.read_pages(session, slots_of([20, 21, 22, 23], 64))
        assert all(r.ok for r in results)
        for src, dst in zip([1, 2, 3, 4], [20, 21, 22, 23]):  # the bytes are the session's own
            assert torch.equal(page_bytes(host, dst), page_bytes(host, src))
        assert store.leases.stats()["pages_protected"] == 4
        assert store.get_stats().backend["used_bytes"] <= 10 * page
    else:
        assert present == [False] * 4
        assert store.why_dropped(session[0]) is None


def test_file_store_explains_a_page_dropped_under_a_lease(tmp_path):
    from hicache_core.storage.explain import explain_miss
    from hicache_core.storage.keys import page_hashes

    host = make_pool(F.BIG, pages=40, seed=8)
    page = _page_bytes(tmp_path, host)
    store = make_storage(f"file://{tmp_path}/l3?capacity={4 * page}", host, model_id="ret")
    ids = tokens(4, 64, salt=3)
    keys = page_hashes(ids, 64)
    store.write_pages(keys, slots_of([1, 2, 3, 4], 64))
    store.retain(keys, Retain(40, 60, "s"))  # only 2 pages fit under the default cap of half
    store.write_pages([f"{0xE000 + i:064x}" for i in range(3)], slots_of([5, 6, 7], 64))
    assert store.backend.exists_objects(store.namespace.keys(keys)) == [True, True, False, False]
    assert "over the tier's retention cap (50% of the capacity)" in store.why_dropped(keys[2])
    report = explain_miss(store, ids)
    assert [p.reason for p in report.pages] == ["in_store", "in_store", "dropped_under_lease", "dropped_under_lease"]
    assert "under lease 1 (priority 40, ttl 60 s" in report.pages[2].detail


def test_stores_that_evict_nothing_or_by_their_own_policy_say_so(tmp_path):
    host = make_pool(F.BIG, pages=8, seed=9)
    unbounded = make_storage(f"file://{tmp_path}/l3", host, model_id="ret")
    memory = make_storage("memory://retention-test", host, model_id="ret")
    keys = [f"{i:064x}" for i in range(2)]
    assert unbounded.retain(keys, Retain(10, 60)).eviction == "never"
    assert memory.retain(keys, Retain(10, 60)).eviction == "never"


def test_a_new_weight_version_ends_the_stores_leases(tmp_path):
    host = make_pool(F.BIG, pages=8, seed=10)
    page = _page_bytes(tmp_path, host)
    store = make_storage(f"file://{tmp_path}/l3?capacity={10 * page}", host, model_id="ret")
    store.retain([f"{i:064x}" for i in range(3)], Retain(10, 60, "s"))
    assert len(store.leases) == 1
    store.set_weight_version("v2")
    assert len(store.leases) == 0 and store.leases.stats()["released"] == 1


def _lease_and_die(url: str, keys: list[str], ready) -> None:
    host = make_pool(F.BIG, pages=8, seed=11)
    store = make_storage(url, host, model_id="ret")
    assert all(r.ok for r in store.write_pages(keys, slots_of([1, 2, 3, 4], 64)))
    store.retain(keys, Retain(100, "1h", "doomed"))
    ready.set()
    import time

    time.sleep(60)  # killed before this ends


def test_a_crashed_instances_leases_end_with_it(tmp_path):
    """Leases live in the process that granted them: after it is killed, its pages in a shared store are
    ordinary pages that the next instance evicts as any other (nothing in the store pins them)."""
    import multiprocessing as mp
    import os
    import signal

    host = make_pool(F.BIG, pages=40, seed=12)
    page = _page_bytes(tmp_path, host)
    url = f"file://{tmp_path}/l3?capacity={8 * page}"
    keys = [f"{0xD000 + i:064x}" for i in range(4)]
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_lease_and_die, args=(url, keys, ready))
    proc.start()
    assert ready.wait(60)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    store = make_storage(url, host, model_id="ret")  # a restarted instance on the same directory
    assert store.backend.exists_objects(store.namespace.keys(keys)) == [True] * 4
    assert len(store.leases) == 0
    flood = [f"{0xC000 + i:064x}" for i in range(8)]
    for start in range(0, 8, 4):
        assert all(r.ok for r in store.write_pages(flood[start : start + 4], slots_of([5, 6, 7, 8], 64)))
    assert store.backend.exists_objects(store.namespace.keys(keys)) == [False] * 4


def test_a_sessions_new_lease_takes_over_its_earlier_ones():
    _, book, _ = tier(100)
    book.retain([1, 2], Retain(50, 60, "A"))
    book.retain([1, 2, 3], Retain(50, 60, "A"))  # the next turn: the whole prefix again, and more
    book.retain([9], Retain(50, 60, "A"))  # not a superset: both stand
    assert len(book) == 2 and book.stats()["subsumed"] == 1


def test_a_last_page_several_leases_share_refreshes_none_of_them():
    """A session whose prompt is only the shared system prompt would be kept alive by every other session's hits."""
    _, book, clock = tier(100)
    book.retain(["sys"], Retain(50, 10, "A"))
    book.retain(["sys", "b1"], Retain(50, 10, "B"))
    clock.now += 9
    assert book.refresh(["sys", "b1"]) == 1  # B's own last page; "sys" is A's last page and B's head
    clock.now += 7  # A: 16 s idle, past 10 s of TTL and 5 of decay
    assert book.session_of("sys") == "B" and book.stats()["leases"] == 1


def test_among_equal_leases_a_session_keeps_its_place_in_line_from_turn_to_turn():
    """What a grant said is protected stays protected while its session comes back within the TTL: a newcomer
    of equal priority is capped, and an abandoned session gives its place up once its lease decays."""
    queue, book, clock = tier(4, cap=0.5)  # room for one session of two pages
    for k in ["a1", "a2", "b1", "b2", "a3"]:
        queue.add(k, 1)
    assert book.retain(["a1", "a2"], Retain(50, 100, "A")).protected == 2
    clock.now += 5
    assert book.retain(["b1", "b2"], Retain(50, 100, "B")).capped == 2
    clock.now += 90
    grant = book.retain(["a1", "a2", "a3"], Retain(50, 100, "A"))  # A's next turn: still first in line
    assert (grant.protected, grant.capped) == (2, 1) and book.stats()["subsumed"] == 1
    book.refresh_session("B")
    clock.now += 95  # A is abandoned; B goes on
    book.refresh_session("B")
    clock.now += 7  # A: 102 s idle, past its TTL, decaying; B at full weight
    _, protected = book.rank()
    assert set(protected) == {"b1", "b2"}
