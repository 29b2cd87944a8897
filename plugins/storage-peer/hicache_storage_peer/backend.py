"""``peer://host:port/db``: pages read from other instances' publication areas through NIXL.

The URL names the Redis server that keeps the directory (``directory.py``). An instance is both:

* **owner**: a page "written" to this tier is copied into the owner's *publication area*, a bounded
  buffer (``publish_bytes``) that is the only memory of the process registered with NIXL, beside
  the area's generation words. The host pool and its checksum table are never registered: a remote
  agent reaches published pages and nothing else. The directory entry says which slot of the area
  holds the page, under which generation, with the page's header (checksum, and with the cluster key
  the page's MAC) and the entry's own MAC. A full area evicts its oldest page: the slot's generation
  word moves first, then the entry is unpublished in the background. The owner never reads the area
  back nor its public generation words (it keeps its own), so nothing a remote agent writes there
  changes what the owner serves or publishes; at most readers miss. A heartbeat renews the owner's
  lease and republishes everything when the directory lost it (a restarted server).
* **reader**: ``get_objects_into`` finds a live owner whose record and entry check, reads the pages
  into a registered staging buffer with one NIXL READ per owner and batch, then reads the slots'
  generation words; a page whose generation moved is a miss (evicted, maybe overwritten, during the
  read) and is not copied; the others are copied into the host pool. The core then checks the header,
  the payload checksum and (with the cluster key) the page's MAC as for any L3 page.

Reads go through an agent of their own (the reader agent), never registered in the directory. Every
read has a deadline (``timeout``): a paused or dead owner makes its pages ``timeout`` or ``error``,
and its pages fail at once, without a read, for ``2 * timeout`` after that. A late byte of an
abandoned read could still land in its staging buffer, so that buffer is set aside (retired): it
is reused only ``timeout`` after a later read from the same owner succeeded (the owner answers
again, its old replies are through), and released at ``close`` once the reader agent is gone.
The reader agent is not closed earlier: closing it with a cancelled read outstanding makes a
paused owner abort when it resumes (UCX "Endpoint timeout", nixl-cu13 1.5.1, seen here).

Binding to a host pool without the cluster key is refused unless the URL says ``insecure=1``: unkeyed,
the owners' NIXL metadata lies in the directory in clear and nothing a directory writer adds is checked.
"""

from __future__ import annotations

import ctypes
import math
import os
import queue
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from hicache_core.host_memory import host_tensor
from hicache_core.retention import LeaseBook, eviction_walk
from hicache_core.storage.backend import Capabilities, ObjectMissing, SizeMismatch, StorageBackend, StorageError
from hicache_core.storage.pages import Span
from hicache_core.storage.url import StorageURL, option_bool, option_bytes, option_float

from .agent import PeerAgent, TransferFailed
from .directory import BadRecord, Directory, Entry, Owner

#: A page hash left unrefreshed this long disappears from the directory (bounds what dead owners leave).
PAGE_TTL_S = 3600
#: Generation words one reader batch reads at most (larger batches go in groups).
_SCRATCH_WORDS = 4096
#: Each slot of the publication area starts on a cache line.
_SLOT_ALIGN = 64
_DEFAULT_PUBLISH_BYTES = 256 << 20


class StaleGeneration(ObjectMissing):
    """The owner evicted the page from its publication area before the read finished: the bytes are not used."""


