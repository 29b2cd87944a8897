"""Fixtures: a real mooncake_master on 127.0.0.1 for this plugin's tests."""

from __future__ import annotations

import pytest
from mooncake_server import start_master


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory):
    server = start_master(tmp_path_factory.mktemp("mooncake"))
    yield server
    server.stop()


@pytest.fixture
def mooncake_url(mooncake_master):
    return f"mooncake://127.0.0.1:{mooncake_master.port}?segment=64MiB&local_buffer=16MiB"
