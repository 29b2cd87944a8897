"""Tensor-parallel ranks agree on L3 hit lengths over gloo (2 and 4 processes), whatever fails where."""

from __future__ import annotations

import pytest

from hicache_core.testing.storage_procs import agreement, run_ranks


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_agree_on_hits_and_loads_without_deadlock(world, tmp_path):
    ranks = run_ranks(agreement, world, tmp_path, timeout=180, rounds=12)
    for r in range(12):
        rows = [rank["rounds"][r] for rank in ranks]
        kind, victim = rows[0]["fault"]
        local = []
        for rank, row in enumerate(rows):
            if (kind == 1 and victim == rank) or (kind == 2 and victim == rank):
                assert row["local"] == 0, row  # exists raised, or cancelled before looking
                local.append(0)
            else:
                assert row["local"] == row["stored"], row
                local.append(row["stored"])
        agreed = min(local)
        loaded = agreed
        if kind == 3 and rows[victim]["stored"] > 1:
            loaded = min(agreed, 1)  # the victim's second page is corrupt
        for row in rows:
            assert row["agreed"] == agreed, (r, rows)
            assert row["completed"] == loaded, (r, rows)
            assert row["tokens"] == loaded * 4
            assert row["bytes_ok"], row
    for rank in ranks:
        assert rank["free_after"] == rank["capacity"], "host slots leaked"
        assert rank["stats"]["agreement_timeouts"] == 0
        assert rank["stats"]["prefetches"] == 12


@pytest.mark.parametrize("mode", ["delay", "extra"])
def test_ranks_agree_or_all_fail_never_a_stale_pairing(mode, tmp_path):
    """A rank late past the bound, and a prefetch only one rank submitted: every rank fails alike."""
    from hicache_core.testing.storage_procs import late_rank

    ranks = run_ranks(late_rank, 2, tmp_path, timeout=90, mode=mode, op_timeout=2.0, delay=4.0)
    for rank in ranks:
        assert rank["first"][0] == 0, ranks  # nobody reports pages another rank gave up on
        assert rank["second"][0] == 0 and "rank agreement lost" in rank["second"][1], ranks
        assert rank["broken"], ranks
        assert rank["reasons"][0] == "ranks_disagreed", ranks
        assert rank["free"] == rank["capacity"], "host slots leaked"
    if mode == "extra":
        assert all("different" in r["first"][1] for r in ranks), ranks
