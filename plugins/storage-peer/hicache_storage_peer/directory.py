"""The directory of who holds which page, in Redis: owners under a lease, page entries per owner.

* ``<prefix>owner:<owner id>``: a hash (``meta``: the owner's NIXL agent metadata, sealed with the
  cluster key where there is one, because over UCX/TCP whoever holds it can reach any address of the
  owner's process, registered or not (see docs/storage-peer.md); ``area``: where its
  publication area lies, how many page slots it has and how large each is; ``gens``: the address of
  the area's generation words; ``tag``: the record's MAC under the cluster key), with a TTL of one
  lease that the owner's heartbeat renews. A dead or paused owner's lease lapses, and readers then
  ignore every entry it published.
* ``<prefix>page:<full page key>``: a hash, one field per owner holding the page; the value is a
  packed :class:`Entry` (which slot of the owner's publication area holds the page, under which
  generation, the page's header, and the entry's MAC).

With the cluster key, every owner record and entry carries a tag (``ClusterKey.record_tag``) over its
fields, the owner's id, the directory prefix and, for an entry, the full page key: a record written
without the key, changed, or copied under another key or owner does not check, and a reader ignores it.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hicache_core.storage.backend import StorageError
from hicache_core.storage.page_auth import TAG_BYTES, ClusterKey
from hicache_core.storage.redis_keys import delete_under_prefix

_HEAD = struct.Struct("<BQQQH")  # flags, area slot, generation, payload bytes, header bytes
_KEYED = 1
_AREA = struct.Struct("<QQQ")  # area address, slots, bytes per slot

# Delete a field only if it still holds what this owner published: a later publish of the same key
# (in another slot) must not be removed by the unpublish of the earlier one.
_DELETE_IF_SAME = (
    "if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end return 0"
)


class BadRecord(ValueError):
    """A directory record that is malformed, or whose MAC does not check: ignored, as if absent."""


@dataclass(frozen=True)
class Entry:
    """Which slot of its owner's publication area holds one page, under which generation, and its header."""

    slot: int
    generation: int
    payload_bytes: int
    header: bytes

    def pack(self, tag: bytes | None = None) -> bytes:
        flags = _KEYED if tag is not None else 0
        head = _HEAD.pack(flags, self.slot, self.generation, self.payload_bytes, len(self.header))
        return head + self.header + (tag or b"")

    @classmethod
    def unpack(cls, raw: bytes) -> tuple[Entry, bytes | None]:
        """The entry and its tag (``None``: unkeyed). :raises BadRecord: malformed."""
        if len(raw) < _HEAD.size:
            raise BadRecord("directory entry shorter than its head")
        flags, slot, gen, payload, hlen = _HEAD.unpack_from(raw, 0)
        tag_len = TAG_BYTES if flags & _KEYED else 0
        if flags & ~_KEYED or len(raw) != _HEAD.size + hlen + tag_len:
            raise BadRecord("directory entry of the wrong length or flags")
        header = bytes(raw[_HEAD.size : _HEAD.size + hlen])
        return cls(slot, gen, payload, header), (bytes(raw[_HEAD.size + hlen :]) if tag_len else None)


@dataclass(frozen=True)
class Owner:
    """A live owner: its NIXL metadata, its publication area and the address of the area's generation words."""

    owner_id: str
    metadata: bytes
    area_addr: int
    slots: int
    slot_bytes: int
    gens_addr: int

    def slot_addr(self, slot: int) -> int:
        return self.area_addr + slot * self.slot_bytes

    def fields(self) -> tuple[bytes, bytes]:
        area = _AREA.pack(self.area_addr, self.slots, self.slot_bytes) + struct.pack("<Q", self.gens_addr)
        return self.metadata, area


