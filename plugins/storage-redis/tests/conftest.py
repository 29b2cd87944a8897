"""Fixtures: a real redis-server on 127.0.0.1 for this plugin's tests."""

from __future__ import annotations

import uuid

import pytest
from redis_server import start_redis


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    return f"redis://127.0.0.1:{redis_server.port}/0?prefix=t{uuid.uuid4().hex[:8]}:"
