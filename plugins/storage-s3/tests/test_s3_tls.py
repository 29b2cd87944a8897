"""s3:// over TLS against SeaweedFS's HTTPS port: trusted through ca=, refused (clearly) without it."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from seaweedfs_server import SeaweedFS, _port_pair

from hicache_core.storage import PageStatus, StorageError, make_storage, page_hashes
from hicache_core.testing.storage_kit import StorageCase, make_pool, page_bytes


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def test_https_endpoint_with_its_ca(tmp_path, s3_env):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: the test makes its own CA and server certificate")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")  # quick to make, unlike RSA
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=hicache-test-ca",
             cwd=tmp_path)  # fmt: skip
    _openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1", cwd=tmp_path)
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.crt", "-days", "1", "-extfile", "san.ext", cwd=tmp_path)  # fmt: skip
    https = _port_pair()
    server = SeaweedFS(tmp_path / "weed", extra=(f"-s3.cert.file={tmp_path / 'server.crt'}",
                                                 f"-s3.key.file={tmp_path / 'server.key'}", f"-s3.port.https={https}"))
    server.start()
    try:
        server.create_bucket("tls")  # through the plain port; the pages go through TLS
        endpoint = f"https://127.0.0.1:{https}"
        case = StorageCase("mha", "page_first", "plain", 4)
        host = make_pool(case, pages=16, seed=5)
        backend = make_storage(f"s3://tls/p?endpoint={endpoint}&ca={tmp_path / 'ca.crt'}&timeout=5", host,
                               model_id="m")  # fmt: skip
        backend.ping()
        keys = page_hashes(list(range(16)), 4)
        src, dst = host.alloc(16), host.alloc(16)
        assert all(r.ok for r in backend.write_pages(keys, src))
        assert all(r.ok for r in backend.read_pages(keys, dst))
        for i in range(4):
            assert (page_bytes(host, int(src[i * 4]) // 4) == page_bytes(host, int(dst[i * 4]) // 4)).all()
        backend.close()
        untrusted = make_storage(f"s3://tls/p?endpoint={endpoint}&timeout=5&retries=0", host, model_id="m")
        with pytest.raises(StorageError, match="TLS certificate was not accepted"):
            untrusted.ping()
        (r,) = untrusted.read_pages(keys[:1], host.alloc(4))
        assert r.status is PageStatus.ERROR and "TLS certificate" in r.detail
        untrusted.close()
    finally:
        server.stop()
