"""The directory of who holds which page, in Redis: owners under a lease, page entries per owner.

* ``<prefix>owner:<owner id>``: a hash (``meta``: the owner's NIXL agent metadata, ``gens``: the
  address of its generation words), with a TTL of one lease that the owner's heartbeat renews.
  A dead or paused owner's lease lapses, and readers then ignore every entry it published.
* ``<prefix>page:<full page key>``: a hash, one field per owner holding the page; the value is a
  packed :class:`Entry` (where the page lives in the owner's host pool, its generation, its header).
  Fields of owners without a lease are ignored and deleted by the reader that finds them.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hicache_core.storage.backend import StorageError
from hicache_core.storage.redis_keys import delete_under_prefix

_HEAD = struct.Struct("<IQQH")  # generation slot, generation, header bytes, number of runs
_RUN = struct.Struct("<QQ")  # address, nbytes

# Delete a field only if it still holds what this owner published: a later publish of the same key
# (after a free, in another slot) must not be removed by the unpublish of the earlier one.
_DELETE_IF_SAME = (
    "if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end return 0"
)


@dataclass(frozen=True)
class Entry:
    """Where one page lives in its owner's host pool, under which generation, and its stored header."""

    gen_slot: int
    generation: int
    header: bytes
    runs: tuple[tuple[int, int], ...]

    @property
    def payload_bytes(self) -> int:
        return sum(n for _, n in self.runs)

    def pack(self) -> bytes:
        out = [_HEAD.pack(self.gen_slot, self.generation, len(self.header), len(self.runs)), self.header]
        out += [_RUN.pack(p, n) for p, n in self.runs]
        return b"".join(out)

    @classmethod
    def unpack(cls, raw: bytes) -> Entry:
        slot, gen, hlen, nruns = _HEAD.unpack_from(raw, 0)
        at = _HEAD.size
        header = bytes(raw[at : at + hlen])
        at += hlen
        runs = tuple(_RUN.unpack_from(raw, at + i * _RUN.size) for i in range(nruns))
        if at + nruns * _RUN.size != len(raw):
            raise ValueError("directory entry has trailing bytes")
        return cls(slot, gen, header, runs)


@dataclass(frozen=True)
class Owner:
    """A live owner: its NIXL metadata and the address of its generation words."""

    owner_id: str
    metadata: bytes
    gens_addr: int


class Directory:
    """The Redis side of the peer tier; every call is bounded by ``timeout`` and raises :class:`StorageError`."""

    def __init__(self, host: str, port: int, db: int, *, prefix: str, timeout: float,
                 username: str | None = None, password: str | None = None) -> None:  # fmt: skip
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise StorageError("peer:// keeps its directory in Redis and needs redis-py: pip install redis") from exc
        self._redis = redis
        self.address = f"{host}:{port}/{db}"
        self.prefix = prefix
        # No retries: one call is bounded by one timeout (redis-py's default retries with backoff).
        self.client = redis.Redis(host=host, port=port, db=db, username=username, password=password,
                                  socket_timeout=timeout, socket_connect_timeout=timeout,
                                  retry=Retry(NoBackoff(), 0), retry_on_error=[])  # fmt: skip
        self._delete_if_same = self.client.register_script(_DELETE_IF_SAME)

    def _call(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except (self._redis.RedisError, OSError) as exc:
            detail = f"{type(exc).__name__}: {exc}"
            raise StorageError(f"peer:// directory {self.address} failed to {what} ({detail})") from None

    def _owner_key(self, owner_id: str) -> str:
        return f"{self.prefix}owner:{owner_id}"

    def _page_key(self, key: str) -> str:
        return f"{self.prefix}page:{key}"

    def ping(self) -> None:
        self._call("answer PING", self.client.ping)

    # ---- owners ----------------------------------------------------------------------------------

    def register_owner(self, owner: Owner, lease_ms: int) -> None:
        def go() -> None:
            pipe = self.client.pipeline(transaction=True)
            k = self._owner_key(owner.owner_id)
            pipe.hset(k, mapping={"meta": owner.metadata, "gens": str(owner.gens_addr)})
            pipe.pexpire(k, lease_ms)
            pipe.execute()

        self._call("register an owner", go)

    def renew(self, owner_id: str, lease_ms: int) -> bool:
        """Extend the owner's lease; ``False`` when its record is gone (lapsed, or the server restarted)."""
        return bool(self._call("renew a lease", lambda: self.client.pexpire(self._owner_key(owner_id), lease_ms)))

    def owners(self, owner_ids: Iterable[str]) -> dict[str, Owner]:
        """The live owners among ``owner_ids`` (those whose lease has not lapsed)."""
        ids = list(dict.fromkeys(owner_ids))
        if not ids:
            return {}

        def go() -> list:
            pipe = self.client.pipeline(transaction=False)
            for o in ids:
                pipe.hmget(self._owner_key(o), "meta", "gens")
            return pipe.execute()

        out = {}
        for o, (meta, gens) in zip(ids, self._call("look up owners", go)):
            if meta is not None and gens is not None:
                out[o] = Owner(o, bytes(meta), int(gens))
        return out

    def drop_owner(self, owner_id: str) -> None:
        self._call("drop an owner", lambda: self.client.delete(self._owner_key(owner_id)))

    # ---- pages -------------------------------------------------------------------------------------

    def publish(self, owner_id: str, entries: Sequence[tuple[str, bytes]], ttl_s: int) -> None:
        """Record ``(full key, packed entry)`` pairs for ``owner_id``; a page hash lives ``ttl_s`` unrefreshed."""

        def go() -> None:
            pipe = self.client.pipeline(transaction=False)
            for key, packed in entries:
                pipe.hset(self._page_key(key), owner_id, packed)
                pipe.expire(self._page_key(key), ttl_s)
            pipe.execute()

        if entries:
            self._call("publish pages", go)

    def unpublish(self, owner_id: str, entries: Sequence[tuple[str, bytes]]) -> None:
        """Delete this owner's fields that still hold exactly the given packed entries."""

        def go() -> None:
            pipe = self.client.pipeline(transaction=False)
            for key, packed in entries:
                self._delete_if_same(keys=[self._page_key(key)], args=[owner_id, packed], client=pipe)
            pipe.execute()

        if entries:
            self._call("unpublish pages", go)

    def holders(self, keys: Sequence[str]) -> list[dict[str, bytes]]:
        """For each full key, ``{owner id: packed entry}`` of every owner that published it."""

        def go() -> list:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.hgetall(self._page_key(k))
            return pipe.execute()

        return [{o.decode(): bytes(v) for o, v in found.items()} for found in self._call("look up pages", go)]

    def forget(self, dead: Sequence[tuple[str, str]]) -> None:
        """Delete ``(full key, owner id)`` fields of owners whose lease lapsed."""

        def go() -> None:
            pipe = self.client.pipeline(transaction=False)
            for key, owner_id in dead:
                pipe.hdel(self._page_key(key), owner_id)
            pipe.execute()

        if dead:
            self._call("delete expired entries", go)

    def clear(self) -> None:
        """Delete every directory key under the prefix (the prefix matched literally)."""
        def go() -> None:
            delete_under_prefix(self.client, self.prefix)

        self._call("clear", go)

    def close(self) -> None:
        self.client.close()
