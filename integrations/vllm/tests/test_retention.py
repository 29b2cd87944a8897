"""Retention through vLLM's front door: request hints, the host tier's lease-aware policy, leases carried to L3.

* The policy alone (vLLM's own ``CachePolicy`` calls) against an oracle written from the order rules of
  docs/retention.md, not from the policy's code: superseded pages first, ordinary pages least recently used
  first (vLLM's LRU: a finished request's head is its most recent key), protected pages lightest first; the
  cap; vLLM's ``protected`` keys and pinned chunks never evicted; an eviction that cannot be met changes nothing.
* Malformed hints refused with messages naming them, by the real manager.
* vLLM's real manager and hicache's worker over a real ``file://`` store: the store job carries the lease to
  L3; a leased page the host tier evicts counts demoted where L3 holds it, dropped where it does not.
* vLLM's own offline engine (``retention_driver.py``): a session's prompt sent with a lease keeps its pages in
  a ``file://?capacity=`` store that later prompts overflow, where the same run without the hint loses them;
  a malformed hint is refused (logged, counted) and its request served without a lease.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import secrets
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the retention tests run in integrations/vllm/dev's environment")

from hicache_vllm.config import HicacheOptions  # noqa: E402
from hicache_vllm.mover import BlockMover  # noqa: E402
from hicache_vllm.retention import HicacheCachePolicy, host_policy_name, parse_request_hints, request_hints  # noqa: E402
from hicache_vllm.spec import (  # noqa: E402
    HicacheLoadStoreSpec,
    HicacheOffloadingManager,
    HicacheOffloadingWorker,
    StorageProbe,
    storage_key,
)
from test_mover import BLOCK, finish, pages_of, vllm_cache  # noqa: E402
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope  # noqa: E402
from vllm.v1.kv_offload.base import GPULoadStoreSpec, OffloadKey, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy  # noqa: E402
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus  # noqa: E402
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy  # noqa: E402

from hicache_core.retention import Retain  # noqa: E402
from hicache_core.retention.hints import RetentionHints, hints_from_mapping  # noqa: E402

CAP = 0.5  # HICACHE_RETENTION_CAP's default


def key(n: int) -> OffloadKey:
    return make_offload_key(hashlib.sha256(f"block {n}".encode()).digest(), 0)


def ctx(req_id: str, hicache: dict | None = None, **params) -> ReqContext:
    kv = dict(params)
    if hicache is not None:
        kv["hicache"] = hicache
    return ReqContext(req_id=req_id, kv_transfer_params=kv or None)


# ---- the oracle: the order rules, for pages of size 1 -----------------------------------------------------


class Oracle:
    """What a host tier of ``capacity`` chunks evicts, from the rules alone."""

    def __init__(self, capacity: int) -> None:
        self.room = CAP * capacity
        self.recency: list[OffloadKey] = []  # least recently used first
        self.evictable: set[OffloadKey] = set()
        self.leases: list[dict] = []  # in grant order

    def insert(self, k: OffloadKey) -> None:
        self.recency.append(k)
        self.evictable.add(k)

    def finished(self, keys: list[OffloadKey], hint: dict | None) -> None:
        held = [k for k in keys if k in self.recency]
        for k in reversed(held):  # vLLM's LRU: the request's head ends up the most recently used
            self.recency.remove(k)
            self.recency.append(k)
        if not hint:
            return
        if hint.get("supersede"):
            for lease in self.leases:
                if lease["session"] == hint["session"]:
                    lease["superseded"] = True
        if "ttl" in hint and held:
            self.leases.append({"keys": held, "priority": hint.get("priority", 50), "session": hint.get("session"),
                                "superseded": False})  # fmt: skip

    def order(self) -> list[OffloadKey]:
        weight: dict[OffloadKey, float] = {}
        for lease in self.leases:
            for k in lease["keys"]:
                weight[k] = max(weight.get(k, -2), -1 if lease["superseded"] else lease["priority"])
        first = {k for k, w in weight.items() if w < 0}
        protected: dict[OffloadKey, float] = {}
        room = self.room
        live = [(i, lease) for i, lease in enumerate(self.leases) if not lease["superseded"]]
        for _, lease in sorted(live, key=lambda il: (-il[1]["priority"], il[0])):  # heaviest, then oldest first
            for k in lease["keys"]:  # a lease that does not fit keeps its head
                if k in protected or k in first:
                    continue
                if room < 1:
                    break
                room -= 1
                protected[k] = weight[k]
            if room <= 0:
                break
        at = {k: i for i, k in enumerate(self.recency)}
        return ([k for k in self.recency if k in first]
                + [k for k in self.recency if k not in first and k not in protected]
                + sorted(protected, key=lambda k: (protected[k], at[k])))  # fmt: skip

    def evict(self, n: int, skip: set[OffloadKey]) -> list[OffloadKey] | None:
        chosen = [k for k in self.order() if k in self.evictable and k not in skip][:n]
        if len(chosen) < n:
            return None
        for k in chosen:
            self.recency.remove(k)
            self.evictable.discard(k)
            for lease in self.leases:
                if k in lease["keys"]:
                    lease["keys"].remove(k)
        self.leases = [lease for lease in self.leases if lease["keys"]]
        return chosen


class Tier:
    """The policy driven through vLLM's CachePolicy calls, beside the oracle."""

    def __init__(self, capacity: int, policy_cls=HicacheCachePolicy) -> None:
        self.policy = policy_cls(capacity)
        self.oracle = Oracle(capacity)
        self.next_chunk = 0
        self.requests = 0

    def store(self, keys: list[OffloadKey]) -> None:
        for k in keys:  # a store: inserted not ready, then complete (ref_cnt 0: evictable)
            chunk = ChunkStatus(self.next_chunk)
            self.next_chunk += 1
            self.policy.insert(k, chunk)
            chunk.ref_cnt = 0
            self.policy.mark_evictable(k)
            self.oracle.insert(k)

    def finish(self, keys: list[OffloadKey], hint: dict | None = None, reused: bool = True) -> None:
        self.requests += 1
        self.policy.on_request_finished((tuple(keys),), set(), set(keys) if reused else set(),
                                        ctx(f"r{self.requests}", hint))  # fmt: skip
        self.oracle.finished(keys, hint)

    def pin(self, k: OffloadKey) -> None:  # a load in flight: ref_cnt 0 -> 1
        self.policy.get(k).ref_cnt = 1
        self.policy.mark_non_evictable(k)
        self.oracle.evictable.discard(k)

    def evict(self, n: int, protected: set[OffloadKey] = frozenset()) -> list[OffloadKey] | None:
        got = self.policy.evict(n, set(protected))
        want = self.oracle.evict(n, set(protected))
        keys = None if got is None else [k for k, _ in got]
        assert keys == want, (keys, want)
        return keys


