"""``peer://host:port/db``: pages read straight from other instances' host pools through NIXL.

The URL names the Redis server that keeps the directory (``directory.py``). An instance is both:

* **owner**: a page "written" to this tier is published, not copied: its directory entry says
  where the page's runs lie in this process's host pool (registered with a NIXL agent), under
  which generation, with the page's header (checksum included). Freeing a slot bumps its
  generation word first (it observes the pool: ``hicache_core.slot_events``), then unpublishes the entry in the
  background: the owner never waits on the directory or on a reader. A heartbeat renews the
  owner's lease and republishes everything when the directory lost it (a restarted server).
* **reader**: ``get_objects_into`` finds a live owner in the directory, reads the pages' runs into
  a registered staging buffer with one NIXL READ per owner and batch, then reads the owner's
  generation words; a page whose generation moved is a miss (freed, maybe overwritten, during the
  read) and is not copied; the others are copied into the host pool. The core then checks the
  header and the payload checksum as for any L3 page.

Every read has a deadline (``timeout``): a paused or dead owner makes its pages ``timeout`` or
``error``; its remote agent is dropped and its staging buffer retired, so that a late byte of the
abandoned read never lands in a slot given back.
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
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from hicache_core.host_memory import host_tensor
from hicache_core.slot_events import FreeListener
from hicache_core.storage.backend import Capabilities, ObjectMissing, SizeMismatch, StorageBackend, StorageError
from hicache_core.storage.pages import PageMap, Span
from hicache_core.storage.url import StorageURL, option_bool, option_float

from .agent import PeerAgent, TransferFailed
from .directory import Directory, Entry, Owner

#: A page hash left unrefreshed this long disappears from the directory (bounds what dead owners leave).
PAGE_TTL_S = 3600
#: Generation words one reader batch reads at most (larger batches go in groups).
_SCRATCH_WORDS = 4096


class StaleGeneration(ObjectMissing):
    """The owner freed the page's slot before the read finished: the bytes read are not used."""


