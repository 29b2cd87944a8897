"""``redis://host:port/db``: one Redis string per page, under ``<prefix><namespace>/<page hash>``.

* Writes are pipelined, and leave from host memory without a copy: each page is one
  ``SET`` whose value the RESP encoding sends as the header, then the page's runs, straight
  from the host pool's memoryviews (redis-py's ``send_packed_command`` takes a list of
  buffers). One ``SET`` per page keeps it atomic: a reader sees a whole page or none.
* Reads are pipelined ``GET``\\ s; redis-py hands back ``bytes`` (the one copy the client
  makes), which the core checks and copies into the pool.
* A refusal for memory (``OOM``, under ``maxmemory`` with ``noeviction``) reports the page
  ``full``; under an eviction policy the server's ``evicted_keys`` show in the stats.
* Every call has a socket timeout; after a server restart redis-py reconnects on the next call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from hicache_core.storage.backend import Capabilities, StorageBackend, StorageError, StorageFull
from hicache_core.storage.pages import Span
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
        "password": "AUTH password",
        "pipeline_bytes": "value bytes per pipeline (default 64MiB)",
    }

    def __init__(self, url: StorageURL, **options: Any) -> None:
        super().__init__(url, **options)
        try:
            import redis
        except ImportError as exc:
            raise StorageError("redis:// needs the redis package: pip install redis==8.1.0 hiredis==3.5.0") from exc
        self._redis = redis
        db = url.path.strip("/") or "0"
        if not db.isdigit():
            raise ValueError(f"redis:// takes a database number as its path (redis://host:port/0), got {url.path!r}")
        self.prefix = str(options.get("prefix", "hicache:"))
        self.timeout = option_float(options.get("timeout", 10.0), "timeout")
        self.pipeline_bytes = option_bytes(options.get("pipeline_bytes", PIPELINE_BYTES), "pipeline_bytes")
        self.address = f"{url.host or '127.0.0.1'}:{url.port or 6379}/{db}"
        self.client = redis.Redis(
            host=url.host or "127.0.0.1",
            port=url.port or 6379,
            db=int(db),
            password=options.get("password"),
            socket_timeout=self.timeout,
            socket_connect_timeout=self.timeout,
        )
        self._refused = 0

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

    def get_objects(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        per = max(1, self.pipeline_bytes // max(1, self.page_bytes if self._pages is not None else 1))
        for start in range(0, len(keys), per):
            pipe = self.client.pipeline(transaction=False)
            for k in keys[start : start + per]:
                pipe.get(self._k(k))
            out += pipe.execute()
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

    def remove_objects(self, keys: Sequence[str]) -> None:
        if keys:
            self.client.delete(*[self._k(k) for k in keys])

    def clear(self) -> None:
        batch = []
        for k in self.client.scan_iter(match=self.prefix.encode() + b"*", count=1000):
            batch.append(k)
            if len(batch) >= 1000:
                self.client.delete(*batch)
                batch = []
        if batch:
            self.client.delete(*batch)

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


def _total(spans: Sequence[Span]) -> int:
    return sum(s.nbytes for s in spans)
