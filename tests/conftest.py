"""Fixtures for the core's tests (helpers live in core_helpers.py)."""

from __future__ import annotations

import pytest

from hicache_core.registry import Registry


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
    import hicache_core.registry as reg

    real = reg._entry_points
    monkeypatch.setattr(reg, "_entry_points", lambda: [ep for ep in real() if ep.name not in ("kernel", "jit")])
    return Registry.from_entry_points()
