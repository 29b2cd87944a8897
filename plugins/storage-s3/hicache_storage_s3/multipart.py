"""Multipart uploads that end completed or aborted, never as orphaned parts.

obstore starts and completes multipart uploads but never aborts one it was stopped in (a cancelled
upload's parts stay on the server, billed, until a lifecycle rule removes them), and it has no call to
abort or list them. An upload is therefore made here with botocore's S3 client (the AWS SDK, with the
same endpoint, region, credentials and timeouts as the backend's obstore client): every part in its
own request, and on any failure, and on cancellation at the batch's deadline, ``AbortMultipartUpload``.

A part that lands after an abort makes the upload exist again on some servers, so the abort comes last:
first no part request may start any more (each checks, in its thread, right before it is sent, under the
lock that stopping takes: a part queued behind the concurrency bound or behind the shared thread pool is
then never sent), then the part tasks are cancelled and the requests already sent are waited for (each
bounded by its timeout), and only then is the upload aborted; once more if a sent part outlived that wait.
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
        parts = _Parts()
        tasks: list[asyncio.Task] = []
        try:
            upload_id = (await asyncio.shield(create))["UploadId"]
            gate = asyncio.Semaphore(concurrency)

            async def part(number: int, start: int) -> dict[str, Any]:
                async with gate:
                    request = functools.partial(client.upload_part, Bucket=self.bucket, Key=key,
                                                UploadId=upload_id, PartNumber=number,
                                                Body=bytes(body[start : start + part_size]))  # fmt: skip
                    answer = await asyncio.shield(parts.submit(loop, self._pool, request))
                return {"ETag": answer["ETag"], "PartNumber": number}

            sizes = range(0, len(body), part_size)
            tasks = [asyncio.ensure_future(part(i + 1, off)) for i, off in enumerate(sizes)]
            done = await asyncio.gather(*tasks)
            await asyncio.shield(call(client.complete_multipart_upload, UploadId=upload_id,
                                      MultipartUpload={"Parts": list(done)}))  # fmt: skip
        except BaseException:
            # Before any await: gather leaves the other parts running after one fails, and a part waiting for
            # the gate or for a pool thread would otherwise be sent after the abort.
            sent = parts.stop()
            for t in tasks:
                t.cancel()
            # Shielded: a second cancellation (the batch giving up on its cleanup) must not stop the abort.
            await asyncio.shield(self._abort(client, key, create, tasks, sent))
            raise

    async def _abort(self, client: Any, key: str, create: asyncio.Future, tasks: list[asyncio.Task],
                     sent: list[asyncio.Future]) -> None:  # fmt: skip
        loop = asyncio.get_running_loop()
        bound = self.timeout + self.connect_timeout
        if tasks:
            await asyncio.wait(tasks, timeout=bound)
        try:
            # The create request may still be on its way: its upload is aborted as soon as it is known.
            created = await asyncio.wait_for(asyncio.shield(create), bound)
        except BaseException:  # noqa: BLE001 - no upload was made (or none can be known): nothing to abort
            return
        if sent:
            await asyncio.wait(sent, timeout=bound)
        abort = functools.partial(client.abort_multipart_upload, Bucket=self.bucket, Key=key,
                                  UploadId=created["UploadId"])  # fmt: skip
        attempts = [loop.run_in_executor(self._pool, abort)]
        attempts[0].add_done_callback(_retrieved)
        await asyncio.wait(attempts, timeout=bound)
        late = [p for p in sent if not p.done()]
        if late:  # a part past its own timeout (a stuck thread) may still land: abort again once it has ended
            await asyncio.wait(late, timeout=bound)
            attempts.append(loop.run_in_executor(self._pool, abort))
            attempts[1].add_done_callback(_retrieved)  # NoSuchUpload when the first abort took it all: fine
            await asyncio.wait(attempts[1:], timeout=bound)
        if any(a.done() and not a.cancelled() and a.exception() is None for a in attempts):
            self.aborted += 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._client is not None:
            self._client.close()


class _NotSent(Exception):
    """A part request that found its upload stopped when its turn came: it was never sent."""


class _Parts:
    """One upload's part requests, and the point after which none of them is sent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stopped = False
        self._sent: list[list[asyncio.Future]] = []

    def submit(self, loop: asyncio.AbstractEventLoop, pool: concurrent.futures.Executor | None,
               request: Callable[[], Any]) -> asyncio.Future:  # fmt: skip
        slot: list[asyncio.Future] = []  # filled on the loop before stop() (also on the loop) can read it

        def send() -> Any:
            with self._lock:
                if self._stopped:
                    raise _NotSent
                self._sent.append(slot)
            return request()

        fut = loop.run_in_executor(pool, send)
        fut.add_done_callback(_retrieved)  # a request outlived by its upload must not log "never retrieved"
        slot.append(fut)
        return fut

    def stop(self) -> list[asyncio.Future]:
        """No part request is sent from now on; those already sent and not yet answered."""
        with self._lock:
            self._stopped = True
            sent = [slot[0] for slot in self._sent]
        return [f for f in sent if not f.done()]


def _retrieved(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()
