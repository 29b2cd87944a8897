"""explain_miss against a real SeaweedFS S3 gateway: the live API and ``hicache explain-miss``, every reason.

The scenario (hicache_core.testing.explain_kit) removes a page, flips a payload byte through S3
itself, stores pages under another layout, fills the host pool before a prefetch and times a slow
prefetch out; then the server stops and the command says so, without a traceback.
"""

from __future__ import annotations

from s3_objects import flip_byte
from seaweedfs_server import start_seaweedfs

from hicache_core.cli import main
from hicache_core.testing import explain_kit as kit


def test_every_reason_against_s3(tmp_path, capsys, monkeypatch, s3_env):
    monkeypatch.delenv("HICACHE_METRICS_DIR", raising=False)
    server = start_seaweedfs(tmp_path / "weed")
    try:
        server.create_bucket("explain")
        url = server.url("explain", "kit", timeout=2, connect_timeout=1, retries=0)
        kit.check_against_server(url, flip_byte, tmp_path, main, capsys, stop=server.stop, start_hint="weed server -s3")
    finally:
        server.stop()
