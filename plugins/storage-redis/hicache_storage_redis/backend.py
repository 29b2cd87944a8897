"""``redis://host:port/db``: one Redis string per page, under ``<prefix><namespace>/<page hash>``.

* Writes are pipelined, and leave from host memory without a copy: each page is one
  ``SET`` whose value the RESP encoding sends as the header, then the page's runs, straight
  from the host pool's memoryviews (redis-py's ``send_packed_command`` takes a list of
  buffers). One ``SET`` per page keeps it atomic: a reader sees a whole page or none.
* Reads are pipelined ``GET``\\ s; redis-py hands back ``bytes`` (the one copy the client
  makes), which the core checks and copies into the pool.
* A refusal for memory (``OOM``, under ``maxmemory`` with ``noeviction``) reports the page
  ``full``; under an eviction policy the server's ``evicted_keys`` show in the stats.
* Every call is bounded by ``timeout``: redis-py's own retries are off (its default retries a
  timed-out call with backoff, which took about two minutes against a hung server), so a call
  against a paused or hung server raises within about ``timeout`` and the page reports why.
  After a server restart redis-py reconnects on the next call.
* ``rediss://`` is Redis over TLS (``?ca=`` the CA file, ``?cert=``/``?key=`` a client certificate).
* Credentials: ``redis://user:password@host`` or ``redis://:password@host`` (or ``?password=``);
  they are never printed (``StorageURL.redacted``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

from hicache_core.storage.backend import Capabilities, NotAPage, StorageBackend, StorageError, StorageFull
from hicache_core.storage.pages import Span
from hicache_core.storage.redis_keys import delete_under_prefix
from hicache_core.storage.url import StorageURL, option_bytes, option_float

#: Bytes of values one pipeline carries at most (bounds the memory of a batch of large pages).
PIPELINE_BYTES = 64 << 20


class RedisStorage(StorageBackend):
    """Pages as Redis strings (works with Valkey too)."""

    scheme: ClassVar[str] = "redis"
    capabilities: ClassVar[Capabilities] = Capabilities(zero_copy=False, durable=False, shared=True)
    description: ClassVar[str] = "Redis/Valkey strings via redis-py: pipelined, zero-copy sends, one SET per page"
    options_help: ClassVar[dict[str, str]] = {
        "prefix": "key prefix (default 'hicache:')",
        "timeout": "socket timeout in seconds for every call (default 10)",
        "password": "AUTH password (or in the URL's user-info: redis://:password@host)",
        "username": "ACL user name (or in the URL's user-info: redis://user:password@host)",
        "pipeline_bytes": "value bytes per pipeline (default 64MiB)",
        "ca": "rediss:// only: the CA certificate file the server's certificate is checked against",
        "cert": "rediss:// only: a client certificate file (mutual TLS)",
        "key": "rediss:// only: the client certificate's private key file",
        "check_hostname": "rediss:// only: check the certificate names the host (default 1)",
    }
    server_hint: ClassVar[str] = (
        "start a server with: redis-server --port PORT --bind 127.0.0.1 (Debian: apt-get install redis-server)"
    )

    def __init__(self, url: StorageURL, **options: Any) -> None:
        super().__init__(url, **options)
        # Options first: a bad value is the caller's error whether or not the client is installed.
        db = url.path.strip("/") or "0"
        if not db.isdigit():
            raise ValueError(f"redis:// takes a database number as its path (redis://host:port/0), got {url.path!r}")
        self.prefix = str(options.get("prefix", "hicache:"))
        self.timeout = option_float(options.get("timeout", 10.0), "timeout")
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            raise ValueError(f"option timeout={options.get('timeout')!r} must be a positive number of seconds")
        try:
            import redis
        except ImportError as exc:
            raise StorageError("redis:// needs the redis package: pip install redis==8.1.0 hiredis==3.5.0") from exc
        self._redis = redis
        self.pipeline_bytes = option_bytes(options.get("pipeline_bytes", PIPELINE_BYTES), "pipeline_bytes")
        if self.pipeline_bytes < 1:
            raise ValueError("option pipeline_bytes must be at least 1 byte")
        tls = url.scheme == "rediss"
        tls_options = {"ca", "cert", "key", "check_hostname"} & set(options)
        if tls_options and not tls:
            raise ValueError(f"option(s) {', '.join(sorted(tls_options))} need rediss:// (Redis over TLS)")
        self.address = f"{url.host or '127.0.0.1'}:{url.port or 6379}/{db}"
        password = options.get("password", url.password)
        username = options.get("username", url.username)
        extra: dict[str, Any] = {}
        if tls:
            from hicache_core.storage.url import option_bool

            check = option_bool(options.get("check_hostname", True), "check_hostname")
            extra = dict(ssl=True, ssl_ca_certs=options.get("ca"), ssl_certfile=options.get("cert"),
                         ssl_keyfile=options.get("key"), ssl_check_hostname=check)  # fmt: skip
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.client = redis.Redis(
            host=url.host or "127.0.0.1",
            port=url.port or 6379,
            db=int(db),
            username=username or None,
            password=password or None,
            socket_timeout=self.timeout,
            socket_connect_timeout=self.timeout,
            # No retries: a call is bounded by one timeout (the default retried with backoff for ~2 minutes).
            retry=Retry(NoBackoff(), 0),
            retry_on_error=[],
            **extra,
        )
        self._refused = 0

    def ping(self) -> None:
        try:
            self.client.ping()
        except self._redis.AuthenticationError as exc:
            raise StorageError(f"redis {self.address}: authentication failed ({exc})") from None
        except (self._redis.ConnectionError, self._redis.TimeoutError, OSError) as exc:
            raise StorageError(f"redis {self.address} is not reachable ({exc}); {self.server_hint}") from None

    def _k(self, key: str) -> bytes:
        return (self.prefix + key).encode()

    # ---- primitives ----------------------------------------------------------------------------

    def exists_objects(self, keys: Sequence[str]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(self._k(k))
        return [bool(n) for n in pipe.execute()]

    def put_objects(self, keys: Sequence[str], values: Sequence[Sequence[Span]]) -> list[BaseException | None]:
        out: list[BaseException | None] = []
        start = 0
        while start < len(keys):
            end, size = start, 0
            while end < len(keys) and (end == start or size + _total(values[end]) <= self.pipeline_bytes):
                size += _total(values[end])
                end += 1
            out += self._set_many(keys[start:end], values[start:end])
            start = end
        return out

    def _set_many(self, keys: Sequence[str], values: Sequence[Sequence[Span]]) -> list[BaseException | None]:
        chunks: list[bytes | memoryview] = []
        for key, spans in zip(keys, values):
            k = self._k(key)
            chunks.append(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k, _total(spans)))
            chunks += [s.view for s in spans]
            chunks.append(b"\r\n")
        conn = self.client.connection_pool.get_connection()
        out: list[BaseException | None] = []
        try:
            conn.send_packed_command(chunks)
            for _ in keys:
                try:
                    conn.read_response()
                    out.append(None)
                except self._redis.ResponseError as exc:
                    if "OOM" in str(exc) or "maxmemory" in str(exc):
                        self._refused += 1
                        out.append(StorageFull(f"redis {self.address}: {exc}"))
                    else:
                        out.append(exc)
        except BaseException:
            conn.disconnect()  # replies may be half read: never reuse this connection
            raise
        finally:
            self.client.connection_pool.release(conn)
        return out

    def get_objects(self, keys: Sequence[str]) -> list[bytes | BaseException | None]:
        out: list[bytes | BaseException | None] = []
        per = max(1, self.pipeline_bytes // max(1, self.page_bytes or 1))
        for start in range(0, len(keys), per):
            pipe = self.client.pipeline(transaction=False)
            for k in keys[start : start + per]:
                pipe.get(self._k(k))
            # A reply error (a key holding a list, a hash, ...) fails only its own key, not the batch.
            for value in pipe.execute(raise_on_error=False):
                if isinstance(value, self._redis.ResponseError):
                    wrong = "WRONGTYPE" in str(value)
                    out.append(NotAPage(f"redis value is not a hicache page ({value})") if wrong else value)
                else:
                    out.append(value)
        return out

    def raw_put_from(self, keys: Sequence[str], spans: Sequence[Span]) -> None:
        per = max(1, self.pipeline_bytes // max(1, spans[0].nbytes)) if spans else 1
        for start in range(0, len(keys), per):
            pipe = self.client.pipeline(transaction=False)
            for key, span in zip(keys[start : start + per], spans[start : start + per]):
                pipe.set(self._k(key), span.view)
            pipe.execute()

    def raw_get_into(self, keys: Sequence[str], spans: Sequence[Span]) -> None:
        per = max(1, self.pipeline_bytes // max(1, spans[0].nbytes)) if spans else 1
        for start in range(0, len(keys), per):
            pipe = self.client.pipeline(transaction=False)
            for key in keys[start : start + per]:
                pipe.get(self._k(key))
            for value, span in zip(pipe.execute(), spans[start : start + per]):
                span.view[:] = value  # the raw client's bytes land in the same buffer, as the tier's do

    def attach_leases(self, book: Any) -> str:
        # Redis evicts by its own LRU or LFU (maxmemory-policy allkeys-*): a TOUCH counts as an access for both,
        # so protected pages touched every few seconds stay ahead of ordinary ones. Its volatile-* policies evict
        # only keys with an expiry, which hicache never sets: nothing of hicache's is evicted there.
        return "touched"

    def touch_objects(self, keys: Sequence[str]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.touch(self._k(k))
        return [bool(n) for n in pipe.execute()]

    def remove_objects(self, keys: Sequence[str]) -> None:
        if keys:
            self.client.delete(*[self._k(k) for k in keys])

    def clear(self) -> None:
        """Delete every key under this backend's prefix (the prefix is matched literally, never as a glob)."""
        delete_under_prefix(self.client, self.prefix)

    def close(self) -> None:
        self.client.close()

    def backend_stats(self) -> dict[str, Any]:
        info = self.client.info()
        return {
            "server": self.address,
            "redis_version": info.get("redis_version"),
            "used_memory": info.get("used_memory"),
            "maxmemory": info.get("maxmemory"),
            "maxmemory_policy": info.get("maxmemory_policy"),
            "evicted_keys": info.get("evicted_keys"),
            "keys": self.client.dbsize(),
            "refused_full": self._refused,
        }


class RedisTLSStorage(RedisStorage):
    """Pages as Redis strings over TLS (``rediss://``; ``?ca=``, ``?cert=``, ``?key=``)."""

    scheme: ClassVar[str] = "rediss"
    description: ClassVar[str] = "Redis/Valkey over TLS via redis-py: as redis://, on an encrypted connection"




def _total(spans: Sequence[Span]) -> int:
    return sum(s.nbytes for s in spans)