class Directory:
    """The Redis side of the peer tier; every call is bounded by ``timeout`` and raises :class:`StorageError`.

    :param key: the cluster key: records are written with a tag and read only when it checks (``None``:
        untagged records, and untagged records only are read).
    :param tls: connect with TLS; ``tls_ca_file`` the CA that signed the server's certificate (default:
        the system's), ``tls_cert_file``/``tls_key_file`` a client certificate where the server asks one.
    """

    def __init__(self, host: str, port: int, db: int, *, prefix: str, timeout: float,
                 username: str | None = None, password: str | None = None, key: ClusterKey | None = None,
                 tls: bool = False, tls_ca_file: str | None = None, tls_cert_file: str | None = None,
                 tls_key_file: str | None = None) -> None:  # fmt: skip
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise StorageError("peer:// keeps its directory in Redis and needs redis-py: pip install redis") from exc
        self._redis = redis
        self.address = f"{'tls://' if tls else ''}{host}:{port}/{db}"
        self.prefix = prefix
        self.key = key
        ssl: dict[str, Any] = {}
        if tls:
            ssl = dict(ssl=True, ssl_cert_reqs="required", ssl_ca_certs=tls_ca_file, ssl_certfile=tls_cert_file,
                       ssl_keyfile=tls_key_file, ssl_check_hostname=True)  # fmt: skip
        # No retries: one call is bounded by one timeout (redis-py's default retries with backoff).
        self.client = redis.Redis(host=host, port=port, db=db, username=username, password=password,
                                  socket_timeout=timeout, socket_connect_timeout=timeout,
                                  retry=Retry(NoBackoff(), 0), retry_on_error=[], **ssl)  # fmt: skip
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

    # ---- tags ----------------------------------------------------------------------------------------

    def _owner_tag(self, owner_id: str, meta: bytes, area: bytes) -> bytes:
        return self.key.record_tag("peer owner", self.prefix, owner_id, meta, area)

    def entry_tag(self, key: str, owner_id: str, entry: Entry) -> bytes | None:
        """The tag an entry of ``owner_id`` for ``key`` carries (``None`` without a key)."""
        if self.key is None:
            return None
        return self.key.record_tag("peer entry", self.prefix, key, owner_id, entry.pack())

    def pack_entry(self, key: str, owner_id: str, entry: Entry) -> bytes:
        return entry.pack(self.entry_tag(key, owner_id, entry))

    def read_entry(self, key: str, owner_id: str, raw: bytes) -> Entry:
        """The entry ``raw`` holds, its tag checked. :raises BadRecord: malformed, untagged or a tag that fails."""
        entry, tag = Entry.unpack(raw)
        if self.key is None:
            if tag is not None:
                raise BadRecord("a keyed entry, and this instance has no cluster key")
            return entry
        if tag is None:
            raise BadRecord("an entry written without the cluster key")
        if not self.key.verify(tag, self.entry_tag(key, owner_id, entry)):
            raise BadRecord("an entry whose MAC does not check (changed, or copied from another key or owner)")
        return entry

    # ---- owners ----------------------------------------------------------------------------------

    def register_owner(self, owner: Owner, lease_ms: int) -> None:
        """Record the owner under a lease; with the key, its NIXL metadata sealed (only the cluster may load it)."""
        meta, area = owner.fields()
        if self.key is not None:
            meta = self.key.seal("peer owner metadata", meta, self.prefix, owner.owner_id, area)
        record = {"meta": meta, "area": area}
        if self.key is not None:
            record["tag"] = self._owner_tag(owner.owner_id, meta, area)

        def go() -> None:
            pipe = self.client.pipeline(transaction=True)
            k = self._owner_key(owner.owner_id)
            pipe.delete(k)
            pipe.hset(k, mapping=record)
            pipe.pexpire(k, lease_ms)
            pipe.execute()

        self._call("register an owner", go)

    def renew(self, owner_id: str, lease_ms: int) -> bool:
        """Extend the owner's lease; ``False`` when its record is gone (lapsed, or the server restarted)."""
        return bool(self._call("renew a lease", lambda: self.client.pexpire(self._owner_key(owner_id), lease_ms)))

    def owners(self, owner_ids: Iterable[str]) -> tuple[dict[str, Owner], set[str]]:
        """The live owners among ``owner_ids`` whose record checks, and those whose record does not."""
        ids = list(dict.fromkeys(owner_ids))
        if not ids:
            return {}, set()

        def go() -> list:
            pipe = self.client.pipeline(transaction=False)
            for o in ids:
                pipe.hmget(self._owner_key(o), "meta", "area", "tag")
            return pipe.execute()

        out, bad = {}, set()
        for o, (meta, area, tag) in zip(ids, self._call("look up owners", go)):
            if meta is None or area is None:
                continue
            try:
                out[o] = self._read_owner(o, bytes(meta), bytes(area), tag)
            except BadRecord:
                bad.add(o)
        return out, bad

    def _read_owner(self, owner_id: str, meta: bytes, area: bytes, tag: bytes | None) -> Owner:
        if self.key is not None:
            if tag is None or not self.key.verify(bytes(tag), self._owner_tag(owner_id, meta, area)):
                raise BadRecord(f"owner record of {owner_id} does not check under the cluster key")
        elif tag is not None:
            raise BadRecord(f"owner {owner_id} is keyed and this instance has no cluster key")
        if len(area) != _AREA.size + 8:
            raise BadRecord(f"owner record of {owner_id} is malformed")
        addr, slots, slot_bytes = _AREA.unpack_from(area, 0)
        (gens,) = struct.unpack_from("<Q", area, _AREA.size)
        if self.key is not None:
            opened = self.key.open("peer owner metadata", meta, self.prefix, owner_id, area)
            if opened is None:
                raise BadRecord(f"owner record of {owner_id}: its NIXL metadata does not open under the cluster key")
            meta = opened
        return Owner(owner_id, meta, addr, slots, slot_bytes, gens)

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

        return [{o.decode("utf-8", "replace"): bytes(v) for o, v in found.items()}
                for found in self._call("look up pages", go)]  # fmt: skip

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
