"""explain_miss against a real mooncake_master: the live API and ``hicache explain-miss``, every reason.

The scenario (hicache_core.testing.explain_kit) removes a page, flips a payload byte through
the store itself, stores pages under another layout, fills the host pool before a prefetch and
times a slow prefetch out. The command's own client reads the pages from the scenario's segment
while the scenario's client lives (a mooncake page leaves with its writer's segment).
"""

from __future__ import annotations

from hicache_core.cli import main
from hicache_core.testing import explain_kit as kit


def _corrupt(backend, key, offset):
    data = bytearray(backend.store.get(key))
    data[offset] ^= 0xFF
    backend.store.batch_remove([key], True)
    assert backend.store.put(key, bytes(data)) == 0


def test_every_reason_against_mooncake(mooncake_url, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HICACHE_METRICS_DIR", raising=False)
    kit.check_against_server(mooncake_url, _corrupt, tmp_path, main, capsys)
