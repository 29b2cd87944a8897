"""Never silently wrong on Redis (a real server): credentials, bounded calls, per-key errors, a literal clear, TLS."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid

import pytest

from hicache_core.storage import PageStatus, StorageError, make_storage, page_hashes
from hicache_core.testing.servers import ServerProcess, redis_binary, start_redis
from hicache_core.testing.storage_kit import StorageCase, make_pool

CASE = StorageCase("mha", "page_first", "plain", 4)


@pytest.fixture
def own_redis(tmp_path):
    server = start_redis(tmp_path, "--requirepass", "s3cr3t")
    yield server
    if server.proc and server.proc.poll() is None:
        server.resume()
    server.stop()


def _pool():
    return make_pool(CASE, pages=16, seed=4)


def test_user_info_credentials_are_used_and_never_printed(own_redis, capsys):
    from hicache_core.cli import main

    host = _pool()
    for url in (
        f"redis://:s3cr3t@127.0.0.1:{own_redis.port}/0",
        f"redis://default:s3cr3t@127.0.0.1:{own_redis.port}/0",
    ):
        storage = make_storage(url, host, model_id="m")
        keys = page_hashes(list(range(8)), 4)
        assert all(r.ok for r in storage.write_pages(keys, host.alloc(8)))
        assert storage.batch_exists(keys) == 2
        assert "s3cr3t" not in repr(storage) and "***" in repr(storage)
        storage.clear()
        storage.close()
        assert main(["storage", "check", url]) == 0
        assert main(["storage", "stats", url]) == 0
        out = capsys.readouterr().out
        assert "s3cr3t" not in out and "all checks passed" in out
    wrong = f"redis://:nope@127.0.0.1:{own_redis.port}/0"
    assert main(["storage", "check", wrong]) == 1  # the store refused what was asked: a failure, said on stderr
    out, err = capsys.readouterr()
    assert out == "" and "authentication" in err.lower() and "nope" not in err and "Traceback" not in err


def test_check_explains_a_server_that_is_down_and_a_bad_url(capsys):
    pytest.importorskip("redis", reason="the message names a server that is down: the client must be there to try it")
    from hicache_core.cli import main
    from hicache_core.testing.servers import free_port

    assert main(["storage", "check", f"redis://:pw@127.0.0.1:{free_port()}/0"]) == 1  # down: a failure
    err = capsys.readouterr().err
    assert "not reachable" in err and "redis-server --port" in err and ":pw@" not in err
    assert main(["storage", "check", "redis://127.0.0.1:6379/notadb"]) == 2  # a URL it does not take: bad usage
    assert "database number" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf"])
def test_timeouts_that_cannot_work_are_refused(bad):
    with pytest.raises(ValueError, match="positive number of seconds"):
        make_storage(f"redis://127.0.0.1:1/0?timeout={bad}")


def test_a_call_against_a_paused_server_returns_within_its_timeout(own_redis):
    host = _pool()
    storage = make_storage(f"redis://:s3cr3t@127.0.0.1:{own_redis.port}/0?timeout=1", host, model_id="m")
    keys = page_hashes(list(range(8)), 4)
    storage.write_pages(keys, host.alloc(8))
    own_redis.pause()  # SIGSTOP: the socket stays open, nothing answers
    try:
        t0 = time.monotonic()
        results = storage.read_pages(keys, host.alloc(8))
        took = time.monotonic() - t0
    finally:
        own_redis.resume()
    assert all(r.status in (PageStatus.ERROR, PageStatus.TIMEOUT) for r in results), results
    assert took < 1 + 1.5, f"a 1 s timeout took {took:.1f} s (retries must be off)"


def test_a_foreign_value_fails_only_its_own_key_and_clear_is_literal(own_redis):
    import redis

    admin = redis.Redis(port=own_redis.port, password="s3cr3t")
    host = _pool()
    url = f"redis://:s3cr3t@127.0.0.1:{own_redis.port}/0"
    mine = make_storage(url + "?prefix=t*:", host, model_id="m")
    other = make_storage(url + "?prefix=tx:", host, model_id="m")
    keys = page_hashes(list(range(16)), 4)
    mine.write_pages(keys, host.alloc(16))
    other.write_pages(keys, host.alloc(16))
    target = mine.backend._k(mine.namespace.key(keys[1]))
    admin.delete(target)
    admin.rpush(target, b"x")  # a list where a page should be
    res = mine.read_pages(keys, host.alloc(16))
    assert [r.status for r in res] == [PageStatus.OK, PageStatus.MISMATCH, PageStatus.OK, PageStatus.OK]
    assert "not a hicache page" in res[1].detail
    mine.clear()  # "t*:" must not match "tx:"
    assert mine.batch_exists(keys) == 0 and other.batch_exists(keys) == 4


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def test_rediss_tls(tmp_path):
    binary = redis_binary()
    if binary is None or shutil.which("openssl") is None:
        pytest.skip("redis-server or openssl is not installed")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "1",
        "-subj",
        "/CN=hicache-test-ca",
        cwd=tmp_path,
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
        cwd=tmp_path,
    )
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "1",
        "-extfile",
        "san.ext",
        cwd=tmp_path,
    )

    def argv(port):
        return [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(tmp_path), "--tls-cert-file", str(tmp_path / "server.crt"),
                "--tls-key-file", str(tmp_path / "server.key"), "--tls-ca-cert-file", str(tmp_path / "ca.crt"),
                "--tls-auth-clients", "no"]  # fmt: skip

    server = ServerProcess(argv, tmp_path / f"redis-tls-{uuid.uuid4().hex[:6]}.log", start_timeout=20)
    try:
        server.start()
    except Exception as exc:  # noqa: BLE001
        log = tmp_path.glob("redis-tls-*.log")
        text = " ".join(p.read_text() for p in log)
        if "TLS" in text and ("not" in text or "support" in text):
            pytest.skip(f"this redis-server is built without TLS: {text[-300:]}")
        raise exc
    try:
        host = _pool()
        url = f"rediss://127.0.0.1:{server.port}/0?ca={tmp_path / 'ca.crt'}&timeout=5"
        storage = make_storage(url, host, model_id="m")
        keys = page_hashes(list(range(8)), 4)
        assert all(r.ok for r in storage.write_pages(keys, host.alloc(8)))
        got = storage.read_pages(keys, host.alloc(8))
        assert all(r.ok for r in got)
        storage.close()
        plain = make_storage(f"redis://127.0.0.1:{server.port}/0?timeout=2", host, model_id="m")
        with pytest.raises(StorageError):
            plain.ping()  # the TLS port does not speak plain RESP
        with pytest.raises(ValueError, match="need rediss://"):
            make_storage(f"redis://127.0.0.1:{server.port}/0?ca=x")
        untrusted = make_storage(f"rediss://127.0.0.1:{server.port}/0?timeout=2", host, model_id="m")
        with pytest.raises(StorageError):
            untrusted.ping()  # the system CAs do not know this server's CA
    finally:
        server.stop()