class PeerStorage(StorageBackend):
    """The peer tier: other instances' host pools, read through NIXL, found through a Redis directory."""

    scheme: ClassVar[str] = "peer"
    # A page is read from its owner's host pool by other instances, never by the owner itself.
    capabilities: ClassVar[Capabilities] = Capabilities(zero_copy=True, durable=False, shared=True,
                                                        reads_own_writes=False)  # fmt: skip
    description: ClassVar[str] = "other instances' host pools over NIXL (UCX), directory in Redis with leases"
    # One NIXL READ per owner and group: larger groups spend fewer round trips per byte.
    io_chunk_bytes: ClassVar[int] = 64 << 20
    options_help: ClassVar[dict[str, str]] = {
        "prefix": "directory key prefix (default 'hicache-peer:')",
        "lease": "seconds an owner's entries stay valid without a heartbeat (default 10)",
        "timeout": "seconds a directory call or a NIXL read may take (default 5)",
        "serve": "publish this instance's pages for others (default 1; 0: read only)",
        "password": "Redis AUTH password of the directory",
        "username": "Redis ACL user of the directory",
    }
    server_hint: ClassVar[str] = (
        "the directory is a Redis server: redis-server --port PORT --bind 127.0.0.1 "
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
        self.directory = Directory(url.host or "127.0.0.1", url.port or 6379, int(db),
                                   prefix=str(options.get("prefix", "hicache-peer:")), timeout=self.timeout,
                                   username=options.get("username", url.username) or None,
                                   password=options.get("password", url.password) or None)  # fmt: skip
        self.owner_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._agent: PeerAgent | None = None
        self._lock = threading.Lock()  # owner state: generation slots, published entries
        self._read_lock = threading.Lock()  # the scratch words of a read
        self._regions: list[tuple[int, int]] = []
        self._gens: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None
        self._gen_slot: dict[int, int] = {}  # first run's address -> generation word
        self._slot_entry: dict[int, tuple[str, bytes]] = {}  # generation word -> (full key, packed entry)
        self._published: dict[str, bytes] = {}
        self._maps: dict[int, PageMap] = {}
        self._staging: torch.Tensor | None = None
        self._retired: list[torch.Tensor] = []
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.counters = dict(published=0, unpublished=0, unpublish_failed=0, freed_published=0, stale_reads=0,
                             expired_entries=0, lease_renewals=0, lease_lost=0, republished=0,
                             heartbeat_failed=0, retired_staging_bytes=0)  # fmt: skip

    # ---- binding: register the host pool, join the directory --------------------------------------

    def register_memory(self, spans: Sequence[Span]) -> None:
        self._regions = [(s.ptr, s.nbytes) for s in spans]
        pages = sum(n for _, n in self._regions) // max(1, int(self.page_bytes or 1)) + 1
        self._gens = torch.zeros(pages, dtype=torch.int64)
        self._scratch = torch.zeros(_SCRATCH_WORDS, dtype=torch.int64)
        self._agent = PeerAgent(self.owner_id)
        try:
            self._agent.register(self._regions)
            self._agent.register([(self._gens.data_ptr(), self._gens.numel() * 8),
                                  (self._scratch.data_ptr(), self._scratch.numel() * 8)])  # fmt: skip
            if self.serve:
                self._join()
        except BaseException:
            self._agent.close()
            raise
        for target, name in ((self._heartbeat, "lease"), (self._unpublisher, "unpublish")):
            t = threading.Thread(target=target, name=f"hicache-peer-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def _join(self) -> None:
        owner = Owner(self.owner_id, self._agent.metadata(), self._gens.data_ptr())
        try:
            self.directory.register_owner(owner, int(self.lease * 1000))
        except StorageError as exc:
            raise StorageError(f"{exc}; {self.server_hint}") from None

    def ping(self) -> None:
        try:
            self.directory.ping()
        except StorageError as exc:
            raise StorageError(f"{exc}; {self.server_hint}") from None

    # ---- owner: publish, unpublish on free, keep the lease -------------------------------------------

    def put_objects(self, keys: Sequence[str], values: Sequence[Sequence[Span]]) -> list[BaseException | None]:
        if not self.serve:
            raise StorageError("this peer:// instance was made with serve=0: it reads other instances' pages only")
        self._open()
        out: list[BaseException | None] = []
        staged: list[tuple[str, bytes, Entry]] = []
        stale: list[tuple[str, bytes]] = []
        with self._lock:
            for key, spans in zip(keys, values):
                header, runs = spans[0], spans[1:]
                outside = next((s for s in runs if not self._inside(s.ptr, s.nbytes)), None)
                if outside is not None or not runs:
                    out.append(ValueError(f"peer:// publishes pages of its bound host pool only: a run at "
                                          f"{outside.ptr if outside else 0:#x} is outside it"))  # fmt: skip
                    continue
                slot = self._gen_slot.setdefault(runs[0].ptr, len(self._gen_slot))
                before = self._slot_entry.get(slot)
                if before is not None and before[0] != key:  # the slot now holds another page
                    self._gens[slot] += 1
                    stale.append(before)
                entry = Entry(slot, int(self._gens[slot]), bytes(header.view), tuple((s.ptr, s.nbytes) for s in runs))
                staged.append((key, entry.pack(), entry))
                out.append(None)
        for item in stale:
            self._pending.put(item)
        if staged:
            self.directory.publish(self.owner_id, [(k, p) for k, p, _ in staged], PAGE_TTL_S)
        with self._lock:
            for key, packed, entry in staged:
                if int(self._gens[entry.gen_slot]) != entry.generation:  # freed while publishing
                    self._pending.put((key, packed))
                    continue
                self._slot_entry[entry.gen_slot] = (key, packed)
                self._published[key] = packed
            self.counters["published"] += len(staged)
        return out

    def _inside(self, ptr: int, nbytes: int) -> bool:
        return any(base <= ptr and ptr + nbytes <= base + size for base, size in self._regions)

    def observer_of(self, host_pool: Any) -> FreeListener:
        """What the core attaches to the bound host pool: this backend hears of its freed slots."""
        return FreeListener(self._on_free, host_pool)

    def _on_free(self, host_pool: Any, slots: torch.Tensor | None) -> None:
        """Before freed slots can be reused: bump their generation words, queue the unpublish."""
        if self._closed or self._gens is None:
            return
        pm = self._maps.get(id(host_pool))
        if pm is None:
            pm = PageMap(host_pool)
            if not pm.buffer_spans() or not self._inside(pm.buffer_spans()[0].ptr, 1):
                return  # another pool's slots
            self._maps[id(host_pool)] = pm
        if slots is None:
            pages = range(pm.num_pages)
        else:
            pages = torch.unique(slots.to("cpu", torch.int64).reshape(-1) // pm.page_size).tolist()
        with self._lock:
            for page in pages:
                slot = self._gen_slot.get(pm.page_runs(page)[0][0])
                if slot is None:
                    continue
                self._gens[slot] += 1
                entry = self._slot_entry.pop(slot, None)
                if entry is not None:
                    if self._published.get(entry[0]) == entry[1]:
                        del self._published[entry[0]]
                    self.counters["freed_published"] += 1
                    self._pending.put(entry)

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
            if not self.serve:
                continue
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
        """For each key, a live owner (not this instance) and its entry, or ``None``; and the owners."""
        holders = self.directory.holders(keys)
        owners = self.directory.owners(o for h in holders for o in h if o != self.owner_id)
        chosen: list[tuple[str, Entry] | None] = []
        dead = []
        for key, found in zip(keys, holders):
            pick = None
            for owner_id, packed in found.items():
                if owner_id == self.owner_id:
                    continue
                if owner_id not in owners:
                    dead.append((key, owner_id))
                    continue
                if pick is None:
                    try:
                        pick = (owner_id, Entry.unpack(packed))
                    except Exception:  # noqa: BLE001 - a damaged entry is no entry
                        dead.append((key, owner_id))
            chosen.append(pick)
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
            try:
                with self._read_lock:
                    stale = self._read_group(owners[owner_id], entries, [targets[i] for i in idx])
            except (TimeoutError, TransferFailed, StorageError) as exc:
                for i in idx:
                    out[i] = exc
                continue
            for i, moved in zip(idx, stale):
                if moved:
                    out[i] = StaleGeneration(f"{keys[i]}: freed at its owner during the read")
            self.counters["stale_reads"] += sum(stale)
        return out

    def _read_group(self, owner: Owner, entries: list[Entry], targets: list[Sequence[Span]]) -> list[bool]:
        """Read pages of one owner through the staging buffer into ``targets``; which generations moved.

        Reads land in registered staging memory, never straight in the pool: a read abandoned at its
        deadline can still deliver bytes later, and those must never reach a slot the pool hands out
        again. One NIXL READ per staging buffer's worth of pages: over UCX/TCP, reads split into
        4 MiB sub-batches (to copy out while later ones move) were slower than one read (0.74 vs 1.0
        of NIXL's own read of the same bytes, benchmarks/peer_tier.py), and so were 16 MiB sub-batches
        through two staging buffers, measured again once the progress thread stopped spinning.
        """
        agent = self._agent
        if not agent.connected(owner.owner_id):
            try:
                agent.connect(owner.owner_id, owner.metadata)
            except Exception as exc:  # noqa: BLE001 - NIXL rejects bad or stale metadata with bare errors
                raise TransferFailed(f"cannot load owner {owner.owner_id}'s NIXL metadata ({exc})") from None
        deadline = time.monotonic() + self.timeout
        start = 0
        stale: list[bool] = []
        while start < len(entries):
            stage = self._staging_for(entries[start].payload_bytes)
            base, cap = stage.data_ptr(), stage.numel()
            at, end, local, remote = 0, start, [], []
            while end < len(entries) and at + entries[end].payload_bytes <= cap:
                for p, n in entries[end].runs:
                    local.append((base + at, n))
                    remote.append((p, n))
                    at += n
                end += 1
            posted = agent.post(owner.owner_id, local, remote)
            try:
                agent.wait(owner.owner_id, posted, deadline)
            except (TimeoutError, TransferFailed):
                self._retire_staging()
                raise
            moved = self._stale(owner, entries[start:end], deadline)
            src = base
            for k, gone in zip(range(start, end), moved):
                if not gone:  # a page freed during the read never reaches the pool
                    _copy_out(src, entries[k].header, targets[k])
                src += entries[k].payload_bytes
            stale += moved
            start = end
        return stale

    def _staging_for(self, page_bytes: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < page_bytes:
            self._staging = host_tensor((max(self.io_chunk_bytes, page_bytes),), torch.uint8, pinned=False,
                                        label=f"peer:// reads of {self.owner_id}", name="staging")  # fmt: skip
            self._staging_descs = self._agent.register([(self._staging.data_ptr(), self._staging.numel())])
        return self._staging

    def _retire_staging(self) -> None:
        """Never reuse a staging buffer a cancelled read may still write into (kept registered until close)."""
        if self._staging is not None:
            self._retired.append(self._staging)
            self.counters["retired_staging_bytes"] += self._staging.numel()
            self._staging = None

    def _stale(self, owner: Owner, entries: list[Entry], deadline: float) -> list[bool]:
        """Read the owner's generation words of ``entries`` now; ``True`` where one moved since publishing."""
        out: list[bool] = []
        for start in range(0, len(entries), _SCRATCH_WORDS):
            group = entries[start : start + _SCRATCH_WORDS]
            base = self._scratch.data_ptr()
            local = [(base + 8 * j, 8) for j in range(len(group))]
            remote = [(owner.gens_addr + 8 * e.gen_slot, 8) for e in group]
            self._agent.read(owner.owner_id, local, remote, deadline)
            seen = self._scratch[: len(group)].tolist()
            out += [s != e.generation for s, e in zip(seen, group)]
        return out

    # ---- administration ----------------------------------------------------------------------------------

    def remove_objects(self, keys: Sequence[str]) -> None:
        """Unpublish this instance's entries of ``keys`` (other owners' entries are theirs)."""
        with self._lock:
            gone = [(k, self._published.pop(k)) for k in keys if k in self._published]
            for slot, (k, _) in list(self._slot_entry.items()):
                if k in keys:
                    del self._slot_entry[slot]
        self.directory.unpublish(self.owner_id, gone)

    def clear(self) -> None:
        """Unpublish every entry of this instance."""
        with self._lock:
            gone = list(self._published.items())
            self._published.clear()
            self._slot_entry.clear()
        self.directory.unpublish(self.owner_id, gone)

    def close(self) -> None:
        """Leave the directory (best effort, bounded), stop the threads, drop NIXL registrations and peers."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout + 1)
        try:
            with self._lock:
                gone = list(self._published.items())
            self.directory.unpublish(self.owner_id, gone)
            self.directory.drop_owner(self.owner_id)
        except StorageError:
            pass  # the lease lapses on its own
        if self._agent is not None:
            self._agent.close()
        self.directory.close()

    def _open(self) -> None:
        if self._closed:
            raise StorageError("this peer:// backend is closed")
        if self._agent is None:
            raise StorageError("peer:// is not bound to a host pool: make it with make_storage(url, host_pool, ...)")

    def check_steps(self) -> list[tuple[str, bool, str]]:
        """The directory answers, this instance's memory is registered with NIXL, and it holds a lease there."""
        steps = []
        try:
            self.directory.ping()
            steps.append((f"the directory answers at {self.directory.address}", True, ""))
        except StorageError as exc:
            steps.append((f"the directory answers at {self.directory.address}", False, str(exc)))
        agent = self._agent
        registered = agent.registrations if agent else 0
        steps.append(("the host pool and generation words are registered with NIXL (UCX)", registered >= 2,
                      f"{len(self._regions)} host buffer(s) in {registered} registration(s)"))  # fmt: skip
        if not self.serve:
            steps.append(("serve=0: this instance reads others' pages and publishes none", True, ""))
            return steps
        try:
            joined = self.owner_id in self.directory.owners([self.owner_id])
            detail = "" if joined else "no owner record in the directory (its lease lapsed?)"
        except StorageError as exc:
            joined, detail = False, str(exc)
        steps.append((f"joined the directory as owner {self.owner_id}, lease {self.lease:g} s", joined, detail))
        return steps

    def backend_stats(self) -> dict[str, Any]:
        agent = self._agent
        with self._lock:
            published = len(self._published)
        return {
            "directory": self.directory.address,
            "owner_id": self.owner_id,
            "published_pages": published,
            "nixl_registrations": agent.registrations if agent else 0,
            "remote_agents": agent.remotes if agent else 0,
            "transfers": agent.transfers if agent else 0,
            "transfer_timeouts": agent.transfer_timeouts if agent else 0,
            "transfer_errors": agent.transfer_errors if agent else 0,
            **self.counters,
        }


def _copy_out(src: int, header: bytes, target: Sequence[Span]) -> int:
    """Copy one page from staging (at ``src``) into its target spans, header first; where the next page starts."""
    target[0].view[:] = header
    for s in target[1:]:
        ctypes.memmove(s.ptr, src, s.nbytes)
        src += s.nbytes
    return src
