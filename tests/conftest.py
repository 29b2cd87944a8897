"""Fixtures for the core's tests (helpers live in core_helpers.py)."""

from __future__ import annotations

import pytest

from hicache_core.plugins.registry import Registry


@pytest.fixture
def registry() -> Registry:
    """A registry loaded from the installed entry points (fresh per test)."""
    return Registry.from_entry_points()


@pytest.fixture
def direct_only() -> Registry:
    return Registry.from_entry_points({"direct"})


@pytest.fixture
def without_kernel(monkeypatch) -> Registry:
    """A registry as if hicache-kernel and hicache-jit were not installed."""
    import hicache_core.plugins.registry as reg

    real = reg._entry_points
    monkeypatch.setattr(reg, "_entry_points", lambda: [ep for ep in real() if ep.name not in ("kernel", "jit")])
    return Registry.from_entry_points()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Skipped tests grouped by reason, most first: what a run did not check, and why, at a glance.

    ``-ra`` lists skips per location; a missing server (redis-server, libibverbs) skips a whole
    suite from many places, which this turns into one line per reason with its count.
    """
    by_reason: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        by_reason[reason] = by_reason.get(reason, 0) + 1
    if not by_reason:
        return
    terminalreporter.section(f"skipped tests by reason ({sum(by_reason.values())} in all)")
    for reason, count in sorted(by_reason.items(), key=lambda item: (-item[1], item[0])):
        terminalreporter.write_line(f"{count:6d}  {reason}")