# ---- (a) the policy against the oracle ---------------------------------------------------------------------


def test_without_leases_the_policy_is_vllms_lru():
    ours, theirs = Tier(8), Tier(8, LRUCachePolicy)
    keys = [key(i) for i in range(8)]
    for t in (ours, theirs):
        t.store(keys)
        t.finish(keys[2:5])
        t.finish(keys[6:8], reused=False)
    for n, protected in ((2, set()), (1, {keys[1]}), (3, set())):
        a, b = ours.policy.evict(n, protected), theirs.policy.evict(n, protected)
        assert [k for k, _ in a] == [k for k, _ in b]
        assert [c.chunk_id for _, c in a] == [c.chunk_id for _, c in b]
    assert ours.policy.evict(5, set()) is None and theirs.policy.evict(5, set()) is None


def test_superseded_first_then_lru_then_protected_lightest_first():
    t = Tier(12)
    a, b, c, d = ([key(10 * r + i) for i in range(3)] for r in range(4))
    t.store(a + b + c + d)
    t.finish(a, {"priority": 30, "ttl": "10m", "session": "s1"})
    t.finish(b, {"priority": 80, "ttl": "10m", "session": "s2"})
    t.finish(c, {"priority": 40, "ttl": "10m", "session": "s1", "supersede": True})  # a is s1's old state
    t.finish(d)  # ordinary, and the most recently used
    # a (superseded) goes before d (ordinary, newer than everything); then the protected, lightest (c) first.
    assert t.evict(4) == [*reversed(a), d[2]]
    assert t.evict(4) == [d[1], d[0], c[2], c[1]]
    assert t.evict(3) == [c[0], b[2], b[1]]


