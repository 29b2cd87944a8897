"""Multipart uploads against a real SeaweedFS: whole objects round-trip; an upload cut at the batch's deadline,
or failed, is aborted: the bucket lists no multipart upload afterwards.
"""

from __future__ import annotations

import time
import uuid

import pytest
from http_stubs import Relay
from seaweedfs_server import ACCESS_KEY, REGION, SECRET_KEY

from hicache_core.storage import make_storage
from hicache_core.storage.pages import Span

MiB = 1 << 20


def _admin(endpoint: str):
    """A plain botocore client straight to the server: the test's own view of the bucket's uploads."""
    botocore_session = pytest.importorskip("botocore.session")
    from botocore.config import Config

    return botocore_session.Session().create_client(
        "s3", region_name=REGION, endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY, config=Config(s3={"addressing_style": "path"}),
    )  # fmt: skip


def _uploads(admin, bucket: str, prefix: str) -> list[str]:
    answer = admin.list_multipart_uploads(Bucket=bucket, Prefix=prefix)
    return [u["Key"] for u in answer.get("Uploads", [])]


def _body(nbytes: int, seed: int) -> bytearray:
    return bytearray((seed * 7 + i) % 256 for i in range(256)) * (nbytes // 256)


def test_the_listing_sees_an_upload_in_progress(seaweedfs, s3_bucket, s3_env):
    """The check below is not vacuous: an upload left open is listed, and gone once aborted."""
    admin = _admin(seaweedfs.endpoint)
    prefix = f"mp{uuid.uuid4().hex[:6]}"
    upload = admin.create_multipart_upload(Bucket=s3_bucket, Key=f"{prefix}/open")
    assert _uploads(admin, s3_bucket, prefix) == [f"{prefix}/open"]
    admin.abort_multipart_upload(Bucket=s3_bucket, Key=f"{prefix}/open", UploadId=upload["UploadId"])
    assert _uploads(admin, s3_bucket, prefix) == []


def test_an_object_above_part_size_round_trips_in_parts(seaweedfs, s3_bucket, s3_env):
    prefix = f"mp{uuid.uuid4().hex[:6]}"
    relay = Relay(seaweedfs.port)
    try:
        url = f"s3://{s3_bucket}/{prefix}?endpoint={relay.endpoint}&part_size=5MiB&timeout=10"
        backend = make_storage(url).backend
        body = _body(12 * MiB + 4096, seed=3)
        assert backend.put_objects(["big"], [[Span(0, len(body), memoryview(body))]]) == [None]
        back = bytearray(len(body))
        assert backend.get_objects_into(["big"], [[Span(0, len(back), memoryview(back))]]) == [None]
        assert back == body
        backend.close()
    finally:
        relay.close()
    parts = [h for h in relay.heads if "partNumber=" in h.split("\r\n", 1)[0]]
    assert len(parts) == 3, "12 MiB in parts of 5 MiB is three parts"
    assert _uploads(_admin(seaweedfs.endpoint), s3_bucket, prefix) == []


def test_an_upload_cut_at_the_batch_deadline_is_aborted(seaweedfs, s3_bucket, s3_env):
    prefix = f"mp{uuid.uuid4().hex[:6]}"
    # Every part is held back 0.9 s: each request stays well within its 4 s timeout, but sixteen parts one at
    # a time (concurrency=1) outlast the batch's deadline (4 s x 2 waves + 1 s).
    relay = Relay(seaweedfs.port, hold=lambda line: 0.9 if "partNumber=" in line else 0.0)
    try:
        url = (f"s3://{s3_bucket}/{prefix}?endpoint={relay.endpoint}&part_size=5MiB&timeout=4&connect_timeout=1"
               "&concurrency=1&retries=0")  # fmt: skip
        backend = make_storage(url).backend
        body = _body(80 * MiB, seed=5)
        (result,) = backend.put_objects(["cut"], [[Span(0, len(body), memoryview(body))]])
        stats = backend.backend_stats()
        backend.close()
    finally:
        relay.close()
    assert isinstance(result, TimeoutError) and "not done within 9 s" in str(result), result
    lines = [h.split("\r\n", 1)[0] for h in relay.heads]
    assert any(line.startswith("POST") and "uploads" in line for line in lines), "no multipart upload was started"
    assert 1 <= sum("partNumber=" in line for line in lines) < 16, "the upload was not cut before its end"
    assert any(line.startswith("DELETE") and "uploadId=" in line for line in lines), "no AbortMultipartUpload"
    admin = _admin(seaweedfs.endpoint)
    assert _uploads(admin, s3_bucket, prefix) == [], "the cut upload's parts were left behind"
    assert "Contents" not in admin.list_objects_v2(Bucket=s3_bucket, Prefix=prefix), "a cut upload was completed"
    assert stats["multipart_aborted"] == 1 and stats["timeouts"] == 1


def test_a_failed_part_aborts_its_upload(seaweedfs, s3_bucket, s3_env):
    prefix = f"mp{uuid.uuid4().hex[:6]}"
    dropped = []

    def drop(line: str) -> bool:  # the second part's connection is cut before any answer: the part fails
        path = line.split(" ")[1]
        cut = "partNumber=2&" in path or path.endswith("partNumber=2")
        dropped.extend([line] if cut else [])
        return cut

    relay = Relay(seaweedfs.port, drop=drop)
    try:
        url = (f"s3://{s3_bucket}/{prefix}?endpoint={relay.endpoint}&part_size=5MiB&timeout=5"
               "&connect_timeout=1&concurrency=1&retries=0")  # fmt: skip
        backend = make_storage(url).backend
        body = _body(12 * MiB, seed=7)
        (result,) = backend.put_objects(["failed"], [[Span(0, len(body), memoryview(body))]])
        stats = backend.backend_stats()
        backend.close()
    finally:
        relay.close()
    assert isinstance(result, BaseException) and dropped, result
    lines = [h.split("\r\n", 1)[0] for h in relay.heads]
    assert any(line.startswith("DELETE") and "uploadId=" in line for line in lines), "no AbortMultipartUpload"
    admin = _admin(seaweedfs.endpoint)
    assert _uploads(admin, s3_bucket, prefix) == []
    assert "Contents" not in admin.list_objects_v2(Bucket=s3_bucket, Prefix=prefix)
    assert stats["multipart_aborted"] == 1


def _clocked(backend) -> dict[str, list]:
    """Wraps the uploader's real botocore client so each part request and abort notes when it was sent."""
    sent: dict[str, list] = {"parts": [], "aborts": []}
    uploader = backend._multipart
    make = uploader._make_client

    def make_clocked(threads: int):
        client = make(threads)
        if not hasattr(client, "_clocked"):
            upload_part, abort = client.upload_part, client.abort_multipart_upload

            def part(**kw):
                sent["parts"].append((time.monotonic(), kw["PartNumber"]))
                return upload_part(**kw)

            def abort_upload(**kw):
                sent["aborts"].append(time.monotonic())
                return abort(**kw)

            client.upload_part, client.abort_multipart_upload, client._clocked = part, abort_upload, True
        return client

    uploader._make_client = make_clocked
    return sent


def test_no_part_is_sent_after_a_failed_uploads_abort(seaweedfs, s3_bucket, s3_env):
    """One part at a time, the second one fails: the parts queued behind it are never sent, since a part
    landing after the abort makes the upload exist again on some servers."""
    prefix = f"mp{uuid.uuid4().hex[:6]}"

    def second(line: str) -> bool:
        path = line.split(" ")[1]
        return "partNumber=2&" in path or path.endswith("partNumber=2")

    relay = Relay(seaweedfs.port, drop=second)
    try:
        url = (f"s3://{s3_bucket}/{prefix}?endpoint={relay.endpoint}&part_size=5MiB&timeout=5"
               "&connect_timeout=1&concurrency=1&retries=0")  # fmt: skip
        backend = make_storage(url).backend
        sent = _clocked(backend)
        body = _body(25 * MiB, seed=11)
        (result,) = backend.put_objects(["queued"], [[Span(0, len(body), memoryview(body))]])
        time.sleep(1.0)  # a part sent late (the defect) would show here
        backend.close()
    finally:
        relay.close()
    assert isinstance(result, BaseException), result
    assert sent["aborts"], "no AbortMultipartUpload"
    late = [number for at, number in sent["parts"] if at >= sent["aborts"][0]]
    assert not late, f"parts {late} were sent after the abort had begun"
    assert 2 <= len(sent["parts"]) < 5, sent["parts"]
    admin = _admin(seaweedfs.endpoint)
    assert _uploads(admin, s3_bucket, prefix) == [], "the failed upload was left behind (or made again)"
    assert "Contents" not in admin.list_objects_v2(Bucket=s3_bucket, Prefix=prefix)
