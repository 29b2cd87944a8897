"""KV events under churn: an index built only from the events agrees with what every tier really holds.

A server's run, played against real stores: a ``file://`` directory whose LRU evicts (it says so:
``report_removed``) and a real redis-server under a small ``maxmemory`` with ``allkeys-lru`` (it evicts
on its own, unseen: the audit finds it). Over the run pages are written, evicted, read back, written
again, forged by an outsider (read and refused), moved by a weight update, orphaned by a cluster-key
rotation, and the Redis server is killed and restarted with its data and then empty. Two routers follow
the events over real ZMQ sockets: one from the start, one that joins late through the snapshot.

What each tier really holds is asked of the stores themselves: ``exists_objects`` for every key ever
written, in the current namespace, and a read by another instance of the cluster (same key, no events)
for whether a reader would load it. The bars are the issue's: at most 0.1 % of an index's entries point
at pages the tier does not hold, no page a reader would load is missing from it, and no ``BlockStored``
ever names a page a reader would refuse (each one is checked the moment it arrives).

Run as the defaults (no key, no host-tier verification, SGLang's format) and as GPU servers run
(``HICACHE_VERIFY=1`` with a cluster key from a 0600 key file, vLLM's format). The peer tier's events
(its own evictions, an owner killed) are tested with its fixtures in ``plugins/storage-peer/tests``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

pytest.importorskip("zmq", reason="KV events need pyzmq (pip install 'hicache-core[events]')")
pytest.importorskip("msgspec", reason="KV events need msgspec (pip install 'hicache-core[events]')")

from hicache_core.events import EventSubscriber, KVEventPublisher  # noqa: E402
from hicache_core.plugins.registry import get_registry  # noqa: E402
from hicache_core.storage import make_storage, page_hashes  # noqa: E402
from hicache_core.storage.backend import PageStatus  # noqa: E402
from hicache_core.storage.page_auth import ClusterKey  # noqa: E402
from hicache_core.storage.page_format import HEADER_SIZE, address_of  # noqa: E402
from hicache_core.storage.pages import PageMap, Span  # noqa: E402
from hicache_core.testing import explain_kit as kit  # noqa: E402
from hicache_core.testing.servers import start_redis  # noqa: E402

PAGE = kit.PAGE
POOL_PAGES = 32
#: The file tier holds this many pages; its LRU evicts the rest (and reports each eviction).
FILE_CAPACITY_PAGES = 10
#: Redis evicts on its own past this (a page is ~33 KiB; an empty server uses ~1 MiB).
REDIS_MAXMEMORY = "2mb"
KEY = b"planted-churn-cluster-key-0123456789abcdef"  # planted: a test key, never a real one
ROTATED = b"planted-churn-rotated-key-fedcba9876543210"
#: A refused read: what a reader would never load.
REFUSED = (PageStatus.AUTH_FAILED, PageStatus.CORRUPT, PageStatus.MISMATCH)
HEARTBEAT = 0.2
#: The file tier's on-disk header block (hicache_storage_file.backend.HEADER_BLOCK): counted in its capacity.
HEADER_BLOCK = 4096


# ---- the tiers ----------------------------------------------------------------------------------------------


@dataclass
class Tier:
    """One store under test: the publishing instance, and a second instance of the cluster that checks."""

    name: str
    store: Any  # PageStore, publishing its events
    checker: Any  # PageStore on the same store, same key, no events: what another reader would load
    feed: Any = None
    written: set[str] = field(default_factory=set)  # every page hash ever written, in any namespace

    def where(self, fmt: Any) -> tuple[str, str]:
        """The (medium, store) the events name this tier by."""
        return fmt.medium(self.feed.tier), self.feed.tier.store


def _fill(host: Any, seed: int) -> None:
    """Random pages, set through the pool (a verifying pool takes each page's checksum row)."""
    gen = torch.Generator().manual_seed(seed)
    flat = host.get_dummy_flat_data_page()
    for page in range(POOL_PAGES):
        data = torch.randint(0, 256, (flat.numel() * flat.element_size(),), dtype=torch.uint8, generator=gen)
        host.set_from_flat_data_page(page * PAGE, data.view(flat.dtype))


def _slots(pages: list[int]) -> torch.Tensor:
    return (torch.tensor(pages)[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)


def _keys(base: int, n: int) -> list[str]:
    return page_hashes(list(range(base, base + n * PAGE)), PAGE)


def _write(tier: Tier, keys: list[str], first_page: int = 0) -> list[Any]:
    """Write ``keys`` from pool pages ``first_page, ...`` of the first half (wrapping): every write is acknowledged."""
    pages = [(first_page + i) % (POOL_PAGES // 2) for i in range(len(keys))]
    results = tier.store.write_pages(keys, _slots(pages))
    assert [r.status for r in results] == [PageStatus.OK] * len(keys), results
    tier.written.update(keys)
    return results


def _read(tier: Tier, keys: list[str]) -> list[Any]:
    """Read into the pool's second half: a refused page's slots hold what arrived (zero-copy reads land first),
    and a server frees them; nothing is written from there."""
    return tier.store.read_pages(keys, _slots([POOL_PAGES // 2 + i % (POOL_PAGES // 2) for i in range(len(keys))]))


def _object_spans(blob: bytearray) -> list[Span]:
    base, view = address_of(blob), memoryview(blob)
    return [Span(base, HEADER_SIZE, view[:HEADER_SIZE]), Span(base + HEADER_SIZE, len(blob) - HEADER_SIZE,
                                                               view[HEADER_SIZE:])]  # fmt: skip


def _forge(outsider: Any, full_key: str, from_key: str) -> None:
    """An outsider with the store's address (and no cluster key) puts changed bytes under ``full_key``:
    the object of ``from_key`` with one payload byte flipped, written with the store's own client."""
    backend = outsider.backend
    blob = bytearray(HEADER_SIZE + outsider.pages.page_bytes + outsider.pages.trailer_bytes)
    if backend.capabilities.zero_copy:
        (err,) = backend.get_objects_into([from_key], [_object_spans(blob)])
        assert err is None, err
    else:
        (got,) = backend.get_objects([from_key])
        assert isinstance(got, (bytes, bytearray, memoryview)) and len(got) == len(blob), got
        blob[:] = bytes(got)
    blob[HEADER_SIZE + 100] ^= 0x01
    backend.remove_objects([full_key])
    (err,) = backend.put_objects([full_key], [_object_spans(blob)])
    assert err is None, err


# ---- the router's side ------------------------------------------------------------------------------------


class Router:
    """The subscribers, and the check made of every ``BlockStored`` the moment it arrives."""

    def __init__(self, publisher: KVEventPublisher, fmt: Any, tiers: list[Tier]) -> None:
        self.publisher = publisher
        self.fmt = fmt
        self.tiers = tiers
        self.page_of: dict[Any, str] = {}  # event hash -> page hash, for every key the test makes
        self.stored_checks: dict[str, int] = {}
        self.announced: set[str] = set()  # page hashes any BlockStored named
        self.early = self.subscribe(check=True)
        self.early.sync()
        self.late: EventSubscriber | None = None

    def subscribe(self, check: bool = False) -> EventSubscriber:
        return EventSubscriber(self.publisher.endpoint, format=self.fmt, replay_endpoint=self.publisher.replay_endpoint,
                               on_batch=self._check_batch if check else None)  # fmt: skip

    def join_late(self) -> None:
        self.late = self.subscribe()
        self.late.sync()

    def learn(self, keys: list[str]) -> list[str]:
        for k in keys:
            self.page_of[self.fmt.block_hash(k)] = k
        return keys

    def _check_batch(self, seq: int, batch: Any, received: float) -> None:
        by_where = {t.where(self.fmt): t for t in self.tiers}
        for event in batch.events:
            if type(event).__struct_config__.tag != "BlockStored":
                continue
            tier = by_where[(event.medium, getattr(event, "ownership", None) or getattr(event, "store", None))]
            for block in event.block_hashes:
                page = self.page_of[block]
                self.announced.add(page)
                status = tier.checker.check_page(page).status
                # Stored and still there (it reads back, checked), or evicted since by the store's own LRU:
                # never a page a reader would refuse.
                assert status in (PageStatus.OK, PageStatus.MISSING), (tier.name, page, status)
                self.stored_checks[status.value] = self.stored_checks.get(status.value, 0) + 1

    def subscribers(self) -> list[EventSubscriber]:
        return [s for s in (self.early, self.late) if s is not None]

    def settle(self, timeout: float = 15.0) -> None:
        """Poll until every subscriber's index is what the feeds announced and every batch sent so far was
        consumed (a page announced again changes no index: its batch could otherwise be checked after the test
        moved on, against what the store holds by then)."""
        deadline = time.monotonic() + timeout
        drained_once = False
        while True:
            for sub in self.subscribers():
                sub.poll(0.01)
            behind = [(sub is self.late, t.name) for sub in self.subscribers() for t in self.tiers
                      if sub.index.pages(*t.where(self.fmt)) != {self.fmt.block_hash(h) for h in t.feed.held()}
                      ]  # fmt: skip
            pub = self.publisher
            drained = pub._queue.empty() and all(sub.last_seq >= pub._seq for sub in self.subscribers())
            if not behind and drained and drained_once:  # twice in a row: nothing was between queue and socket
                return
            drained_once = drained and not behind
            assert time.monotonic() < deadline, f"(late?, tier) indexes never matched their feeds: {behind}"

    def close(self) -> None:
        for sub in self.subscribers():
            sub.close()


# ---- ground truth -------------------------------------------------------------------------------------------


def _audit_until_reachable(tier: Tier, tries: int = 50) -> dict[str, int]:
    """An audit pass once the store answers again (a dead connection fails the first call after a restart)."""
    for _ in range(tries):
        out = tier.feed.audit()
        if tier.feed.reachable:
            return out
        time.sleep(0.05)
    raise AssertionError(f"{tier.name} never answered again")


def _reconnect(store: Any, tries: int = 50) -> None:
    for _ in range(tries):
        try:
            store.ping()
            return
        except Exception:  # noqa: BLE001 - the first call on a connection the restart broke fails
            time.sleep(0.05)
    raise AssertionError(f"{store!r} never answered again")


def _truth(tier: Tier) -> tuple[set[str], set[str], set[str]]:
    """(in the store, a reader would load it, a reader would refuse it): every key ever written, asked of the
    store in the current namespace."""
    keys = sorted(tier.written)
    ns = tier.store.namespace
    present = {k for k, p in zip(keys, tier.store.backend.exists_objects(ns.keys(keys))) if p}
    status = {k: tier.checker.check_page(k).status for k in present}
    return present, {k for k, s in status.items() if s is PageStatus.OK}, {k for k, s in status.items() if s in REFUSED}


def _assert_agrees(router: Router, tier: Tier) -> dict[str, Any]:
    present, loadable, refused = _truth(tier)
    bh = router.fmt.block_hash
    figures = {"present": len(present), "loadable": len(loadable), "refused": len(refused)}
    for sub in router.subscribers():
        index = sub.index.pages(*tier.where(router.fmt))
        stale = index - {bh(k) for k in present}
        missing = {bh(k) for k in loadable} - index
        name = "late" if sub is router.late else "early"
        assert len(stale) <= 0.001 * len(index), (tier.name, name, "stale", len(stale), len(index))
        assert not missing, (tier.name, name, "missing", len(missing))
        assert not index & {bh(k) for k in refused}, (tier.name, name, "a refused page is indexed")
        figures[name] = len(index)
    return figures


# ---- the run ------------------------------------------------------------------------------------------------


@pytest.fixture(params=["defaults", "verify-keyed"])
def setting(request, tmp_path, monkeypatch) -> Iterator[str]:
    """The defaults, or as GPU servers run: host-tier verification on, the cluster key in a 0600 file."""
    for var in ("HICACHE_L3_KEY", "HICACHE_L3_KEY_FILE", "HICACHE_VERIFY"):
        monkeypatch.delenv(var, raising=False)
    if request.param == "verify-keyed":
        key_file = tmp_path / "cluster.key"
        key_file.write_bytes(KEY)
        os.chmod(key_file, 0o600)
        monkeypatch.setenv("HICACHE_L3_KEY_FILE", str(key_file))
        monkeypatch.setenv("HICACHE_VERIFY", "1")
    yield request.param


def test_an_index_built_from_the_events_agrees_with_every_tier_after_churn(setting, tmp_path):
    for scheme in ("file", "redis"):
        if scheme not in get_registry().storage_backends:
            pytest.skip(f"no installed plugin registers {scheme}://")
    keyed = setting == "verify-keyed"
    fmt_name = "vllm" if keyed else "sglang"  # both formats, one per setting
    (tmp_path / "redis").mkdir()
    # Redis' LRU is sampled: more samples make it evict the oldest pages, not a page just written
    server = start_redis(tmp_path / "redis", "--maxmemory", REDIS_MAXMEMORY, "--maxmemory-policy", "allkeys-lru",
                         "--maxmemory-samples", "10")  # fmt: skip
    publisher = KVEventPublisher("tcp://127.0.0.1:*", format=fmt_name, replay_endpoint="tcp://127.0.0.1:*",
                                 heartbeat=HEARTBEAT)  # fmt: skip
    model = f"churn/{setting}"
    opened: list[Any] = []

    def store(url: str, seed: int, **kw: Any) -> Any:
        host = kit.host_pool(pages=POOL_PAGES)
        _fill(host, seed)
        s = make_storage(url, host, model_id=model, **kw)
        opened.append(s)
        return s

    router = None
    try:
        redis_url = f"redis://127.0.0.1:{server.port}/0?prefix=churn:"
        file_url = f"file://{tmp_path / 'l3'}"
        # The file tier is keyed in both settings (a key rotation needs one); Redis as the setting has it.
        fkw = {} if keyed else {"cluster_key": ClusterKey(KEY, "test key")}
        pm = PageMap(kit.host_pool(pages=1))  # on disk a page is its payload and checksum row after a header block
        on_disk = pm.page_bytes + pm.trailer_bytes + HEADER_BLOCK
        file_tier = Tier("file", store(f"{file_url}?capacity={FILE_CAPACITY_PAGES * on_disk + on_disk // 2}", 1, **fkw),
                         store(file_url, 2, **fkw))  # fmt: skip
        redis_tier = Tier("redis", store(redis_url, 1), store(redis_url, 2))
        tiers = [file_tier, redis_tier]
        outsider = {t.name: store(u, 3, cluster_key=None) for t, u in ((file_tier, file_url), (redis_tier, redis_url))}
        assert file_tier.store.authenticated and redis_tier.store.authenticated is keyed
        for t in tiers:
            t.feed = t.store.publish_events(publisher, audit_interval=None)  # audits run here, when the test says
        router = Router(publisher, publisher.format, tiers)
        assert {t.where(publisher.format)[0] for t in tiers} == ({"STORAGE"} if keyed else {"DISK", "EXTERNAL"})

        # 1. writes past both capacities: the file tier's LRU evicts (and says so), Redis evicts unseen
        first = router.learn(_keys(0, 40))
        for at in range(0, 40, 4):
            for t in tiers:
                _write(t, first[at : at + 4], at)
        router.settle()
        assert file_tier.feed.counts.get("removed_evicted", 0) == 30 and len(file_tier.feed.held()) == 10
        assert redis_tier.store.get_stats().backend["evicted_keys"] > 0  # Redis' own evictions, unseen
        out = redis_tier.feed.audit()
        assert out["removed"] > 0 and out["checked"] == 40, out  # what Redis dropped, found by the audit
        router.settle()

        # 2. reads: what is there is seen (announced already), what is gone is removed
        for t in tiers:
            results = _read(t, first[-8:])
            assert all(r.ok or r.status is PageStatus.MISSING for r in results), results
        router.settle()

        # 3. overwrites: the same keys written again (the file tier's LRU order changes, Redis may evict)
        for t in tiers:
            _write(t, first[-6:-2], 3)
        router.settle()

        # 4. an outsider forges a page over a held one, and one under a key the cluster never wrote.
        # Redis' LRU clock ticks once a second, so at its limit it may evict the page just forged: the
        # limit is lifted while the forgery is read back, and set again after.
        admin = redis_tier.store.backend.client
        admin.config_set("maxmemory", 0)
        forged, planted = {}, router.learn(_keys(9000, 1))[0]
        for t in tiers:
            ns = t.store.namespace
            # two of the pages just written again (the last an LRU evicts), there now
            there = [k for k, p in zip(first[-6:-2], t.store.backend.exists_objects(ns.keys(first[-6:-2]))) if p]
            assert len(there) >= 2 and set(there) <= t.feed.held(), there
            forged[t.name], source = there[-2:]
            _forge(outsider[t.name], ns.key(forged[t.name]), ns.key(source))
            _forge(outsider[t.name], ns.key(planted), ns.key(source))
            t.written.add(planted)
            results = _read(t, [forged[t.name], planted])
            # refused: a keyed store fails the MAC, a keyless one finds the object names another key
            assert [r.status for r in results] == [PageStatus.AUTH_FAILED if t.store.authenticated
                                                   else PageStatus.MISMATCH] * 2, (t.name, results)  # fmt: skip
            assert forged[t.name] not in t.feed.held(), t.name
        admin.config_set("maxmemory", REDIS_MAXMEMORY)
        router.settle()
        assert planted not in router.announced  # never announced: no BlockStored names it, ever (checked at the end)

        # 5. a router joins late: the snapshot, then the stream
        router.join_late()
        router.settle()

        # 6. a weight update on Redis: every page of the old weights is removed; new ones are written
        for s in (redis_tier.store, redis_tier.checker):
            assert s.set_weight_version("v2")
        assert not redis_tier.feed.held()
        second = router.learn(_keys(20000, 12))
        _write(redis_tier, second[:12], 0)
        router.settle()

        # 7. a key rotation on the file tier: its pages under the old key are removed; new ones are written
        rotated = ClusterKey(ROTATED, "rotated key")
        old_held = file_tier.feed.held()
        for s in (file_tier.store, file_tier.checker):
            s.rotate_cluster_key(rotated)
        assert old_held and not file_tier.feed.held()
        _write(file_tier, second[:6], 0)
        # the old pages the LRU kept are there, and refused: written under the old key
        statuses = [r.status for r in _read(file_tier, sorted(old_held - set(second)))]
        assert PageStatus.AUTH_FAILED in statuses and set(statuses) <= {PageStatus.AUTH_FAILED, PageStatus.MISSING}
        router.settle()

        # 8. Redis killed with its data saved, then restarted with it: removed while unreachable, then back
        redis_tier.feed.audit()  # what Redis evicted since the writes, out first
        before = redis_tier.feed.held()
        redis_tier.store.backend.client.save()
        server.stop()
        assert redis_tier.feed.audit()["removed"] == len(before) and not redis_tier.feed.reachable
        router.settle()
        server.start()
        for s in (redis_tier.checker, *outsider.values()):
            _reconnect(s)
        assert _audit_until_reachable(redis_tier)["restored"] == len(before)
        assert redis_tier.feed.held() == before
        router.settle()

        # 9. killed again, and restarted empty: nothing comes back
        server.stop()
        redis_tier.feed.audit()
        (tmp_path / "redis" / "dump.rdb").unlink()
        server.start()
        _reconnect(redis_tier.checker)
        assert _audit_until_reachable(redis_tier)["restored"] == 0 and not redis_tier.feed.held()
        router.settle()

        # 10. writes past both capacities again: the run ends with evictions of both kinds outstanding
        evicted = redis_tier.store.get_stats().backend["evicted_keys"]
        third = router.learn(_keys(30000, 40))
        for at in range(0, 40, 4):
            for t in tiers:
                _write(t, third[at : at + 4], at)
        router.settle()
        assert redis_tier.store.get_stats().backend["evicted_keys"] > evicted == 0  # a new server, evicting again

        # After the run: a last audit pass, every event in, each index against each store.
        for t in tiers:
            t.feed.audit()
        router.settle()
        figures = {t.name: _assert_agrees(router, t) for t in tiers}
        assert planted not in router.announced
        assert router.stored_checks.get("ok", 0) > 0 and set(router.stored_checks) <= {"ok", "missing"}
        assert figures["file"]["early"] == figures["file"]["late"] == FILE_CAPACITY_PAGES
        assert 0 < figures["redis"]["early"] == figures["redis"]["late"] < 40
        assert router.late is not None and router.late.synced
    finally:
        if router is not None:
            router.close()
        for s in opened:
            s.close()
        publisher.close()
        server.stop()
