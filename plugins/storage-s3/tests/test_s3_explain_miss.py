"""explain_miss against a real SeaweedFS S3 gateway: the live API and ``hicache explain-miss``, every reason.

The scenario (hicache_core.testing.explain_kit) removes a page, flips a payload byte through S3
itself, stores pages under another layout, fills the host pool before a prefetch and times a slow
prefetch out; pointed at a port where no server listens, the command says so, without a traceback.
"""

from __future__ import annotations

from s3_objects import flip_byte

from hicache_core.cli import main
from hicache_core.testing import explain_kit as kit
from hicache_core.testing.servers import free_port


def test_every_reason_against_s3(seaweedfs, s3_bucket, tmp_path, capsys, monkeypatch, s3_env):
    monkeypatch.delenv("HICACHE_METRICS_DIR", raising=False)
    url = seaweedfs.url(s3_bucket, f"explain-{tmp_path.name}", timeout=2, connect_timeout=1, retries=0)
    nobody = url.replace(seaweedfs.endpoint, f"http://127.0.0.1:{free_port()}")
    kit.check_against_server(url, flip_byte, tmp_path, main, capsys, unreachable=nobody, start_hint="weed server -s3")
