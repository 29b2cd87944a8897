"""The directory over TLS: a real redis-server with ``--tls-port``, certificates made here with openssl."""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest
import torch
from peer_proc import CASE, MODEL, fill, keys_for, page_content

from hicache_core.storage import make_storage
from hicache_core.storage.backend import StorageError
from hicache_core.testing.servers import free_port, start_redis
from hicache_core.testing.storage_kit import make_pool

PASSWORD = "tls-directory-password-77"


@pytest.fixture(autouse=True)
def cluster_key(monkeypatch):
    """The setup the docs ask for where the path to Redis is not trusted: TLS, a password and the cluster key."""
    monkeypatch.delenv("HICACHE_L3_KEY_FILE", raising=False)
    monkeypatch.setenv("HICACHE_L3_KEY", os.urandom(32).hex())


def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=hicache test CA", cwd=d)  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
            "-subj", "/CN=127.0.0.1", cwd=d)  # fmt: skip
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.pem", "-days", "2", "-extfile", "san.cnf", cwd=d)  # fmt: skip
    tls_port = free_port()
    server = start_redis(d, "--tls-port", str(tls_port), "--tls-cert-file", str(d / "server.pem"),
                         "--tls-key-file", str(d / "server.key"), "--tls-ca-cert-file", str(d / "ca.pem"),
                         "--tls-auth-clients", "no", "--requirepass", PASSWORD)  # fmt: skip
    yield tls_port, d
    server.stop()


def url_for(port: int, **extra: str) -> str:
    opts = "".join(f"&{k}={v}" for k, v in extra.items())
    return f"peer://:{PASSWORD}@127.0.0.1:{port}/0?prefix=tls{uuid.uuid4().hex[:6]}:&timeout=3&publish_bytes=1MiB{opts}"


def test_pages_go_through_a_directory_reached_over_tls(tls_redis):
    port, d = tls_redis
    url = url_for(port, tls="1", tls_ca_file=str(d / "ca.pem"))
    owner_host, reader_host = make_pool(CASE, pages=8, seed=1), make_pool(CASE, pages=8, seed=2)
    owner = make_storage(url, owner_host, model_id=MODEL)
    reader = make_storage(url, reader_host, model_id=MODEL, serve=0)
    try:
        assert owner.backend.directory.address.startswith("tls://127.0.0.1:")
        keys = keys_for(21, 2)
        src = owner_host.alloc(2 * CASE.page_size)
        fill(owner_host, src, keys)
        assert all(r.ok for r in owner.write_pages(keys, src))
        slots = reader_host.alloc(2 * CASE.page_size)
        assert all(r.ok for r in reader.read_pages(keys, slots))
        got = reader_host.get_data_page(int(slots[CASE.page_size]), flat=True).view(torch.uint8)
        assert torch.equal(got, page_content(reader_host, keys[1]))
    finally:
        reader.close()
        owner.close()


def test_a_server_certificate_no_trusted_ca_signed_is_refused(tls_redis):
    port, _ = tls_redis
    with pytest.raises(StorageError, match="certificate verify failed"):
        make_storage(url_for(port, tls="1"), make_pool(CASE, pages=4, seed=1), model_id=MODEL)


def test_tls_files_without_tls_and_missing_files_are_refused_before_connecting(tls_redis):
    port, d = tls_redis
    with pytest.raises(ValueError, match="option tls_ca_file needs tls=1"):
        make_storage(url_for(port, tls_ca_file=str(d / "ca.pem")))
    with pytest.raises(ValueError, match="option tls_ca_file=.*no such file"):
        make_storage(url_for(port, tls="1", tls_ca_file=str(d / "nope.pem")))