class PeerStorage(StorageBackend):
    """The peer tier: other instances' publication areas, read through NIXL, found through a Redis directory."""

    scheme: ClassVar[str] = "peer"
    # A page is read from its owner's publication area by other instances, never by the owner itself.
    capabilities: ClassVar[Capabilities] = Capabilities(zero_copy=True, durable=False, shared=True,
                                                        reads_own_writes=False)  # fmt: skip
    description: ClassVar[str] = "other instances' published pages over NIXL (UCX), directory in Redis with leases"
    # One NIXL READ per owner and group: larger groups spend fewer round trips per byte.
    io_chunk_bytes: ClassVar[int] = 64 << 20
    options_help: ClassVar[dict[str, str]] = {
        "prefix": "directory key prefix (default 'hicache-peer:')",
        "lease": "seconds an owner's entries stay valid without a heartbeat (default 10)",
        "timeout": "seconds a directory call or a NIXL read may take (default 5)",
        "serve": "publish this instance's pages for others (default 1; 0: read only)",
        "publish_bytes": "size of the publication area, the only memory others reach (default 256MiB; "
        "the oldest page is unpublished when full)",
        "password": "Redis AUTH password of the directory (required unless insecure=1 or insecure_directory=1)",
        "username": "Redis ACL user of the directory",
        "insecure": "1: a trusted test setup: no cluster key (and no directory password) required",
        "insecure_directory": "1: a trusted test setup, a directory without a password is accepted",
        "tls": "1: TLS to the directory (redis-server --tls-port)",
        "tls_ca_file": "the CA file that signed the directory's certificate (default: the system's CAs)",
        "tls_cert_file": "client certificate for the directory (where it asks one)",
        "tls_key_file": "the client certificate's private key",
    }
    server_hint: ClassVar[str] = (
        "the directory is a Redis server: redis-server --port PORT --bind 127.0.0.1 --requirepass ... "
        "(Debian: apt-get install redis-server)"
    )

    def __init__(self, url: StorageURL, **options: Any) -> None:
        super().__init__(url, **options)
        db = url.path.strip("/") or "0"
        if not db.isdigit():
            raise ValueError(f"peer:// takes the directory's Redis database number as its path, got {url.path!r}")
        self.lease = option_float(options.get("lease", 10.0), "lease")
        self.timeout = option_float(options.get("timeout", 5.0), "timeout")
        for name, value in (("lease", self.lease), ("timeout", self.timeout)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"option {name}={options.get(name)!r} must be a positive number of seconds")
        self.serve = option_bool(options.get("serve", True), "serve")
        self.publish_bytes = option_bytes(options.get("publish_bytes", _DEFAULT_PUBLISH_BYTES), "publish_bytes")
        #: A trusted test setup: bound without a cluster key (see register_memory), a directory without a password.
        self.insecure = option_bool(options.get("insecure", False), "insecure")
        insecure_directory = option_bool(options.get("insecure_directory", False), "insecure_directory")
        tls = option_bool(options.get("tls", False), "tls")
        password = options.get("password", url.password) or None
        host, port = url.host or "127.0.0.1", url.port or 6379
        if password is None and not (self.insecure or insecure_directory):
            raise ValueError(
                f"peer:// directory {host}:{port}/{db} has no password: whoever reaches it could rewrite "
                "the directory and read every owner's NIXL address; give the Redis password (password= or "
                "peer://:PASSWORD@host:port/db), or insecure=1 (no cluster key either) or "
                "insecure_directory=1 for a trusted test setup"
            )
        tls_files = {k: options.get(k) for k in ("tls_ca_file", "tls_cert_file", "tls_key_file")}
        for name, path in tls_files.items():
            if path and not tls:
                raise ValueError(f"option {name} needs tls=1")
            if path and not os.path.isfile(path):
                raise ValueError(f"option {name}={path!r}: no such file")
        self.owner_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        #: The tier's store in KV events (hicache_core.events.tiers): this owner's publication area, which other
        #: instances load from and which leaves with this process.
        self.event_store_id = f"peer://{self.owner_id}"
        self.directory = Directory(host, port, int(db), prefix=str(options.get("prefix", "hicache-peer:")),
                                   timeout=self.timeout, username=options.get("username", url.username) or None,
                                   password=password, tls=tls, **tls_files)  # fmt: skip
        # Owner state.
        self._agent: PeerAgent | None = None  # the owner's agent: the publication area and its words only
        self._lock = threading.Lock()
        self._area: torch.Tensor | None = None
        self._gens_public: torch.Tensor | None = None  # what readers read; never read here
        self._gens: list[int] = []  # this owner's own generations, the ones it trusts
        self.slot_bytes = 0
        self.slots = 0
        self._free: list[int] = []
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # published key -> slot, oldest first
        self._published: dict[str, bytes] = {}  # published key -> packed entry
        self._book: LeaseBook | None = None  # the area's leases (attach_leases), ordering its evictions
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        # Reader state.
        self._reader: PeerAgent | None = None
        self._readers_made = 0
        self._reader_lock = threading.Lock()  # the reader agent and its staging buffers; never held while waiting
        self._staging_free: list[torch.Tensor] = []
        self._retired: list[list[Any]] = []  # [owner id, buffer, reusable from (monotonic) or None]
        self._suspended: dict[str, float] = {}  # owner id -> monotonic time its pages are read again
        self._in_flight = 0
        self._stage_bytes = self.io_chunk_bytes
        self._gone_agents = dict(transfers=0, transfer_timeouts=0, transfer_errors=0)  # closed reader agents' counts
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.counters = dict(published=0, unpublished=0, unpublish_failed=0, evicted=0, stale_reads=0,
                             expired_entries=0, bad_entries=0, bad_owner_records=0, lease_renewals=0,
                             lease_lost=0, republished=0, heartbeat_failed=0, retired_staging_bytes=0,
                             reclaimed_staging_bytes=0, suspended_reads=0)  # fmt: skip

    # ---- binding: the publication area, the directory ----------------------------------------------

    def register_memory(self, spans: Sequence[Span]) -> None:
        """Make the publication area and join the directory; the host pool's buffers are not registered.

        :raises ValueError: no cluster key and no ``insecure=1``, before anything is made or published.
        """
        if self.cluster_key is None and not self.insecure:
            # Unkeyed, the owner's NIXL metadata goes into the directory in clear and entries carry no MAC:
            # any writer of the directory reaches the owner's memory and makes readers load what it forged.
            raise ValueError(
                f"peer:// directory {self.directory.address} needs the cluster key: without it every owner's "
                "NIXL metadata is published in clear and any writer of the directory can forge pages that load; "
                "set HICACHE_L3_KEY_FILE (or HICACHE_L3_KEY) on every instance, or insecure=1 in the URL for a "
                "trusted test setup"
            )
        self.directory.key = self.cluster_key
        # A stored page is its payload and, from a verifying pool, its checksum row: a slot holds both.
        page = int(self.page_bytes or 0) + int(self.trailer_bytes)
        # A read lands in staging whole: at least one page of this pool (a target's size bounds what is read).
        self._stage_bytes = max(self.io_chunk_bytes, page)
        if not self.serve:
            return
        self.slot_bytes = -(-page // _SLOT_ALIGN) * _SLOT_ALIGN
        self.slots = self.publish_bytes // self.slot_bytes if self.slot_bytes else 0
        if self.slots < 1:
            raise ValueError(f"option publish_bytes={self.publish_bytes} holds no page of {page} bytes")
        label = f"peer:// publication area of {self.owner_id}"
        self._area = host_tensor((self.slots * self.slot_bytes,), torch.uint8, pinned=False, label=label,
                                 name="publication area")  # fmt: skip
        self._gens_public = host_tensor((self.slots,), torch.int64, pinned=False, label=label, name="generations")
        self._gens = [0] * self.slots
        self._free = list(range(self.slots - 1, -1, -1))
        self._agent = PeerAgent(self.owner_id)
        try:
            self._agent.register([(self._area.data_ptr(), self._area.numel())])
            self._agent.register([(self._gens_public.data_ptr(), self.slots * 8)])
            self._join()
        except BaseException:
            self._agent.close()
            raise
        for target, name in ((self._heartbeat, "lease"), (self._unpublisher, "unpublish")):
            t = threading.Thread(target=target, name=f"hicache-peer-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def _owner(self) -> Owner:
        return Owner(self.owner_id, self._agent.metadata(), self._area.data_ptr(), self.slots, self.slot_bytes,
                     self._gens_public.data_ptr())  # fmt: skip

    def _join(self) -> None:
        try:
            self.directory.register_owner(self._owner(), int(self.lease * 1000))
        except StorageError as exc:
            raise StorageError(f"{exc}; {self.server_hint}") from None

    def ping(self) -> None:
        try:
            self.directory.ping()
        except StorageError as exc:
            raise StorageError(f"{exc}; {self.server_hint}") from None

    # ---- owner: publish (copy into the area), evict, keep the lease ---------------------------------

    def put_objects(self, keys: Sequence[str], values: Sequence[Sequence[Span]]) -> list[BaseException | None]:
        if not self.serve:
            raise StorageError("this peer:// instance was made with serve=0: it reads other instances' pages only")
        self._open()
        out: list[BaseException | None] = []
        staged: list[tuple[str, bytes, int, int, int]] = []  # key, packed entry, slot, generation, index in out
        base = self._area.data_ptr()
        with self._lock:
            for key, spans in zip(keys, values):
                header, runs = spans[0], spans[1:]
                nbytes = sum(s.nbytes for s in runs)
                if nbytes > self.slot_bytes:
                    out.append(ValueError(f"a page of {nbytes} bytes does not fit a publication slot of "
                                          f"{self.slot_bytes}"))  # fmt: skip
                    continue
                out.append(None)
                if key in self._slot_of:  # published already: a key names its bytes
                    self._slot_of.move_to_end(key)
                    continue
                slot = self._take_slot()
                at = base + slot * self.slot_bytes
                for s in runs:
                    ctypes.memmove(at, s.ptr, s.nbytes)
                    at += s.nbytes
                entry = Entry(slot, self._gens[slot], nbytes, bytes(header.view))
                packed = self.directory.pack_entry(key, self.owner_id, entry)
                self._slot_of[key] = slot
                self._published[key] = packed
                staged.append((key, packed, slot, entry.generation, len(out) - 1))
        try:
            self.directory.publish(self.owner_id, [(k, p) for k, p, _, _, _ in staged], PAGE_TTL_S)
        except StorageError:
            with self._lock:
                for key, packed, _, _, _ in staged:
                    if self._published.get(key) == packed:
                        self._release_slot(key, "unpublished")
            raise
        with self._lock:
            for key, packed, slot, gen, i in staged:
                if self._gens[slot] != gen:  # evicted while publishing: its entry is stale already
                    self._pending.put((key, packed))
                    # Not held when this write returns (a later page of the batch, or another writer, took its
                    # slot): a failed write, so that nobody (the KV events included) takes it as stored.
                    out[i] = StaleGeneration(f"{key}: evicted from the publication area ({self.slots} pages) "
                                             "before its write returned")  # fmt: skip
            self.counters["published"] += len(staged)
        return out

    def _take_slot(self) -> int:
        """A free slot of the area; when none is free, the oldest page's (its generation moves first), or the
        first page the area's leases let go (``attach_leases``)."""
        if not self._free:
            book = self._book
            if book is not None and len(book):
                victim = next(eviction_walk(self._slot_of, book))
            else:
                victim = next(iter(self._slot_of))
            self._release_slot(victim, "evicted")
            self.counters["evicted"] += 1
            if book is not None:
                book.left_tier([victim], "evicted")
        return self._free.pop()

    def attach_leases(self, book: LeaseBook) -> str:
        if not self.serve:
            return "never"  # a reader-only instance holds no pages of its own
        book.capacity = self.slots or None
        self._book = book
        return "ordered"

    def _release_slot(self, key: str, reason: str) -> None:
        """Unpublish ``key``: its slot's generation moves (readers of it now miss), its entry is queued for deletion.

        Said to the KV events (``report_removed``) here, under the lock: a write of ``key`` again takes the
        lock after this, so its announcement goes out after this removal, never before it.
        """
        slot = self._slot_of.pop(key)
        self._gens[slot] += 1
        self._gens_public[slot] = self._gens[slot]
        self._pending.put((key, self._published.pop(key)))
        self._free.append(slot)
        self.report_removed([key], reason)

    def _unpublisher(self) -> None:
        while not self._stop.is_set():
            try:
                batch = [self._pending.get(timeout=0.2)]
            except queue.Empty:
                continue
            while len(batch) < 512:
                try:
                    batch.append(self._pending.get_nowait())
                except queue.Empty:
                    break
            try:
                self.directory.unpublish(self.owner_id, batch)
                self.counters["unpublished"] += len(batch)
            except StorageError:  # the generation words already protect readers; the entries lapse with the lease
                self.counters["unpublish_failed"] += len(batch)

    def _heartbeat(self) -> None:
        lease_ms = int(self.lease * 1000)
        while not self._stop.wait(self.lease / 3):
            try:
                if self.directory.renew(self.owner_id, lease_ms):
                    self.counters["lease_renewals"] += 1
                    continue
                # The record is gone (a lapsed lease after a pause, or a directory restarted empty): rejoin.
                self.counters["lease_lost"] += 1
                self._join()
                with self._lock:
                    entries = list(self._published.items())
                self.directory.publish(self.owner_id, entries, PAGE_TTL_S)
                self.counters["republished"] += len(entries)
            except StorageError:
                self.counters["heartbeat_failed"] += 1

    # ---- reader ------------------------------------------------------------------------------------------

    def _live(self, keys: Sequence[str]) -> tuple[list[tuple[str, Entry] | None], dict[str, Owner]]:
        """For each key, a live owner (not this instance) and its checked entry, or ``None``; and the owners.

        An entry that does not check (its MAC, its shape, its slot inside the owner's area) is ignored
        on its own: the key's other owners are still tried, the batch's other keys are not touched.
        """
        holders = self.directory.holders(keys)
        owners, bad_owners = self.directory.owners(o for h in holders for o in h if o != self.owner_id)
        chosen: list[tuple[str, Entry] | None] = []
        dead, bad = [], 0
        for key, found in zip(keys, holders):
            pick = None
            for owner_id, packed in found.items():
                if owner_id == self.owner_id or pick is not None:
                    continue
                owner = owners.get(owner_id)
                if owner is None:
                    if owner_id not in bad_owners:  # a record that fails its check is not this reader's to delete
                        dead.append((key, owner_id))
                    continue
                try:
                    entry = self.directory.read_entry(key, owner_id, packed)
                except BadRecord:
                    bad += 1
                    continue
                if not (0 <= entry.slot < owner.slots and 0 < entry.payload_bytes <= owner.slot_bytes):
                    bad += 1
                    continue
                pick = (owner_id, entry)
            chosen.append(pick)
        self.counters["bad_entries"] += bad
        self.counters["bad_owner_records"] += len(bad_owners)
        if dead:
            try:
                self.directory.forget(dead)
                self.counters["expired_entries"] += len(dead)
            except StorageError:
                pass  # ignored either way: their owners have no lease
        return chosen, owners

    def exists_objects(self, keys: Sequence[str]) -> list[bool]:
        self._open()
        chosen, _ = self._live(keys)
        return [c is not None for c in chosen]

    def get_objects_into(self, keys: Sequence[str], targets: Sequence[Sequence[Span]]) -> list[BaseException | None]:
        self._open()
        chosen, owners = self._live(keys)
        out: list[BaseException | None] = [None] * len(keys)
        groups: dict[str, list[int]] = {}
        for i, (key, target, pick) in enumerate(zip(keys, targets, chosen)):
            if pick is None:
                out[i] = ObjectMissing(key)
                continue
            owner_id, entry = pick
            want = sum(s.nbytes for s in target)
            if target[0].nbytes != len(entry.header) or want != len(entry.header) + entry.payload_bytes:
                out[i] = SizeMismatch(f"the peer's page is {len(entry.header) + entry.payload_bytes} bytes, "
                                      f"the targets {want}")  # fmt: skip
                continue
            groups.setdefault(owner_id, []).append(i)
        for owner_id, idx in groups.items():
            entries = [chosen[i][1] for i in idx]
            until = self._suspended.get(owner_id, 0.0)
            if time.monotonic() < until:
                self.counters["suspended_reads"] += 1
                failure = TimeoutError(f"owner {owner_id} did not answer a read within {self.timeout:g} s; its pages "
                                       f"are not read for {until - time.monotonic():.1f} s more")  # fmt: skip
                for i in idx:
                    out[i] = failure
                continue
            try:
                stale = self._read_group(owners[owner_id], entries, [targets[i] for i in idx])
            except (TimeoutError, TransferFailed, StorageError) as exc:
                # A copy without the traceback: its frames would keep the read's NIXL handles, and through
                # them the reader agent, alive after it is closed (a late byte then lands in freed memory).
                failure = type(exc)(str(exc))
                for i in idx:
                    out[i] = failure
                continue
            for i, moved in zip(idx, stale):
                if moved:
                    out[i] = StaleGeneration(f"{keys[i]}: evicted at its owner during the read")
            self.counters["stale_reads"] += sum(stale)
        return out

    def _read_group(self, owner: Owner, entries: list[Entry], targets: list[Sequence[Span]]) -> list[bool]:
        """Read pages of one owner through a staging buffer into ``targets``; which generations moved.

        Reads land in registered staging memory, never straight in the pool: a read abandoned at its
        deadline can still deliver bytes later, and those must never reach a slot the pool hands out
        again. One NIXL READ per staging buffer's worth of pages: over UCX/TCP, reads split into
        4 MiB sub-batches (to copy out while later ones move) were slower than one read (0.74 vs 1.0
        of NIXL's own read of the same bytes, benchmarks/peer_tier.py), and so were 16 MiB sub-batches
        through two staging buffers, measured again once the progress thread stopped spinning.
        """
        agent, stage = self._take_staging()
        abandoned = False
        try:
            agent.connect(owner.owner_id, owner.metadata)
            deadline = time.monotonic() + self.timeout
            start = 0
            stale: list[bool] = []
            base, cap = stage.data_ptr(), self._stage_bytes
            while start < len(entries):
                at, end, local, remote = 0, start, [], []
                while end < len(entries) and (end == start or at + entries[end].payload_bytes <= cap):
                    local.append((base + at, entries[end].payload_bytes))
                    remote.append((owner.slot_addr(entries[end].slot), entries[end].payload_bytes))
                    at += entries[end].payload_bytes
                    end += 1
                posted = agent.post(owner.owner_id, local, remote)
                try:
                    agent.wait(owner.owner_id, posted, deadline)
                    moved = self._stale(agent, stage, owner, entries[start:end], deadline)
                except (TimeoutError, TransferFailed):
                    abandoned = True
                    self._suspended[owner.owner_id] = time.monotonic() + 2 * self.timeout
                    raise
                src = base
                for k, gone in zip(range(start, end), moved):
                    if not gone:  # a page evicted during the read never reaches the pool
                        _copy_out(src, entries[k].header, targets[k])
                    src += entries[k].payload_bytes
                stale += moved
                start = end
            return stale
        finally:
            self._give_staging(agent, stage, owner.owner_id, abandoned)
            del stage  # the error this raises is kept with its traceback: it must not keep the buffer alive

    def _stale(self, agent: PeerAgent, stage: torch.Tensor, owner: Owner, entries: list[Entry],
               deadline: float) -> list[bool]:  # fmt: skip
        """Read the owner's generation words of ``entries`` now; ``True`` where one moved since publishing."""
        out: list[bool] = []
        words = stage[self._stage_bytes :].view(torch.int64)
        for start in range(0, len(entries), _SCRATCH_WORDS):
            group = entries[start : start + _SCRATCH_WORDS]
            base = words.data_ptr()
            local = [(base + 8 * j, 8) for j in range(len(group))]
            remote = [(owner.gens_addr + 8 * e.slot, 8) for e in group]
            agent.read(owner.owner_id, local, remote, deadline)
            seen = words[: len(group)].tolist()
            out += [s != e.generation for s, e in zip(seen, group)]
        return out

    def _take_staging(self) -> tuple[PeerAgent, torch.Tensor]:
        """The reader agent and a staging buffer of its own for one read (a new one when all are in use)."""
        with self._reader_lock:
            self._open()
            if self._reader is None:
                self._readers_made += 1
                self._reader = PeerAgent(f"{self.owner_id}-reader{self._readers_made}")
            if self._staging_free:
                stage = self._staging_free.pop()
            else:
                stage = host_tensor((self._stage_bytes + 8 * _SCRATCH_WORDS,), torch.uint8, pinned=False,
                                    label=f"peer:// reads of {self.owner_id}", name="staging")  # fmt: skip
                self._reader.register([(stage.data_ptr(), stage.numel())])
            self._in_flight += 1
            return self._reader, stage

    def _give_staging(self, agent: PeerAgent, stage: torch.Tensor, owner_id: str, abandoned: bool) -> None:
        """Back to the free list; an abandoned read's buffer is retired (see the module's docstring)."""
        now = time.monotonic()
        with self._reader_lock:
            self._in_flight -= 1
            if abandoned:
                self._retired.append([owner_id, stage, None])
                self.counters["retired_staging_bytes"] += stage.numel()
                return
            if agent is self._reader:
                self._staging_free.append(stage)
            for item in self._retired:  # the owner answered: its old replies are through within a timeout
                if item[0] == owner_id and item[2] is None:
                    item[2] = now + self.timeout
            keep = []
            for item in self._retired:
                if item[2] is not None and item[2] <= now:
                    self._staging_free.append(item[1])
                    self.counters["reclaimed_staging_bytes"] += item[1].numel()
                else:
                    keep.append(item)
            self._retired = keep

    def _close_reader(self) -> None:
        """Close the reader agent (no byte can land after), then let its staging buffers go. Holds ``_reader_lock``."""
        if self._reader is not None:
            for name in self._gone_agents:
                self._gone_agents[name] += getattr(self._reader, name)
            self._reader.close()
            self._reader = None
        self._staging_free.clear()
        self._retired.clear()

    @property
    def held_staging_bytes(self) -> int:
        """Bytes of staging this backend holds now (free, in use or retired)."""
        with self._reader_lock:
            return sum(t.numel() for t in self._staging_free) + sum(r[1].numel() for r in self._retired)

    # ---- administration ----------------------------------------------------------------------------------

    def remove_objects(self, keys: Sequence[str]) -> None:
        """Unpublish this instance's entries of ``keys`` (other owners' entries are theirs)."""
        with self._lock:
            gone = [(k, self._published[k]) for k in keys if k in self._slot_of]
            for k, _ in gone:
                self._release_slot(k, "removed")
            while not self._pending.empty():  # unpublished now, not in the background
                try:
                    item = self._pending.get_nowait()
                except queue.Empty:
                    break
                if item not in gone:
                    gone.append(item)
        self.directory.unpublish(self.owner_id, gone)

    def clear(self) -> None:
        """Unpublish every entry of this instance."""
        with self._lock:
            keys = list(self._slot_of)
        self.remove_objects(keys)

    def close(self) -> None:
        """Leave the directory (best effort, bounded), stop the threads, close both NIXL agents."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout + 1)
        if self._agent is not None:  # never joined (a reader, or refused at binding): nothing to leave
            try:
                with self._lock:
                    gone = list(self._published.items())
                self.directory.unpublish(self.owner_id, gone)
                self.directory.drop_owner(self.owner_id)
            except StorageError:
                pass  # the lease lapses on its own
            self._agent.close()  # deregistered: the area and its words can go
        self._area = self._gens_public = None
        with self._reader_lock:
            self._close_reader()
        self.directory.close()

    def _open(self) -> None:
        if self._closed:
            raise StorageError("this peer:// backend is closed")
        if self.namespace is None:
            raise StorageError("peer:// is not bound to a host pool: make it with make_storage(url, host_pool, ...)")

    def check_steps(self) -> list[tuple[str, bool, str]]:
        """The directory answers, the publication area is registered with NIXL, and this instance holds a lease."""
        steps = []
        try:
            self.directory.ping()
            steps.append((f"the directory answers at {self.directory.address}", True, ""))
        except StorageError as exc:
            steps.append((f"the directory answers at {self.directory.address}", False, str(exc)))
        if not self.serve:
            steps.append(("serve=0: this instance reads others' pages and publishes none", True, ""))
            return steps
        agent = self._agent
        registered = agent.registrations if agent else 0
        steps.append(("only the publication area and its generation words are registered with NIXL (UCX)",
                      registered == 2, f"{self.slots} page slot(s), {self.slots * self.slot_bytes >> 20} MiB; "
                      "the host pool is not registered"))  # fmt: skip
        try:
            joined = self.owner_id in self.directory.owners([self.owner_id])[0]
            detail = "" if joined else "no owner record in the directory that checks (its lease lapsed?)"
        except StorageError as exc:
            joined, detail = False, str(exc)
        steps.append((f"joined the directory as owner {self.owner_id}, lease {self.lease:g} s", joined, detail))
        return steps

    def backend_stats(self) -> dict[str, Any]:
        agent, reader = self._agent, self._reader
        with self._lock:
            published = len(self._published)
        return {
            "directory": self.directory.address,
            "owner_id": self.owner_id,
            "published_pages": published,
            "publication_slots": self.slots,
            "nixl_registrations": agent.registrations if agent else 0,
            "remote_agents": reader.remotes if reader else 0,
            **{name: done + (getattr(reader, name) if reader else 0) for name, done in self._gone_agents.items()},
            "held_staging_bytes": self.held_staging_bytes,
            **self.counters,
        }


def _copy_out(src: int, header: bytes, target: Sequence[Span]) -> int:
    """Copy one page from staging (at ``src``) into its target spans, header first; where the next page starts."""
    target[0].view[:] = header
    for s in target[1:]:
        ctypes.memmove(s.ptr, src, s.nbytes)
        src += s.nbytes
    return src
