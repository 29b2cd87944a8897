"""explain_miss against a real redis-server: the live API and ``hicache explain-miss``, every reason.

The scenario (hicache_core.testing.explain_kit) removes a page, flips a payload byte through
Redis itself, stores pages under another layout, fills the host pool before a prefetch and
times a slow prefetch out; pointed at a port where no server listens, the command says so, without a
traceback.
"""

from __future__ import annotations

from hicache_core.cli import main
from hicache_core.testing import explain_kit as kit
from hicache_core.testing.servers import free_port


def _corrupt(backend, key, offset):
    k = backend._k(key)
    byte = backend.client.getrange(k, offset, offset)
    backend.client.setrange(k, offset, bytes([byte[0] ^ 0xFF]))


def test_every_reason_against_redis(redis_server, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HICACHE_METRICS_DIR", raising=False)
    prefix = f"explain{tmp_path.name}:"
    url = f"redis://127.0.0.1:{redis_server.port}/0?timeout=2&prefix={prefix}"
    nobody = f"redis://127.0.0.1:{free_port()}/0?timeout=2&prefix={prefix}"
    kit.check_against_server(url, _corrupt, tmp_path, main, capsys, unreachable=nobody,
                             start_hint="redis-server --port")  # fmt: skip
