"""The agentic trace benchmark (benchmarks/agentic_trace.py) at a tiny size, on hicache's real retention code.

What must hold whatever the tuning: the trace follows the statistics it claims; no lease is alive past its
session's end (the sim's own account) at any sample; protected pages never pass the cap; no store is refused;
what the books track stays within what live leases may hold over a simulated day. No timing is asserted.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "agentic_trace.py"


@pytest.fixture(scope="module")
def bench() -> Any:
    spec = importlib.util.spec_from_file_location("agentic_trace_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_trace_follows_the_published_statistics(bench: Any) -> None:
    params = bench.TraceParams(live_sessions=12)
    sessions = bench.make_trace(params, 6 * 3600)
    st = bench.trace_stats(sessions)
    assert 38 <= st["turns_median_finished"] <= 48  # median 43 turns
    assert 120_000 <= st["final_context_tokens_median_finished"] <= 165_000  # median 142K tokens
    assert st["prefix_reuse_ceiling"] > 0.96  # over 96 % prefix hits for an unbounded cache
    assert st["tool_pause_share_under_60s"] > 0.8 and st["tool_pause_share_over_300s"] > 0  # seconds to minutes
    assert 0.05 < st["abandoned"] / st["sessions"] < 0.3
    for s in sessions:  # a prompt only grows, and starts with its shared head
        assert s.pages == sorted(s.pages) and s.pages[0] >= s.head_pages
        assert s.times == sorted(s.times)
    again = bench.make_trace(params, 6 * 3600)
    assert [(s.times, s.pages) for s in again] == [(s.times, s.pages) for s in sessions]  # seeded
    live = statistics.fmean(bench.working_set(sessions, range(2 * 3600, 6 * 3600, 300)))
    assert live > 0


@pytest.fixture(scope="module")
def tiny(bench: Any) -> dict[str, Any]:
    params = bench.TraceParams(seed=7, live_sessions=3)
    sessions = bench.make_trace(params, 2700)
    sizes = bench.sizes_for(sessions, 0.75, 900.0, 60.0, 2.0, 0.5)
    runs = {}
    for policy in ("lru", "retention"):
        cfg = bench.RunConfig(policy, sizes["host_pages"], sizes["l3_pages"], warmup_s=900.0, sample_s=30.0)
        runs[policy] = bench.simulate(sessions, cfg)
    return {"sessions": sessions, "sizes": sizes, "runs": runs}


def test_leases_end_the_cap_holds_and_no_store_is_refused(bench: Any, tiny: dict[str, Any]) -> None:
    run = tiny["runs"]["retention"]
    assert run.samples and run.grants["granted"] > 0 and run.grants["capped_grants"] > 0  # the cap was reached
    for x in run.samples:
        for tier in ("host", "l3"):
            assert x[tier]["leases_past_session_end"] == 0, (x["t"], tier)
            assert x[tier]["leases_past_end_book"] == 0
            assert x[tier]["protected_units"] <= x[tier]["cap_units"], (x["t"], tier)
            assert x[tier]["keys_tracked"] <= x["lease_bound_pages"]
    for policy, r in tiny["runs"].items():
        assert r.counts["stores_over_capacity"] == 0, policy
        assert r.counts["demoted"] > 0 and r.counts["dropped"] > 0, policy  # the tiers were oversubscribed
    assert run.counts["demoted_under_lease"] > 0
    summary = bench.summarize(run)
    assert summary["cap"]["samples_over_cap"] == 0 and summary["leases_past_end"]["max_past_session_end"] == 0


def test_the_oracle_bounds_both_policies(bench: Any, tiny: dict[str, Any]) -> None:
    """The reference knows every next use: no eviction order finds more of the previous turns' pages."""
    runs = tiny["runs"]
    cfg = runs["lru"].cfg
    oracle = bench.summarize(bench.simulate_oracle(tiny["sessions"], cfg))["next_turn"]["token_hit_rate"]
    for policy, run in runs.items():
        assert bench.summarize(run)["next_turn"]["token_hit_rate"] <= oracle, policy


def _session(bench: Any, sid: int, times: list[float], pages: list[int], *, head_pages: int = 8,
             abandoned: bool = False) -> Any:  # fmt: skip
    return bench.Session(sid, 0, head_pages, times, pages, [0.0] * len(times), [False] * len(times), abandoned)


def test_a_lease_keeps_a_paused_session_that_lru_loses(bench: Any) -> None:
    """A session paused 200 s (under its 300 s TTL) while two others write four times the tiers: its lease (the
    oldest, under the cap) keeps its pages; LRU lets them go. The lease's promise, on hicache's own queue and book."""
    paused = _session(bench, 0, [0.0, 200.0], [40, 41])
    busy = [_session(bench, sid, [10.0 + 10 * i for i in range(17)], [40 + 20 * i for i in range(17)])
            for sid in (1, 2)]  # fmt: skip
    sessions = [paused, *busy]
    found = {}
    for policy in ("lru", "retention"):
        run = bench.simulate(sessions, bench.RunConfig(policy, host_pages=200, l3_pages=200, sample_s=10.0))
        (row,) = [r for r in run.rows if r[1] == 0 and r[2] == 1]
        found[policy] = (row[5] + row[6]) / row[4]
        assert all(x.get("host", {}).get("leases_past_session_end", 0) == 0 for x in run.samples)
    assert found["retention"] == 1.0
    assert found["lru"] < found["retention"]


def test_a_lease_ending_in_a_shared_head_ends_when_its_session_is_gone(bench: Any) -> None:
    """Other sessions' reads through the shared head never keep alive a lease that ends in it (only the deepest
    page of a read refreshes a lease). Session 1's first turn, at 30 s, reads exactly session 0's prefix (the head
    alone) and may refresh it once, as session 0 continuing would: the lease ends by 30 + 450 s, never later."""
    # Session 0 sends the system prompt and a few tokens (no whole page of its own), then is abandoned; session 1
    # has the same head and a turn every minute for 20 minutes.
    gone = _session(bench, 0, [0.0], [8], abandoned=True)
    other = _session(bench, 1, [30.0 + 60 * i for i in range(20)], [12 + 4 * i for i in range(20)])
    run = bench.simulate([gone, other], bench.RunConfig("retention", host_pages=400, l3_pages=400, sample_s=30.0))
    past = [x["t"] for x in run.samples for tier in ("host", "l3") if x[tier]["leases_past_session_end"]]
    assert all(t <= 480.0 for t in past), f"session 0's lease alive past 480 s at {[t for t in past if t > 480][:3]}"
    assert max(x["t"] for x in run.samples) > 1100  # the samples went on long after


def test_superseding_orders_evictions_as_regranting_does(bench: Any, tiny: dict[str, Any]) -> None:
    """``retain(..., supersede=True)`` each turn and a plain ``retain`` give the same pages the same weight and the
    session the same place in line (the new lease holds every page of the old): the same hits on every turn."""
    regrant = tiny["runs"]["retention"]
    assert regrant.cfg.lease_call == "stack"
    cfg = bench.dataclasses.replace(regrant.cfg, lease_call="supersede")
    supersede = bench.simulate(tiny["sessions"], cfg)
    assert [r[:7] for r in supersede.rows] == [r[:7] for r in regrant.rows]
    assert all(x[t]["leases_past_session_end"] == 0 for x in supersede.samples for t in ("host", "l3"))
