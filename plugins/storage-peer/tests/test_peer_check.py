"""``hicache storage check peer://...``: the directory, this instance's NIXL registration and lease, and a
round trip of pages published by one instance and read through NIXL by a second one, verified."""

from __future__ import annotations

import json

import redis

from hicache_core.cli import main
from hicache_core.testing.servers import free_port


def _prefix(url: str) -> str:
    return url.split("prefix=")[1].split("&")[0]


def publication_slots(publish_bytes: int) -> int:
    """The slots of the check's pool's pages in ``publish_bytes``: its pool verifies where HICACHE_VERIFY says, and
    a slot (on 64 bytes) then holds a page's checksum row after its payload."""
    from hicache_core.storage.pages import PageMap
    from hicache_core.tools.storage_check import _small_pool

    pm = PageMap(_small_pool())
    return publish_bytes // (-(-(pm.page_bytes + pm.trailer_bytes) // 64) * 64)


def test_check_reads_the_pages_through_a_second_instance_and_passes(peer_url, redis_server, capsys):
    assert main(["storage", "check", peer_url]) == 0
    out = capsys.readouterr().out
    lines = [line.strip() for line in out.splitlines()]
    assert "peer:// serves other instances only: a second instance of the URL reads the pages" in lines
    for step in (f"ok   the directory answers at 127.0.0.1:{redis_server.port}/0",
                 "ok   only the publication area and its generation words are registered with NIXL (UCX): "
                 f"{publication_slots(4 << 20)} page slot(s), 3 MiB; the host pool is not registered",
                 "ok   write 5 pages",
                 "ok   batch_exists is a prefix length (by a second instance): 5 of 6 (expected 5)",
                 "ok   read back byte-exact (by a second instance)",
                 "ok   a missing page reads as missing (by a second instance)",
                 "ok   remove, then found by none (by a second instance)"):  # fmt: skip
        assert any(line.startswith(step) for line in lines), f"{step!r} not in:\n{out}"
    joined = [line for line in lines if line.startswith("ok   joined the directory as owner ")]
    assert len(joined) == 1 and joined[0].endswith(", lease 3 s"), out
    assert lines[-1] == "all checks passed" and "FAIL" not in out
    # Both instances left the directory: no owner record, no page entry.
    assert list(redis.Redis(port=redis_server.port).scan_iter(match=_prefix(peer_url) + "*")) == []


def test_check_json_counts_the_pages_the_second_instance_read(peer_url, capsys):
    assert main(["storage", "check", peer_url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["second_instance"] is True
    assert all(s["ok"] for s in report["steps"]) and len(report["steps"]) == 8, report["steps"]
    reader, writer = report["reader_stats"], report["stats"]
    assert reader["pages_read"] == 5 and reader["read_corrupt"] == 0 and reader["read_missing"] == 1
    assert reader["backend"]["transfers"] >= 2  # the pages, then their generation words
    assert writer["pages_written"] == 5 and writer["backend"]["published"] == 5 and writer["pages_read"] == 0


def test_check_of_an_unreachable_directory_says_so_without_a_traceback(capsys):
    port = free_port()
    # A store it cannot reach is a failure of what was asked (exit 1), said in one line on stderr.
    assert main(["storage", "check", f"peer://127.0.0.1:{port}/0?timeout=1&insecure=1"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"directory 127.0.0.1:{port}/0" in err and "redis-server --port" in err
