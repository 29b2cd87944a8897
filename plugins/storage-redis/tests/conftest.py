"""Fixtures: a real redis-server on 127.0.0.1 for this plugin's tests."""

from __future__ import annotations

import uuid

import pytest

from hicache_core.testing.servers import start_redis

pytest.importorskip("redis", reason="the redis package is not installed (pip install redis==8.1.0)")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    return f"redis://127.0.0.1:{redis_server.port}/0?prefix=t{uuid.uuid4().hex[:8]}:"
