"""Multipart uploads that end completed or aborted, never as orphaned parts.

obstore starts and completes multipart uploads but never aborts one it was stopped in (a cancelled
upload's parts stay on the server, billed, until a lifecycle rule removes them), and it has no call to
abort or list them. An upload is therefore made here with botocore's S3 client (the AWS SDK, with the
same endpoint, region, credentials and timeouts as the backend's obstore client): every part in its
own request, and on any failure, and on cancellation at the batch's deadline,
``AbortMultipartUpload``, once at once and once more after the parts still in flight have ended (a
part that lands after an abort makes the upload exist again on some servers).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Callable
from typing import Any

from .credentials import Settings


class MultipartUploader:
    """Uploads objects in parts through botocore, aborting every upload that does not complete."""

    def __init__(self, settings: Settings, bucket: str, *, timeout: float, connect_timeout: float,
                 ca: str | None) -> None:  # fmt: skip
        self.settings = settings
        self.bucket = bucket
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.ca = ca
        self._client: Any = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.aborted = 0

    def _make_client(self, threads: int) -> Any:
        with self._lock:
            if self._client is not None:
                return self._client
            try:
                import botocore.session
                from botocore import UNSIGNED
                from botocore.config import Config
            except ImportError as exc:
                raise RuntimeError("s3:// multipart uploads need botocore: pip install botocore==1.44.18") from exc
            kwargs: dict[str, Any] = {}
            config = {"s3": {"addressing_style": "path"}, "connect_timeout": self.connect_timeout,
                      "read_timeout": self.timeout, "retries": {"total_max_attempts": 1},
                      "max_pool_connections": threads}  # fmt: skip
            creds = self.settings.credentials
            session = self.settings.session or botocore.session.Session()
            if creds is None:
                config["signature_version"] = UNSIGNED
            elif self.settings.session is None:  # the URL's fixed parts (a chain's session signs by itself)
                key_id, secret, token = creds.current()
                kwargs.update(aws_access_key_id=key_id, aws_secret_access_key=secret, aws_session_token=token)
            self._client = session.create_client("s3", region_name=self.settings.region,
                                                 endpoint_url=self.settings.endpoint, verify=self.ca,
                                                 config=Config(**config), **kwargs)  # fmt: skip
            self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="hicache-s3-parts")
            return self._client

    async def upload(self, key: str, body: memoryview, part_size: int, concurrency: int) -> None:
        """Upload ``body`` under ``key`` in parts of ``part_size``; on failure or cancellation, abort it."""
        loop = asyncio.get_running_loop()
        client = await loop.run_in_executor(None, self._make_client, max(2, concurrency))

        def call(fn: Callable[..., Any], **kw: Any) -> asyncio.Future:
            fut = loop.run_in_executor(self._pool, functools.partial(fn, Bucket=self.bucket, Key=key, **kw))
            fut.add_done_callback(_retrieved)  # a request outlived by its upload must not log "never retrieved"
            return fut

        create = call(client.create_multipart_upload)
        parts: list[asyncio.Future] = []
        try:
            upload_id = (await asyncio.shield(create))["UploadId"]
            gate = asyncio.Semaphore(concurrency)

            async def part(number: int, start: int) -> dict[str, Any]:
                async with gate:
                    fut = call(client.upload_part, UploadId=upload_id, PartNumber=number,
                               Body=bytes(body[start : start + part_size]))  # fmt: skip
                    parts.append(fut)
                    answer = await asyncio.shield(fut)
                return {"ETag": answer["ETag"], "PartNumber": number}

            done = await asyncio.gather(*[part(i + 1, off) for i, off in enumerate(range(0, len(body), part_size))])
            await asyncio.shield(call(client.complete_multipart_upload, UploadId=upload_id,
                                      MultipartUpload={"Parts": list(done)}))  # fmt: skip
        except BaseException:
            # Shielded: a second cancellation (the batch giving up on its cleanup) must not stop the abort.
            await asyncio.shield(self._abort(client, key, create, parts))
            raise

    async def _abort(self, client: Any, key: str, create: asyncio.Future, parts: list[asyncio.Future]) -> None:
        loop = asyncio.get_running_loop()
        try:
            # The create request may still be on its way: its upload is aborted as soon as it is known.
            created = await asyncio.wait_for(asyncio.shield(create), self.timeout + self.connect_timeout)
        except BaseException:  # noqa: BLE001 - no upload was made (or none can be known): nothing to abort
            return
        abort = functools.partial(client.abort_multipart_upload, Bucket=self.bucket, Key=key,
                                  UploadId=created["UploadId"])  # fmt: skip
        first = loop.run_in_executor(self._pool, abort)
        first.add_done_callback(_retrieved)
        await asyncio.wait([first], timeout=self.timeout + self.connect_timeout)
        in_flight = [p for p in parts if not p.done()]
        if in_flight:
            await asyncio.wait(in_flight, timeout=self.timeout + self.connect_timeout)
            again = loop.run_in_executor(self._pool, abort)
            again.add_done_callback(_retrieved)  # NoSuchUpload when the first abort took it all: fine
            await asyncio.wait([again], timeout=self.timeout + self.connect_timeout)
        if first.done() and first.exception() is None:
            self.aborted += 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._client is not None:
            self._client.close()


def _retrieved(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()