def test_the_cap_protects_the_heaviest_leases_heads_only():
    t = Tier(10)  # the cap: 5 chunks protected
    light, heavy, other = [key(i) for i in range(3)], [key(10 + i) for i in range(4)], [key(20 + i) for i in range(3)]
    t.store(light + heavy + other)
    t.finish(light, {"priority": 20, "ttl": "10m", "session": "a"})
    t.finish(heavy, {"priority": 90, "ttl": "10m", "session": "b"})
    t.finish(other)
    stats = t.policy.stats()
    assert (stats["pages_leased"], stats["pages_protected"], stats["cap_units"]) == (7, 5, 5.0)
    # heavy's 4 and light's head are protected; light's other 2 are ordinary (over the cap), and older than `other`
    assert t.evict(5) == [light[2], light[1], other[2], other[1], other[0]]
    assert t.evict(5) == [light[0], heavy[3], heavy[2], heavy[1], heavy[0]]


def test_vllms_protected_keys_and_pinned_chunks_are_never_evicted():
    t = Tier(6)
    keys = [key(i) for i in range(6)]
    t.store(keys)
    t.finish(keys[:3], {"priority": 60, "ttl": "10m", "session": "s"})
    t.pin(keys[3])
    assert t.evict(2, protected={keys[4]}) == [keys[5], keys[2]]
    assert t.evict(2, protected={keys[1]}) == [keys[4], keys[0]]
    assert t.evict(1, protected={keys[1]}) is None  # keys[3] is pinned, keys[1] protected: nothing to give


def build_failure_twins():
    twins = []
    for _ in range(2):
        t = Tier(8)
        keys = [key(i) for i in range(8)]
        t.store(keys)
        t.finish(keys[:4], {"priority": 70, "ttl": "10m", "session": "s1"})
        t.finish(keys[4:6], {"priority": 10, "ttl": "10m", "session": "s2", "supersede": True})
        t.pin(keys[7])
        twins.append((t, keys))
    return twins


def test_an_eviction_that_cannot_be_met_changes_nothing():
    (t, keys), (twin, _) = build_failure_twins()
    before = t.policy.stats()
    assert t.evict(8) is None  # 8 chunks, one pinned
    assert t.evict(3, protected=set(keys[:6])) is None
    assert t.policy.stats() == before
    assert sorted(t.policy.chunks) == sorted(twin.policy.chunks)
    # the same evictions afterwards, in the same order, as the tier that never tried
    for n in (2, 3, 2):
        assert t.evict(n) == twin.evict(n)


