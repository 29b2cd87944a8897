"""The test servers' ports: under pytest-xdist each worker has a range of its own, below the ephemeral ports."""

from __future__ import annotations

import socket

import pytest

from hicache_core.testing import servers


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(servers, "_handed_out", set())


def test_without_xdist_the_kernel_picks_a_free_port(monkeypatch, fresh):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    port = servers.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@pytest.mark.parametrize("worker", [0, 1, 5])
def test_each_xdist_worker_draws_from_its_own_range_below_the_ephemeral_ports(monkeypatch, fresh, worker):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
    ports = [servers.free_port() for _ in range(50)]
    first = 10000 + worker * 1000
    assert all(first <= p < first + 1000 for p in ports), ports
    assert len(set(ports)) == 50, "a port was handed out twice in one process"
    assert max(ports) < 32768


def test_a_port_in_use_is_never_handed_out(monkeypatch, fresh):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
    held = []
    try:
        for port in range(12000, 12990):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            held.append(s)
        in_use = {s.getsockname()[1] for s in held}
        got = {servers.free_port() for _ in range(5)}
        assert got.isdisjoint(in_use) and all(12990 <= p < 13000 for p in got)
        with pytest.raises(RuntimeError, match="no free port left in xdist worker gw2's range 12000-12999"):
            for _ in range(11):
                servers.free_port()
    finally:
        for s in held:
            s.close()