@pytest.mark.parametrize("seed", range(12))
def test_random_traffic_matches_the_oracle(seed):
    rng = random.Random(seed)
    capacity = rng.randint(6, 16)
    t = Tier(capacity)
    fresh = iter(range(10_000))
    held: list[OffloadKey] = []
    for _ in range(40):
        room = capacity - len(t.policy.chunks)
        if room and rng.random() < 0.5:
            new = [key(next(fresh)) for _ in range(rng.randint(1, room))]
            t.store(new)
            held += new
        live = [k for k in held if k in t.policy.chunks]
        if live and rng.random() < 0.7:
            start = rng.randrange(len(live))
            request = live[start : start + rng.randint(1, 5)]
            lease = {"priority": rng.randint(0, 100), "ttl": "10m", "session": rng.choice(["s1", "s2", "s3"]),
                     "supersede": rng.random() < 0.3}  # fmt: skip
            hint = rng.choice([None, {}, {"session": "s1"}, lease])
            t.finish(request, hint)
        if live and rng.random() < 0.2:
            k = rng.choice(live)
            if k in t.policy._evictable:
                t.pin(k)
        if live and rng.random() < 0.6:
            protected = set(rng.sample(live, rng.randint(0, min(3, len(live)))))
            t.evict(rng.randint(1, max(1, len(live) // 2)), protected)


# ---- (b) hints ---------------------------------------------------------------------------------------------


def test_hints_from_kv_transfer_params_cache_control_and_kv_hints():
    assert parse_request_hints(None) == RetentionHints()
    assert parse_request_hints({"do_remote_prefill": False}) == RetentionHints()
    got = parse_request_hints({"hicache": {"priority": 90, "ttl": "10m", "session": "s1", "supersede": True}})
    assert got == RetentionHints(Retain(90, 600.0, "s1"), supersede=True, session="s1")
    got = parse_request_hints({"hicache": {"session": "s1"}, "cache_control": {"type": "ephemeral", "ttl": "5m"}})
    assert got == RetentionHints(Retain(50, 300.0, "s1"), session="s1")
    action = KvHintAction(action_id="a1", action_type="hicache.retain", action_version="1",
                          payload={"ttl": 120, "session": "s2"})  # fmt: skip
    other = KvHintAction(action_id="x", action_type="someone.else", action_version="7", payload={"anything": 1})
    got = parse_request_hints(None, KvHintsEnvelope(protocol_version="1", message_id="m", actions=[other, action]))
    assert got == RetentionHints(Retain(50, 120.0, "s2"), session="s2")
    assert hints_from_mapping({"session": "s3"}) == RetentionHints(session="s3")


def envelope(*payloads, version="1"):
    return KvHintsEnvelope(protocol_version="1", message_id="m", actions=[
        KvHintAction(action_id=f"a{i}", action_type="hicache.retain", action_version=version, payload=p)
        for i, p in enumerate(payloads)])  # fmt: skip


HC = "kv_transfer_params['hicache']"


@pytest.mark.parametrize(("params", "hints", "message"), [
    ({"hicache": {"priority": 90, "ttl": "10m", "pinned": True}}, None,
     f"{HC} has fields hicache does not know: pinned (known: priority, ttl, session, supersede)"),
    ({"hicache": {"priority": 101, "ttl": "10m"}}, None, f"{HC}: a lease's priority is 0..100, got 101"),
    ({"hicache": {"priority": 90}}, None, f"{HC}.priority needs {HC}.ttl: every lease has an end"),
    ({"hicache": {"ttl": "5 minutes"}}, None, "'30s', '5m', '1h'; got '5 minutes'"),
    ({"hicache": {"ttl": "10m", "supersede": "yes"}}, None, ".supersede is true or false, got 'yes'"),
    ({"hicache": {"supersede": True}}, None, ".supersede needs kv_transfer_params['hicache'].session"),
    ({"hicache": {"session": ""}}, None, ".session is a non-empty text of at most 256 characters, got ''"),
    ({"hicache": ["ttl", "5m"]}, None, "kv_transfer_params['hicache'] is an object with fields priority, ttl"),
    ({"hicache": {"ttl": "1m"}, "cache_control": {"type": "ephemeral"}}, None, "a lease is asked twice"),
    ({"cache_control": {"type": "persistent"}}, None, "cache_control type 'persistent' is not supported"),
    ({"hicache": {"session": "s"}}, envelope({"ttl": 5}), "both kv_transfer_params and kv_hints"),
    (None, envelope({"ttl": 5}, {"ttl": 6}), "kv_hints has 2 'hicache.retain' actions ('a0', 'a1')"),
    (None, envelope({"ttl": 5}, version="2"), "action_version '2' is not served (hicache reads version '1'"),
    (None, envelope({"ttl": 5, "prefetch": True}), "kv_hints action 'a0' (hicache.retain) payload has fields hicache"),
])  # fmt: skip
def test_malformed_hints_are_refused_naming_them(params, hints, message):
    with pytest.raises(ValueError) as err:
        parse_request_hints(params, hints)
    assert message in str(err.value)


def manager(num_chunks: int = 8, storage=None, policy: str = "lru") -> HicacheOffloadingManager:
    return HicacheOffloadingManager(storage=storage, num_chunks=num_chunks, cache_policy=host_policy_name(policy),
                                    store_threshold=0)  # fmt: skip


def test_the_manager_refuses_a_malformed_hint_when_the_request_arrives():
    from hicache_vllm.retention import refused_hints

    m = manager()
    before = refused_hints.count
    bad = ctx("req-7", {"priority": 90, "ttl": "10m", "session": "s1", "pinned": True})
    m.on_new_request(bad)  # never raises: vLLM would end the EngineCore, and every request with it
    assert refused_hints.count == before + 1 and refused_hints[-1] == "req-7"
    assert m.retention_stats()["leases"] == 0
    assert not request_hints(bad)  # the request has no lease, whole: no field of the hint was taken


def test_lru_is_hicaches_policy_and_arc_stays_vllms():
    assert type(manager()._policy) is HicacheCachePolicy
    assert type(manager(policy="arc")._policy) is ARCCachePolicy
    assert manager(policy="arc").retention_stats() is None


# ---- the manager and the worker over a real file:// store -------------------------------------------------


def store_request(m: HicacheOffloadingManager, w: HicacheOffloadingWorker, c: ReqContext, keys, job: int,
                  blocks: list[int]) -> HicacheLoadStoreSpec:  # fmt: skip
    out = m.prepare_store(keys, c)
    assert out is not None and list(out.keys_to_store) == list(keys)
    spec = out.store_spec
    w.submit_store(job, GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[0]), spec)
    finish(w.mover, {job})
    m.complete_store(keys, c)
    return spec


@pytest.fixture
def tiers(tmp_path):
    url = f"file://{tmp_path / 'l3'}?capacity=1GiB"
    cache = vllm_cache(3)
    mover = BlockMover(pages_of(cache), block_size=BLOCK, num_chunks=6, storage_url=url, model_id="tiny")
    probe = StorageProbe(HicacheOptions(storage_url=url), num_layers=len(cache), page_bytes=pages_of(cache)[0].shape[1],
                         block_size=BLOCK, model_id="tiny")  # fmt: skip
    m = manager(num_chunks=6, storage=probe)
    try:
        yield m, HicacheOffloadingWorker(mover), mover.storage, tmp_path / "l3"
    finally:
        m.shutdown()
        mover.shutdown()


def test_store_jobs_carry_the_lease_to_l3_and_evicted_leased_pages_count_demoted_or_dropped(tiers):
    m, w, store, root = tiers
    keys = [key(100 + i) for i in range(5)]
    hint = {"priority": 90, "ttl": "10m", "session": "s1"}
    c1 = ctx("r1", hint)
    m.on_new_request(c1)
    spec = store_request(m, w, c1, keys[:3], 1, [0, 1, 2])
    assert spec.lease == RetentionHints(Retain(90, 600.0, "s1"), session="s1")
    store_request(m, w, c1, keys[3:], 2, [3, 4])
    m.on_request_finished(c1)
    # L3: the worker granted the request's lease on the pages each job wrote (two jobs, two leases of s1)
    l3 = store.leases.stats()
    assert (l3["leases"], l3["pages_leased"], l3["pages_protected"], store.eviction) == (2, 5, 5, "ordered")
    assert all(store.leases.leased(store.namespace.key(storage_key(k))) for k in keys)
    # the host tier: one lease on the 5 pages in prefix order; 6 chunks, so 3 protected (the head)
    host = m.retention_stats()
    assert (host["leases"], host["pages_leased"], host["pages_protected"], host["capped"]) == (1, 5, 3, 2)
    # L3 lost keys[4] (as its own eviction would): the host tier's eviction of it is a drop, of keys[3] a demotion
    (gone,) = [p for p in root.rglob("*.page") if p.name.startswith(storage_key(keys[4]))]
    gone.unlink()
    c2 = ctx("r2")
    m.on_new_request(c2)
    out = m.prepare_store([key(200), key(201), key(202)], c2)  # one free chunk: two evicted
    assert out is not None and out.evicted_keys == [keys[4], keys[3]]  # ordinary (over the cap), tail first
    assert out.store_spec.lease is None
    host = m.retention_stats()
    assert (host["demoted"], host["dropped_under_lease"], host["pages_leased"]) == (1, 1, 3)
    why = m._policy.book.why_dropped(keys[4])
    assert why.startswith("evicted from vLLM host tier under lease 1 (priority 90, ttl 600 s")
    assert "over the tier's retention cap" in why
    stats = m.get_stats().reduce()
    assert stats["vllm:hicache_host_leases"] == 1 and stats["vllm:hicache_host_pages_protected"] == 3
    assert stats["vllm:hicache_host_pages_demoted"] == 1 and stats["vllm:hicache_host_pages_dropped_under_lease"] == 1
    assert stats["vllm:hicache_host_leases_granted"] == 1
    assert "vllm:hicache_host_leases_granted" not in m.get_stats().reduce()  # a counter reports what it gained


def test_supersede_reaches_l3_once_per_request_and_a_session_turn_refreshes(tiers):
    m, w, store, _ = tiers
    c1 = ctx("r1", {"priority": 40, "ttl": "10m", "session": "s1"})
    m.on_new_request(c1)
    store_request(m, w, c1, [key(1), key(2)], 1, [0, 1])
    m.on_request_finished(c1)
    c2 = ctx("r2", {"priority": 40, "ttl": "10m", "session": "s1", "supersede": True})
    m.on_new_request(c2)  # a new turn of s1: its host leases live on
    assert m.retention_stats()["refreshed"] == 1
    first = store_request(m, w, c2, [key(3)], 2, [2])
    second = store_request(m, w, c2, [key(4)], 3, [3])
    assert (first.lease.supersede, second.lease.supersede) == (True, False)
    m.on_request_finished(c2)
    l3 = store.leases.stats()
    # r1's lease superseded by r2's first job; r2's two jobs' leases stand
    assert (l3["leases"], l3["superseded"], l3["pages_superseded"], l3["pages_protected"]) == (3, 1, 2, 2)
    host = m.retention_stats()
    assert (host["leases"], host["superseded"], host["pages_superseded"], host["pages_protected"]) == (2, 1, 2, 2)


# ---- (c) vLLM's own offline engine ---------------------------------------------------------------------------

#: A file:// page of tiny_model's Llama: the 4 KiB header block and 2 layers of 8 KiB (the checksum row of a
#: verified page adds 16 bytes); the store holds 20 pages, its leases may protect 10: one session's 8 fit.
PAGE_ON_DISK = 4096 + 2 * 8192 + 64
L3_PAGES = 20

ENGINE_CONFIGS = {
    "defaults": {},
    "verified-keyed": {"HICACHE_VERIFY": "1"},  # with HICACHE_L3_KEY_FILE, set per session below
}


@pytest.fixture(scope="session")
def session_run(model, tmp_path_factory):
    """``session_run(mode, config)``: retention_driver.py's record of one engine (once each), and its L3 dir."""
    from vllm_run import run_python, tail

    key_file = tmp_path_factory.mktemp("cluster-key") / "cluster.key"
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    cache: dict = {}

    def go(mode: str, config: str = "defaults") -> tuple[dict, Path, str]:
        if (mode, config) not in cache:
            out = tmp_path_factory.mktemp(f"{mode}-{config}")
            root = out / "l3"
            root.mkdir()
            log = out / "engine.log"
            env = dict(ENGINE_CONFIGS[config])
            if config == "verified-keyed":
                env["HICACHE_L3_KEY_FILE"] = str(key_file)
            args = ["-m", "retention_driver", mode, str(out / "result.json"), str(model), str(root),
                    str(L3_PAGES * PAGE_ON_DISK)]  # fmt: skip
            rc = run_python(args, log, timeout=480, extra_env=env)
            assert rc == 0, f"{mode} engine exited {rc}:\n{tail(log)}"
            record = json.loads((out / "result.json").read_text())
            cache[(mode, config)] = (record, root, log.read_text(errors="replace"))
        return cache[(mode, config)]

    return go


def on_disk(root: Path) -> set[str]:
    return {p.name.removesuffix(".page") for p in root.rglob("*.page")}


@pytest.mark.parametrize(("config", "mode"), [("defaults", "retain"), ("verified-keyed", "cache_control")])
def test_a_leased_session_keeps_its_pages_in_l3_where_lru_evicts_them(session_run, config, mode):
    """Session s1's prompt (8 pages) is sent with a lease, then s0's (8 pages, more recent) without, then three
    prompts (24 pages) overflow the 20-page ``file://`` store and the 24-chunk host tier. With the lease, s1's
    pages are all still in the store (its files, and its lease in the worker's store), s0's are gone, and s1
    comes back whole from the host tier, token for token; the same run without the hint keeps none of them."""
    leased, root, log = session_run(mode, config)
    plain, plain_root, _ = session_run("plain")
    steps, base = leased["steps"], plain["steps"]
    s1 = set(steps["s1"]["pages"])
    s0 = set(steps["s0"]["pages"]) - s1
    assert len(s1) == len(s0) == 8, (len(s1), len(s0))
    assert set(base["s1"]["pages"]) == s1, "the two runs store the same pages under the same keys"
    end = set(steps["other 3"]["pages"])
    assert len(end) == L3_PAGES and s1 <= end and not s0 & end
    assert s1 <= on_disk(root)  # read from the store's directory itself, after the engine exited
    assert not set(base["other 3"]["pages"]) & (s1 | s0), "LRU should have evicted both sessions' pages"
    assert s1 <= on_disk(plain_root), "the plain run computed s1 again and wrote it back"
    l3 = leased["l3_leases"]
    priority = 90 if mode == "retain" else 50  # a cache_control lease weighs 50
    assert l3["weights"] == dict.fromkeys(s1, priority) and l3["eviction"] == "ordered"
    assert (l3["stats"]["leases"], l3["stats"]["pages_protected"], l3["stats"]["dropped_under_lease"]) == (1, 8, 0)
    sizes = {p.stat().st_size for p in root.rglob("*.page") if p.name.removesuffix(".page") in s1}
    verified = config == "verified-keyed"  # its pages carry their checksum row: 8 bytes a layer
    assert sizes == {4096 + 2 * 8192 + (16 if verified else 0)}, sizes
    assert l3["stats"]["protected_units"] == 8 * sizes.pop()
    # the host tier kept s1 too: it comes back whole, from the host tier, as the engine first answered it
    again = steps["s1 again"]
    assert again["cached"] == 256 and base["s1 again"]["cached"] == 0
    assert again["metrics"]["vllm:prompt_tokens_cached_by_source{source=host}"] == 256
    assert again["tokens"] == steps["s1"]["tokens"] == base["s1"]["tokens"]
    host = again["metrics"]
    assert host["vllm:hicache_host_leases_granted"] >= 1 and host["vllm:hicache_host_pages_protected"] == 8
    assert host.get("vllm:hicache_host_pages_dropped_under_lease", 0) == 0
    assert "vllm:hicache_host_leases_granted" not in base["s1 again"]["metrics"] or (
        base["s1 again"]["metrics"]["vllm:hicache_host_leases_granted"] == 0)  # fmt: skip
    assert ("UNAUTHENTICATED" in log) == (not verified), "the keyed run writes with the cluster key"


def test_a_malformed_hint_is_refused_and_the_engine_serves_on(session_run):
    """vLLM 0.32 has no per-request error path from an offloading manager (an exception there ends the
    EngineCore): a malformed hint is refused whole, logged as an error naming the request and the field, and
    counted; the request is served without a lease, token for token as without the hint, and so is the next."""
    record, root, log = session_run("malformed")
    plain, _, _ = session_run("plain")
    assert "retention hint refused: kv_transfer_params['hicache'] has fields hicache does not know: pinned" in log
    assert "the request is served without a lease" in log
    assert "EngineCore encountered a fatal error" not in log
    steps = record["steps"]
    assert steps["s1"]["tokens"] == plain["steps"]["s1"]["tokens"]
    assert steps["s0"]["tokens"] == plain["steps"]["s0"]["tokens"]
    assert steps["s0"]["metrics"]["vllm:hicache_host_hints_refused"] == 1
    assert record["l3_leases"]["stats"]["leases"] == 0 and not record["l3_leases"]["weights"]
    assert set(steps["s1"]["pages"]) <= on_disk(root), "the request was served and its pages stored, unleased"
