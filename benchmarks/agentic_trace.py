"""Agent sessions kept warm: LRU against hicache's retention leases on an agentic trace, host and L3 oversubscribed.

    python benchmarks/agentic_trace.py                                  # a few minutes on a 2-core CPU
    python benchmarks/agentic_trace.py --quick --out /tmp/agentic.json   # seconds

The policy under test is hicache's own code: each tier is a real
:class:`~hicache_core.retention.RetentionQueue` (hicache's eviction queue) and, under ``retention``, a real
:class:`~hicache_core.retention.LeaseBook` (leases, the cap, decay, refresh on a hit, ends), on a simulated
clock passed to the book. Only time and bytes are simulated: a page is a key of size 1 (64 tokens), and a
turn's model time is drawn, not run.

The trace (seeded; every parameter is written into the JSON):

* sessions arrive as a Poisson process at the rate that keeps ``live_sessions`` live on average (Little's law
  on the drawn lifetimes); each picks one of a few shared system prompts (the shared head, Zipf popularity);
* turns per session: lognormal, median 43; the context at the last turn: lognormal, median 142K tokens (the
  published agent statistics the issue cites); the context grows by a gamma-distributed share per turn (tool
  outputs, the model's replies); a turn's prompt is the whole context so far, so prefix reuse is > 96 %;
* between two requests of a session: the model's time (lognormal, median 6 s) and a tool pause from a
  heavy-tailed mixture (most tool calls take seconds; a share are slow tools or a human: median 75 s, tail to
  30 min), so most pauses are under a minute and some are several minutes;
* a share of sessions is abandoned at a random turn: no release, their leases must end on their own; a
  session that finishes releases its leases.

A turn: the prompt's pages are looked up in chain order (host, then L3; an L3 hit is copied to host, L3 keeps
its copy), and since a prefix is only usable up to its first gap, every page from the first miss on is
recomputed and stored to host, which evicts as its queue orders; every host victim is written to L3 (both
policies: hicache backs pages up; under a lease through the queue's ``demote``), and L3's victims leave the
system. Under ``retention`` each turn re-grants the session's lease on its whole prompt in both tiers
(``release`` then ``retain``: one lease per session and tier, priority 50, TTL 5 min, the cap and decay at
their defaults), once its pages are written, as vLLM's integration grants at a request's end (``--grant-at
request``: before); a session that finishes releases its leases, an abandoned one says nothing. Other rows of
the record: the cap at 1, agents' hints (priority 70 while waiting on a tool, 20 while waiting on a slow tool or
a human: what the agent knows when its turn ends), the other grant time, the tiers at the live working set
(1x), and ``oracle``: not a policy but what an eviction order that knows every next use reaches on the same
trace, so what no policy can pass.

The simulated day (a second trace, fewer live sessions so that it runs in minutes): live leases and leases past
their session's end every 5 minutes, and every hour what the queues and books hold (their deep size, the keys
the books track against what live leases may hold, the process's RSS). ``--quick``: seconds, a smoke run.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import gc
import json
import math
import random
import statistics
import sys
import time
import tracemalloc
import types
from collections.abc import Callable, Hashable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hicache_core.retention import LeaseBook, Retain, RetentionQueue

#: Tokens per page (hicache's and SGLang's usual page; ``kv_routing.py`` uses the same).
PAGE = 64
#: Page keys are ints: an owner (a shared head, or a session) in the high bits, the page's index below.
OWNER_SHIFT = 24
#: Owners from here on are sessions; below, shared heads.
SESSION_OWNER0 = 1 << 10
#: The gaps between two requests of a session that the hit rates are broken down by (seconds).
GAP_BINS = (0, 10, 30, 60, 120, 300, 450, 900, math.inf)
POLICIES = ("lru", "retention")
#: What tracemalloc counts as the retention code's memory: blocks allocated in its files (leases, books, queues).
RETENTION_CODE = tracemalloc.Filter(True, "*hicache_core/retention/*")


# ---- the trace ---------------------------------------------------------------------------------------


@dataclass
class TraceParams:
    """What sessions look like; the defaults follow the published agent statistics the issue cites."""

    seed: int = 54
    live_sessions: float = 24.0  # sessions live on average (arrival rate = this / mean lifetime)
    turns_median: float = 43.0
    turns_sigma: float = 0.5
    turns_clip: tuple[int, int] = (4, 200)
    context_median_tokens: float = 142_000.0  # the context at a session's last turn
    context_sigma: float = 0.35
    context_clip: tuple[int, int] = (30_000, 400_000)
    heads: int = 4  # shared system prompts (tools, instructions): every session of an agent starts with one
    head_tokens: tuple[int, int] = (8_192, 16_384)
    head_zipf: float = 1.0
    task_median_tokens: float = 300.0  # the user's first message, after the shared head
    task_sigma: float = 1.2
    min_append_tokens: int = 64  # a later turn adds at least a reply and a tool call's framing
    append_shape: float = 0.6  # gamma shape of each turn's share of the growth (< 1: a few large tool outputs)
    model_median_s: float = 6.0  # prefill and decode of one turn
    model_sigma: float = 0.5
    tool_median_s: float = 4.0  # most pauses: a tool call
    tool_sigma: float = 1.0
    slow_share: float = 0.12  # pauses from a slow tool or a human in the loop
    slow_median_s: float = 75.0
    slow_sigma: float = 0.9
    pause_clip_s: tuple[float, float] = (0.5, 1800.0)
    abandon_share: float = 0.15


@dataclass
class Session:
    """One agent session: its shared head, and per turn the request time and the context's whole pages."""

    sid: int
    head: int
    head_pages: int
    times: list[float]
    pages: list[int]  # whole pages of the prompt at each turn (chain order: head pages first)
    tool_pauses: list[float]  # the tool pause before each turn (0 for the first)
    slow_after: list[bool]  # whether the pause after each turn waits on a slow tool or a human (what an agent knows)
    abandoned: bool

    @property
    def end(self) -> float:
        return self.times[-1]

    def key(self, i: int) -> int:
        """Page ``i`` of this session's chain: the shared head's key below ``head_pages``, its own above."""
        owner = self.head if i < self.head_pages else SESSION_OWNER0 + self.sid
        return (owner << OWNER_SHIFT) | i


def _lognormal(rng: random.Random, median: float, sigma: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, rng.lognormvariate(math.log(median), sigma)))


def _draw_session(p: TraceParams, rng: random.Random, sid: int, start: float, head_tokens: list[int],
                  head_weights: list[float]) -> Session:  # fmt: skip
    head = rng.choices(range(p.heads), weights=head_weights)[0]
    turns = int(round(_lognormal(rng, p.turns_median, p.turns_sigma, *p.turns_clip)))
    final = _lognormal(rng, p.context_median_tokens, p.context_sigma, *p.context_clip)
    task = _lognormal(rng, p.task_median_tokens, p.task_sigma, 1, 20_000)
    # What the later turns add, over their floor (a reply and a tool call at the least), shared out at random.
    grow = max(0.0, final - head_tokens[head] - task - (turns - 1) * p.min_append_tokens)
    shares = [rng.gammavariate(p.append_shape, 1.0) for _ in range(turns - 1)]
    total = sum(shares) or 1.0
    times, pauses, slow_after = [start], [0.0], []
    context = head_tokens[head] + task
    pages = [int(context) // PAGE]
    for share in shares:
        slow = rng.random() < p.slow_share
        pause = (_lognormal(rng, p.slow_median_s, p.slow_sigma, *p.pause_clip_s) if slow
                 else _lognormal(rng, p.tool_median_s, p.tool_sigma, *p.pause_clip_s))  # fmt: skip
        model = _lognormal(rng, p.model_median_s, p.model_sigma, 0.5, 600.0)
        times.append(times[-1] + model + pause)
        pauses.append(pause)
        slow_after.append(slow)
        context += p.min_append_tokens + grow * share / total
        pages.append(int(context) // PAGE)
    abandoned = rng.random() < p.abandon_share
    if abandoned:  # stops after a random turn, without a word: nothing releases its leases
        cut = rng.randint(1, turns - 1)
        times, pages, pauses, slow_after = times[:cut], pages[:cut], pauses[:cut], slow_after[:cut]
    else:
        slow_after.append(False)  # the last turn: nothing follows
    return Session(sid, head, head_tokens[head] // PAGE, times, pages, pauses, slow_after, abandoned)


def make_trace(p: TraceParams, duration_s: float) -> list[Session]:
    """Sessions arriving over ``duration_s`` (Poisson), at the rate that keeps ``p.live_sessions`` live."""
    rng = random.Random(p.seed)
    # A head's length is not a whole number of pages: its last partial page holds the session's own text too.
    head_tokens = [rng.randint(*p.head_tokens) for _ in range(p.heads)]
    head_weights = [1.0 / (h + 1) ** p.head_zipf for h in range(p.heads)]
    # Little's law: the rate is the live count over the mean lifetime, from a pilot draw of the same generator.
    pilot = random.Random(p.seed + 1)
    lifetimes = [(s.end - s.times[0]) + p.model_median_s for s in
                 (_draw_session(p, pilot, i, 0.0, head_tokens, head_weights) for i in range(2000))]  # fmt: skip
    rate = p.live_sessions / statistics.fmean(lifetimes)
    sessions, t = [], rng.expovariate(rate)
    while t < duration_s:
        sessions.append(_draw_session(p, rng, len(sessions), t, head_tokens, head_weights))
        t += rng.expovariate(rate)
    return sessions


def trace_stats(sessions: list[Session]) -> dict[str, Any]:
    """What the drawn trace looks like, against the published figures it follows."""
    full = [s for s in sessions if not s.abandoned]
    gaps = [b - a for s in sessions for a, b in zip(s.times, s.times[1:])]
    pauses = [x for s in sessions for x in s.tool_pauses[1:]]
    prompt = reusable = 0
    heads_seen: set[int] = set()
    for s in sorted(sessions, key=lambda x: x.times[0]):
        prompt += sum(s.pages)
        reusable += sum(s.pages[:-1]) + (s.head_pages if s.head in heads_seen else 0)
        heads_seen.add(s.head)
    return {
        "sessions": len(sessions), "abandoned": sum(s.abandoned for s in sessions),
        "turns": sum(len(s.times) for s in sessions),
        "turns_median_finished": statistics.median(len(s.times) for s in full) if full else None,
        "final_context_tokens_median_finished": statistics.median(s.pages[-1] * PAGE for s in full) if full else None,
        "gap_s": _quantiles(gaps), "tool_pause_s": _quantiles(pauses),
        "tool_pause_share_under_60s": sum(x < 60 for x in pauses) / len(pauses) if pauses else None,
        "tool_pause_share_over_300s": sum(x > 300 for x in pauses) / len(pauses) if pauses else None,
        # The share of prompt pages an unbounded cache would serve (the previous turn's pages, a head used
        # before): the trace's ceiling, against the published "over 96 % prefix hits".
        "prefix_reuse_ceiling": reusable / prompt if prompt else None,
    }  # fmt: skip


def _quantiles(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    xs = sorted(xs)
    return {f"p{q}": xs[min(len(xs) - 1, int(q / 100 * len(xs)))] for q in (10, 50, 90, 99)} | {"max": xs[-1]}


def working_set(sessions: list[Session], at: Iterable[float]) -> list[int]:
    """The live working set at each time of ``at``, in pages: the pages stored so far by every live session
    (arrived, with a turn still to come, or at its last turn), plus each shared head in use once."""
    out = []
    starts = sorted((s.times[0], s.sid) for s in sessions)
    for t in at:
        live = [sessions[sid] for st, sid in starts[: bisect.bisect_right(starts, (t, math.inf))]
                if sessions[sid].end >= t]  # fmt: skip
        pages, heads = 0, {}
        for s in live:
            k = bisect.bisect_right(s.times, t) - 1  # turns done by t
            pages += (s.pages[k] if k >= 0 else 0) - s.head_pages
            heads[s.head] = s.head_pages
        out.append(pages + sum(heads.values()))
    return out


# ---- the tiers -----------------------------------------------------------------------------------------


class SimClock:
    """The simulated clock the lease books read (seconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class RunConfig:
    """One policy's run: the tiers' sizes and, under ``retention``, the leases' terms."""

    policy: str
    host_pages: int
    l3_pages: int
    cap: float = 0.5  # HICACHE_RETENTION_CAP's default
    ttl_s: float = 300.0  # Anthropic's default ephemeral TTL, "5m"
    priority: int = 50  # a cache_control TTL's default priority
    decay: float = 0.5  # HICACHE_LEASE_DECAY's default
    # How a turn leases: "stack" (retain the whole prompt with the session, as a request's hint without supersede
    # does in both adapters: the new lease takes over the session's earlier ones and its place in line),
    # "supersede" (the same with supersede=True), "regrant" (release, then retain: the session gives its place in
    # line up every turn), "chunks" (retain only the pages the turn adds).
    lease_call: str = "stack"
    # An agent's hint: the priority while waiting on a tool, and while waiting on a slow tool or a human (None: one
    # priority for every lease).
    hinted: tuple[int, int] | None = None
    # When a turn's lease is granted: "request" (as it arrives, before its pages are written: one ranking per book
    # and turn) or "finish" (after, as vLLM's integration does: the grant's capped count then covers every page).
    grant_at: str = "finish"
    warmup_s: float = 0.0  # turns before this are not counted (the tiers fill)
    sample_s: float = 60.0  # how often protection, leases and the working set are sampled
    memory_every_s: float = 3600.0  # how often the process's memory is sampled


class Tiers:
    """Host and L3: a :class:`RetentionQueue` each, with a :class:`LeaseBook` each under ``retention``.

    Every host victim is written to L3 (under a lease through the queue's ``demote``, the others after it),
    and L3's victims leave the system. An L3 hit is copied to host; L3 keeps its copy (a store read).
    """

    def __init__(self, cfg: RunConfig, clock: SimClock) -> None:
        self.cfg = cfg
        self.host = RetentionQueue(demote=self._demote)
        self.l3 = RetentionQueue()
        self.books: dict[str, LeaseBook] = {}
        self._demoted: set[Hashable] = set()
        if cfg.policy == "retention":
            for name, queue, pages in (("host", self.host, cfg.host_pages), ("l3", self.l3, cfg.l3_pages)):
                book = LeaseBook(name, capacity=pages, cap=cfg.cap, decay=cfg.decay, clock=clock)
                queue.attach(book)  # the book's page sizes are the queue's
                self.books[name] = book
        elif cfg.policy != "lru":
            raise ValueError(f"policy is one of {POLICIES}, got {cfg.policy!r}")
        self.counts = {"host_writes": 0, "promoted": 0, "demoted": 0, "demoted_under_lease": 0, "dropped": 0,
                       "stores_over_capacity": 0, "turn_pages_lost": 0}  # fmt: skip

    def _demote(self, leased: list[Hashable]) -> list[Hashable]:
        # Victims under a live lease: written to L3 now (L3 evicts once the whole batch is in, as file:// does).
        for key in leased:
            self.l3.add(key, 1)
        self._demoted.update(leased)
        self.counts["demoted_under_lease"] += len(leased)
        return leased

    def lookup(self, keys: Callable[[int], int], reusable: int) -> tuple[list[int], list[int]]:
        """The prompt's stored prefix: ``(in host, only in L3)`` up to the first page in neither."""
        host, l3 = [], []
        for i in range(reusable):
            key = keys(i)
            if key in self.host:
                host.append(key)
            elif key in self.l3:
                l3.append(key)
            else:
                break
        return host, l3

    def store(self, write: list[int], promoted: int) -> None:
        """``write`` (its first ``promoted`` pages from L3, then recomputed ones) into host; host's victims to L3;
        L3's victims dropped."""
        for key in write:
            self.host.add(key, 1)
        self.counts["host_writes"] += len(write)
        self.counts["promoted"] += promoted
        victims = self.host.evict(self.host.used - self.cfg.host_pages)
        for key in victims:
            if key not in self._demoted:  # the others were written by _demote
                self.l3.add(key, 1)
        self._demoted.clear()
        self.counts["demoted"] += len(victims)
        gone = self.l3.evict(self.l3.used - self.cfg.l3_pages)
        # A write is never refused because of a lease: the queues always make the room a store asks for.
        if self.host.used > self.cfg.host_pages or self.l3.used > self.cfg.l3_pages:
            self.counts["stores_over_capacity"] += 1
        self.counts["dropped"] += sum(1 for k in gone if k not in self.host)


# ---- one run -----------------------------------------------------------------------------------------


@dataclass
class Run:
    """What one run saw: a row per turn, samples over time, and the tiers' and books' counters."""

    cfg: RunConfig
    # (t, sid, k, gap_s, reusable, host_hit, l3_hit, pages, previous grant protected whole: 1, 0, or -1 for none)
    rows: list[tuple] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)
    grants: dict[str, int] = field(default_factory=lambda: {"granted": 0, "capped_grants": 0, "capped_pages": 0,
                                                             "released": 0})  # fmt: skip
    counts: dict[str, int] = field(default_factory=dict)
    books: dict[str, dict[str, Any]] = field(default_factory=dict)
    wall_s: float = 0.0


def deep_size(roots: Iterable[Any]) -> int:
    """Bytes of the objects reachable from ``roots`` (containers, instances), each counted once; classes,
    modules and functions are not followed (they are the program, not what it holds)."""
    seen: set[int] = set()
    todo = list(roots)
    total = 0
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType, types.MethodType)):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        todo.extend(gc.get_referents(obj))
    return total


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except OSError:
        return 0


def simulate(sessions: list[Session], cfg: RunConfig, *, duration_s: float | None = None) -> Run:
    """Replay ``sessions``' turns (up to ``duration_s``) through host and L3 under ``cfg.policy``."""
    started = time.perf_counter()
    clock = SimClock()
    tiers = Tiers(cfg, clock)
    run = Run(cfg)
    events = sorted((t, s.sid, k) for s in sessions for k, t in enumerate(s.times))
    if duration_s is not None:
        events = [e for e in events if e[0] < duration_s]
    end = duration_s if duration_s is not None else (events[-1][0] if events else 0.0)
    # The sim's own account of when each session's leases must have ended: its last turn plus TTL and decay,
    # or its release. A lease alive past that was kept by something other than its session.
    life = cfg.ttl_s + cfg.ttl_s * cfg.decay
    lease_end: dict[str, float] = {}
    lease_pages: dict[str, int] = {}
    terms: dict[tuple[int, bool], Retain] = {}
    protected_whole: dict[int, int] = {}  # whether a session's last grants left no page over the cap
    heads_seen: set[int] = set()
    next_sample, next_memory = 0.0, 0.0

    def sample(now: float) -> None:
        clock.now = now
        row: dict[str, Any] = {"t": now, "host_used": tiers.host.used, "l3_used": tiers.l3.used}
        for name in [n for n, e in lease_end.items() if e <= now - life]:  # long over: forget (bounded)
            del lease_end[name], lease_pages[name]
        # Every key a live lease may hold: the pages of each session whose leases may still be alive.
        row["lease_bound_pages"] = sum(p for n, p in lease_pages.items() if lease_end[n] > now)
        for name, book in tiers.books.items():
            st = book.stats()  # a public call: ends every lease whose end has passed, first
            # Read-only looks at the book's tables: what it keeps, and whether a lease outlived its session.
            past = sum(1 for lease in book._leases.values() if now >= lease_end.get(lease.session, -math.inf))
            row[name] = {"leases": st["leases"], "pages_leased": st["pages_leased"],
                         "protected_units": st["protected_units"], "cap_units": st["cap_units"],
                         "leases_past_end_book": st["leases_past_end"], "leases_past_session_end": past,
                         "keys_tracked": len(book._of_key), "lease_refs": sum(len(v) for v in book._of_key.values()),
                         "tails": len(book._tail), "drops_remembered": len(book._drops)}  # fmt: skip
        run.samples.append(row)

    def memory(now: float) -> None:
        gc.collect()
        held = None
        if tracemalloc.is_tracing():
            snapshot = tracemalloc.take_snapshot().filter_traces([RETENTION_CODE])
            held = sum(st.size for st in snapshot.statistics("filename"))
        run.memory.append({"t": now, "rss_bytes": _rss_bytes(), "retention_code_bytes": held,
                           "tiers_bytes": deep_size([tiers.host, tiers.l3, *tiers.books.values()]),
                           "host_pages": len(tiers.host), "l3_pages": len(tiers.l3),
                           **{f"{n}_keys_tracked": len(b._of_key) for n, b in tiers.books.items()},
                           **{f"{n}_leases": len(b._leases) for n, b in tiers.books.items()}})  # fmt: skip

    for t, sid, k in events:
        while next_sample <= t:
            sample(next_sample)
            next_sample += cfg.sample_s
        while next_memory <= t:
            memory(next_memory)
            next_memory += cfg.memory_every_s
        clock.now = t
        s = sessions[sid]
        if k == 0:
            reusable = s.head_pages if s.head in heads_seen else 0
            heads_seen.add(s.head)
            gap = math.nan
        else:
            reusable = s.pages[k - 1]
            gap = t - s.times[k - 1]
        host_hit, l3_hit = tiers.lookup(s.key, reusable)
        found = len(host_hit) + len(l3_hit)
        tiers.host.touch(host_hit)  # a hit on a lease's last page refreshes it (the books do)
        tiers.l3.touch(l3_hit)
        pages = s.pages[k]
        name = f"s{sid}"
        was_protected = protected_whole.get(sid, -1)
        write = l3_hit + [s.key(i) for i in range(found, pages)]  # promoted from L3, then recomputed
        if cfg.grant_at == "finish" or not tiers.books:
            tiers.store(write, len(l3_hit))
        if tiers.books:
            slow = s.slow_after[k]
            priority = cfg.priority if cfg.hinted is None else cfg.hinted[slow]
            retain = terms.get((sid, slow)) or terms.setdefault((sid, slow), Retain(priority, cfg.ttl_s, name))
            # "chunks": lease only what this turn adds (earlier chunks live on through hits on their tails).
            first = (s.pages[k - 1] if k else 0) if cfg.lease_call == "chunks" else 0
            keys = [s.key(i) for i in range(first, pages)]
            whole = 1
            for book in tiers.books.values() if keys else ():
                if cfg.lease_call == "regrant":
                    book.release(session=name)
                grant = book.retain(keys, retain, supersede=cfg.lease_call == "supersede")
                run.grants["granted"] += 1
                run.grants["capped_grants"] += grant.capped > 0
                run.grants["capped_pages"] += grant.capped
                whole &= grant.capped == 0
            protected_whole[sid] = whole
            lease_end[name] = t + cfg.ttl_s + cfg.ttl_s * cfg.decay
            lease_pages[name] = pages
        if cfg.grant_at == "request" and tiers.books:  # the hints came with the request: its lease, then its pages
            tiers.store(write, len(l3_hit))
        # The turn's own pages that neither tier kept: a context bigger than the room left to it (informative).
        tiers.counts["turn_pages_lost"] += sum(
            1 for i in range(pages) if s.key(i) not in tiers.host and s.key(i) not in tiers.l3
        )
        if k == len(s.times) - 1 and not s.abandoned and tiers.books:  # a finished session says so
            for book in tiers.books.values():
                run.grants["released"] += book.release(session=name)
            lease_end[name] = t
        run.rows.append((t, sid, k, gap, reusable, len(host_hit), len(l3_hit), pages, was_protected))
        if k == len(s.times) - 1:  # the harness keeps nothing per session past its last turn either
            terms.pop((sid, False), None)
            terms.pop((sid, True), None)
            protected_whole.pop(sid, None)
    while next_sample <= end:
        sample(next_sample)
        next_sample += cfg.sample_s
    memory(end)
    run.counts = dict(tiers.counts)
    run.books = {n: {k: v for k, v in b.stats().items() if k != "tier"} for n, b in tiers.books.items()}
    run.wall_s = time.perf_counter() - started
    return run


def simulate_oracle(sessions: list[Session], cfg: RunConfig, *, duration_s: float | None = None) -> Run:
    """A reference, not a policy: host and L3 as one pool of their pages together that knows when every page is
    next used (Belady's rule at the grain of a session's own pages and of a shared head: the farthest next use
    loses its pages first, from the tail, so what stays is a prefix). What any eviction order could reach on this
    trace, near enough."""
    started = time.perf_counter()
    capacity = cfg.host_pages + cfg.l3_pages
    run = Run(dataclasses.replace(cfg, policy="oracle"))
    events = sorted((t, s.sid, k) for s in sessions for k, t in enumerate(s.times))
    if duration_s is not None:
        events = [e for e in events if e[0] < duration_s]
    uses: dict[int, list[float]] = {}  # every turn of every session over each head, in time order
    for t, sid, _ in events:
        uses.setdefault(sessions[sid].head, []).append(t)
    held: dict[tuple[str, int], int] = {}  # pages held of an owner ("head", h) or ("own", sid): a prefix of them
    upcoming: dict[int, float] = {}
    seen: set[int] = set()
    used = 0
    for t, sid, k in events:
        s = sessions[sid]
        head = held.get(("head", s.head), 0)
        if k == 0:
            reusable, gap = (s.head_pages if s.head in seen else 0), math.nan
            found = min(head, reusable)
            seen.add(s.head)
        else:
            reusable, gap = s.pages[k - 1], t - s.times[k - 1]
            found = (
                head if head < s.head_pages else s.head_pages + min(held.get(("own", sid), 0), reusable - s.head_pages)
            )
        used += s.head_pages - head + (s.pages[k] - s.head_pages) - held.get(("own", sid), 0)
        held[("head", s.head)] = s.head_pages
        held[("own", sid)] = s.pages[k] - s.head_pages
        upcoming[sid] = s.times[k + 1] if k + 1 < len(s.times) else math.inf

        def next_use(owner: tuple[str, int], now: float = t) -> float:
            if owner[0] == "own":
                return upcoming[owner[1]]
            times = uses[owner[1]]
            i = bisect.bisect_right(times, now)
            return times[i] if i < len(times) else math.inf

        if used > capacity:
            for owner in sorted(held, key=next_use, reverse=True):
                cut = min(used - capacity, held[owner])
                held[owner] -= cut
                used -= cut
                if not held[owner]:
                    del held[owner]
                if used <= capacity:
                    break
        run.rows.append((t, sid, k, gap, reusable, found, 0, s.pages[k], -1))
    run.wall_s = time.perf_counter() - started
    return run


# ---- what a run says ---------------------------------------------------------------------------------


def _hits(rows: list[tuple]) -> dict[str, Any]:
    """Token hit rate (found over reusable prefix pages), share of turns fully hit, and how many turns."""
    reusable = sum(r[4] for r in rows)
    found = sum(r[5] + r[6] for r in rows)
    return {"turns": len(rows), "token_hit_rate": found / reusable if reusable else None,
            "full_hit_share": sum(r[5] + r[6] == r[4] for r in rows) / len(rows) if rows else None,
            "host_share": sum(r[5] for r in rows) / reusable if reusable else None,
            "l3_share": sum(r[6] for r in rows) / reusable if reusable else None}  # fmt: skip


def summarize(run: Run) -> dict[str, Any]:
    """One run's figures over the turns after the warm-up: hit rates (next turn, under the TTL, by gap),
    recomputed tokens, demotions and drops, the leases' grants, the cap at every sample, leases past their end."""
    cfg = run.cfg
    rows = [r for r in run.rows if r[0] >= cfg.warmup_s]
    nxt = [r for r in rows if r[2] >= 1]
    under = [r for r in nxt if r[3] < cfg.ttl_s]
    by_gap = []
    for lo, hi in zip(GAP_BINS, GAP_BINS[1:]):
        b = [r for r in nxt if lo <= r[3] < hi]
        by_gap.append({"gap_s": [lo, None if math.isinf(hi) else hi], **_hits(b)})
    out: dict[str, Any] = {
        "policy": cfg.policy, "cap": cfg.cap if cfg.policy == "retention" else None,
        "lease_call": cfg.lease_call if cfg.policy == "retention" else None,
        "hinted": cfg.hinted if cfg.policy == "retention" else None,
        "host_pages": cfg.host_pages, "l3_pages": cfg.l3_pages,
        "turns_counted": len(rows), "next_turn": _hits(nxt), "next_turn_under_ttl": _hits(under),
        "next_turn_by_gap": by_gap,
        # A session's first turns: new sessions are not starved by the leases of older ones.
        "young_sessions_under_ttl": _hits([r for r in under if r[2] <= 3]),
        "first_turn_shared_head": _hits([r for r in rows if r[2] == 0 and r[4] > 0]),
        "recomputed_tokens": sum(r[4] - r[5] - r[6] for r in rows) * PAGE,
        "computed_tokens": sum(r[7] - r[5] - r[6] for r in rows) * PAGE,
        "prompt_tokens": sum(r[7] for r in rows) * PAGE,
        "tiers": run.counts, "wall_s": run.wall_s,
    }  # fmt: skip
    if cfg.policy == "retention":
        out["under_ttl_after_whole_grant"] = _hits([r for r in under if r[8] == 1])
        out["under_ttl_after_capped_grant"] = _hits([r for r in under if r[8] == 0])
        out["grants"] = run.grants
        out["books"] = run.books
        cap_rows = [(n, x[n]) for x in run.samples for n in ("host", "l3") if n in x]
        out["cap"] = {
            "samples": len(run.samples),
            "max_protected_over_cap": max((v["protected_units"] / v["cap_units"] for _, v in cap_rows
                                           if v["cap_units"]), default=0.0),
            "samples_over_cap": sum(v["protected_units"] > v["cap_units"] for _, v in cap_rows),
        }  # fmt: skip
        out["leases_past_end"] = {
            "max_past_session_end": max((v["leases_past_session_end"] for _, v in cap_rows), default=0),
            "max_past_end_book": max((v["leases_past_end_book"] for _, v in cap_rows), default=0),
            "samples_with_any": sum(v["leases_past_session_end"] > 0 for _, v in cap_rows),
        }  # fmt: skip
    return out


def _trend(ts: list[float], ys: list[float]) -> dict[str, float] | None:
    """Least-squares slope per hour, and the change it makes over the window against the mean."""
    if len(ts) < 3 or not any(ys):
        return None
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    var = sum((t - mt) ** 2 for t in ts)
    slope = sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var if var else 0.0
    return {"per_hour": slope * 3600, "over_window_vs_mean": slope * (ts[-1] - ts[0]) / my if my else 0.0,
            "mean": my, "min": min(ys), "max": max(ys)}  # fmt: skip


def summarize_day(run: Run, settle_s: float) -> dict[str, Any]:
    """The simulated day: leases alive and past their end at every sample, what the books and the retention
    code hold hour by hour, and the trend of each after ``settle_s`` (the steady state)."""
    samples = run.samples
    bound_ok = all(x[n]["keys_tracked"] <= x["lease_bound_pages"] for x in samples for n in ("host", "l3") if n in x)
    steady = [m for m in run.memory if m["t"] >= settle_s]
    ts = [m["t"] for m in steady]
    return {
        "samples": len(samples), "sample_s": run.cfg.sample_s, "turns": len(run.rows),
        "max_live_leases": max((x[n]["leases"] for x in samples for n in ("host", "l3") if n in x), default=0),
        "leases_past_session_end_max": max((x[n]["leases_past_session_end"] for x in samples for n in ("host", "l3")
                                            if n in x), default=0),
        "leases_past_end_book_max": max((x[n]["leases_past_end_book"] for x in samples for n in ("host", "l3")
                                         if n in x), default=0),
        "keys_tracked_within_lease_bound": bound_ok,
        "trend_after_settle": {key: _trend(ts, [float(m[key] or 0) for m in steady])
                               for key in ("tiers_bytes", "retention_code_bytes", "rss_bytes", "host_keys_tracked",
                                           "l3_keys_tracked", "host_leases", "l3_leases")},
        "memory": run.memory, "grants": run.grants, "books": run.books, "tiers": run.counts, "wall_s": run.wall_s,
    }  # fmt: skip


# ---- the record ----------------------------------------------------------------------------------------

DEFINITIONS = {
    "oversubscription": "mean live working set / (host pages + L3 pages), the mean over samples every sample_s "
                        "after the warm-up; the live working set is the whole pages stored so far by every session "
                        "that has arrived and has a turn still to come (or is at its last), each shared head once",
    "gap_s": "seconds between two requests of a session: the model's time for the earlier turn plus the tool pause; "
             "a lease's TTL runs from the earlier request (its grant), so 'paused less than its TTL' is gap < ttl_s",
    "next_turn_token_hit_rate": "over turns 2.. of every session after the warm-up: prefix pages found in host or "
                                "L3 (in chain order, up to the first page in neither) / the pages the previous turn "
                                "stored; pages are 64 tokens, so it is also the share of those tokens",
    "full_hit_share": "share of those turns that found every page the previous turn stored",
    "recomputed_tokens": "tokens computed before (the previous turn's pages, a shared head used before) and "
                         "computed again because they were not found",
    "demoted": "host victims written to L3 (every host victim, both policies); demoted_under_lease: those under a "
               "live lease, through the queue's demote", "dropped": "L3 victims not also in host: left the system",
    "leases_past_session_end": "at a sample, leases alive in a book whose session's last turn + ttl * (1 + decay) "
                               "(or its release) is past: the sim's own account, so a lease kept alive by anything "
                               "but its session shows here",
    "protected_units / cap_units": "a book's protected pages present in the tier / cap * capacity, at every sample",
}  # fmt: skip


def sizes_for(sessions: list[Session], hours: float, warmup_s: float, sample_s: float, over: float,
              host_share: float) -> dict[str, Any]:  # fmt: skip
    """Host and L3 pages for ``over`` times oversubscription of this trace's mean live working set."""
    at = [warmup_s + i * sample_s for i in range(int((hours * 3600 - warmup_s) / sample_s) + 1)]
    ws = working_set(sessions, at)
    mean = statistics.fmean(ws)
    total = int(round(mean / over))
    host = int(round(total * host_share))
    return {"oversubscription": over, "working_set_mean_pages": mean, "working_set_max_pages": max(ws),
            "working_set_min_pages": min(ws), "host_pages": host, "l3_pages": total - host,
            "series": {"t": at, "working_set_pages": ws}}  # fmt: skip


def _record_env() -> tuple[dict[str, Any], dict[str, Any]]:
    # The machine and versions as the KV-routing benchmark writes them (beside this file).
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kv_routing import machine, versions

    return machine(), versions()


def _bars(main: dict[str, dict[str, Any]], day: dict[str, Any] | None, ttl_s: float) -> dict[str, Any]:
    ret, lru, oracle = main["retention"], main["lru"], main["oracle"]
    rate = ret["next_turn_under_ttl"]["token_hit_rate"] or 0.0
    bars: dict[str, Any] = {
        "next_turn_hits_under_ttl": {
            "bar": 0.95, "ttl_s": ttl_s, "retention": rate, "lru": lru["next_turn_under_ttl"]["token_hit_rate"],
            "oracle": oracle["next_turn_under_ttl"]["token_hit_rate"],
            "retention_full_hit_share": ret["next_turn_under_ttl"]["full_hit_share"],
            "lru_full_hit_share": lru["next_turn_under_ttl"]["full_hit_share"], "met": rate >= 0.95},
        "cap_holds_no_store_refused": {
            "max_protected_over_cap": ret["cap"]["max_protected_over_cap"],
            "samples_over_cap": ret["cap"]["samples_over_cap"],
            "stores_over_capacity": ret["tiers"]["stores_over_capacity"],
            "young_sessions_under_ttl": {p: main[p]["young_sessions_under_ttl"]["token_hit_rate"]
                                         for p in ("lru", "retention")},
            "met": ret["cap"]["samples_over_cap"] == 0 and ret["tiers"]["stores_over_capacity"] == 0},
    }  # fmt: skip
    if day is not None:
        trend = day["trend_after_settle"]["tiers_bytes"]
        bars["day"] = {"leases_past_session_end_max": day["leases_past_session_end_max"],
                       "keys_tracked_within_lease_bound": day["keys_tracked_within_lease_bound"],
                       "tiers_bytes_trend": trend,
                       "retention_code_bytes_trend": day["trend_after_settle"]["retention_code_bytes"],
                       # No growth: what the trend adds over the steady window is under a tenth of the mean.
                       "met": day["leases_past_session_end_max"] == 0 and day["keys_tracked_within_lease_bound"]
                              and trend is not None and trend["over_window_vs_mean"] < 0.1}  # fmt: skip
    return bars


def findings(record: dict[str, Any]) -> list[str]:
    """What the numbers say, in sentences computed from them (the record's ``bars`` and ``results``)."""
    res = {r["run"]: r for r in record["results"]}
    bar = record["bars"]["next_turn_hits_under_ttl"]
    over = record["sizes"]["oversubscription"]
    out = [f"next-turn hits for gaps under the {bar['ttl_s']:g} s TTL at {over:g}x: retention {bar['retention']:.1%}, "
           f"LRU {bar['lru']:.1%}, oracle {bar['oracle']:.1%}; the bar (>= 95 %) is "
           + ("met" if bar["met"] else "not met")]  # fmt: skip
    if bar["oracle"] < 0.95:
        out.append(f"no eviction order reaches 95 % at {over:g}x on this trace: the oracle, which knows every next "
                   f"use, finds {bar['oracle']:.1%}")  # fmt: skip
    for name, r in res.items():
        if name.endswith(" oracle") and not name.startswith("main") and r["next_turn_under_ttl"]["turns"]:
            lru = res.get(name.replace("oracle", "lru"))
            rate = r["next_turn_under_ttl"]["token_hit_rate"]
            out.append(f"with the tiers at {name.split()[0]} the oracle finds {rate:.1%}"
                       + (f", LRU {lru['next_turn_under_ttl']['token_hit_rate']:.1%}" if lru else ""))  # fmt: skip
    ret = res["main retention"]
    g = ret["grants"]
    whole, capped = ret["under_ttl_after_whole_grant"], ret["under_ttl_after_capped_grant"]
    out.append(f"retention: {g['capped_grants'] / max(1, g['granted']):.0%} of {g['granted']} grants had pages over "
               f"the cap; within the TTL, turns after a grant with every page protected found "
               f"{(whole['token_hit_rate'] or 0):.1%} ({whole['turns']} turns), after a capped grant "
               f"{(capped['token_hit_rate'] or 0):.1%} ({capped['turns']} turns)")  # fmt: skip
    cap = record["bars"]["cap_holds_no_store_refused"]
    out.append(f"the cap holds: protected / cap at most {cap['max_protected_over_cap']:.3f} over "
               f"{ret['cap']['samples']} samples, {cap['stores_over_capacity']} stores over capacity; sessions' "
               f"first turns under the TTL: retention {cap['young_sessions_under_ttl']['retention']:.1%}, LRU "
               f"{cap['young_sessions_under_ttl']['lru']:.1%}")  # fmt: skip
    costs = {c["lease_call"]: c for c in record.get("lease_call_costs") or []}
    if "stack" in costs and len(costs) > 1:
        base = costs["stack"]["max"]
        out.append("lease calls on a small trace, most leases / lease references a book held: "
                   + ", ".join(f"{n} {c['max']['leases']} / {c['max']['lease_refs']} "
                               f"({c['max']['lease_refs'] / max(1, base['lease_refs']):.1f}x stack's)"
                               for n, c in costs.items()))  # fmt: skip
    if record.get("day"):
        day = record["bars"]["day"]
        trend = day["tiers_bytes_trend"] or {}
        out.append(f"the day: at most {day['leases_past_session_end_max']} lease(s) past their session's end at any "
                   f"sample; the books' keys within what live leases may hold: {day['keys_tracked_within_lease_bound']}"
                   f"; the queues' and books' size changes {trend.get('over_window_vs_mean', 0):+.1%} of its mean "
                   "over the steady hours")  # fmt: skip
    return out


def summary_lines(results: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'run':28} {'hits<ttl':>9} {'full<ttl':>9} {'hits':>7} {'recomputed':>12} {'demoted':>9} "
             f"{'dropped':>9} {'wall s':>7}"]  # fmt: skip
    for r in results:
        u, n = r["next_turn_under_ttl"], r["next_turn"]
        lines.append(f"{r['run']:28} {u['token_hit_rate']:9.1%} {u['full_hit_share']:9.1%} {n['token_hit_rate']:7.1%} "
                     f"{r['recomputed_tokens']:12,d} {r['tiers'].get('demoted', 0):9,d} "
                     f"{r['tiers'].get('dropped', 0):9,d} {r['wall_s']:7.1f}")  # fmt: skip
    return lines


def plot(path: Path, record: dict[str, Any]) -> bool:
    """Hit rate by gap (LRU, retention, oracle; the TTL marked), the cap's sensitivity, protected pages against
    the cap over time, and the simulated day's leases and memory; ``False`` where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    res = {r["run"]: r for r in record["results"]}
    ttl = record["params"]["ttl_s"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.6))
    ax = axes[0][0]
    colours = {"lru": "#7f7f7f", "retention": "#1f77b4", "oracle": "#2ca02c"}
    bins = res["main lru"]["next_turn_by_gap"]
    labels = [f"{b['gap_s'][0]:g}-{b['gap_s'][1]:g}" if b["gap_s"][1] else f">{b['gap_s'][0]:g}" for b in bins]
    width = 0.27
    for j, name in enumerate(("lru", "retention", "oracle")):
        r = res[f"main {name}"]
        ys = [(b["token_hit_rate"] or 0) * 100 for b in r["next_turn_by_gap"]]
        label = f"{name}: {r['next_turn_under_ttl']['token_hit_rate']:.1%} under the TTL"
        ax.bar([x + (j - 1) * width for x in range(len(bins))], ys, width, color=colours[name], label=label)
    edge = next(i for i, b in enumerate(bins) if b["gap_s"][0] >= ttl) - 0.5
    ax.axvline(edge, color="#d62728", ls="--", lw=1)
    ax.text(edge, 101, f" TTL {ttl:g} s", color="#d62728", fontsize=8)
    ax.axhline(95, color="black", ls=":", lw=1)
    ax.set_xticks(range(len(bins)), labels, fontsize=8)
    ax.set_ylim(0, 108)
    ax.set_xlabel("gap between a session's two requests (s)")
    ax.set_ylabel("% of the previous turn's pages found")
    ax.set_title(f"next-turn hits at {record['sizes']['oversubscription']:g}x oversubscription (95 % dotted)",
                 fontsize=10)  # fmt: skip
    ax.legend(fontsize=8, loc="upper right")
    ax = axes[0][1]
    runs = [r for r in record["results"] if r["policy"] != "oracle" or r["run"].startswith("main")]
    runs += [r for r in record["results"] if r["policy"] == "oracle" and not r["run"].startswith("main")]
    names = [r["run"] for r in runs]
    vals = [r["next_turn_under_ttl"]["token_hit_rate"] * 100 for r in runs]
    ax.barh(names, vals, color=[colours.get(r["policy"], "#1f77b4") for r in runs])
    for y, v in enumerate(vals):
        ax.text(v, y, f" {v:.1f}", va="center", fontsize=8)
    ax.axvline(95, color="black", ls=":", lw=1)
    ax.invert_yaxis()
    ax.set_xlim(0, 110)
    ax.tick_params(axis="y", labelsize=8)
    ax.set_xlabel("% next-turn hits, gap under the TTL")
    ax.set_title("the cap, agents' hints, the grant's time, the capacity: one trace", fontsize=10)
    ax = axes[1][0]
    series = record["series"]["main_retention"]
    hours = [t / 3600 for t in series["t"]]
    for tier, colour in (("host", "#1f77b4"), ("l3", "#9467bd")):
        ax.plot(hours, series[f"{tier}_protected"], color=colour, lw=1.5, label=f"{tier}: protected pages")
        ax.plot(hours, series[f"{tier}_cap"], color=colour, ls="--", lw=1, label=f"{tier}: cap x capacity")
    ax.set_xlabel("simulated hours")
    ax.set_ylabel("pages")
    ax.set_title("protected pages never pass the cap (retention, main trace)", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax = axes[1][1]
    if record.get("day"):
        day = record["series"]["day"]
        hours = [t / 3600 for t in day["t"]]
        ax.plot(hours, day["leases"], color="#1f77b4", lw=1, label="live leases (host + L3)")
        ax.plot(hours, day["past_end"], color="#d62728", lw=1.5, label="leases past their session's end")
        ax.set_xlabel("simulated hours")
        ax.set_ylabel("leases")
        twin = ax.twinx()
        mem = record["day"]["memory"]
        twin.plot([m["t"] / 3600 for m in mem], [m["tiers_bytes"] / 2**20 for m in mem], "o-", color="#2ca02c",
                  ms=3, lw=1, label="queues and books, MiB (deep size)")  # fmt: skip
        twin.plot([m["t"] / 3600 for m in mem], [(m["host_keys_tracked"] + m["l3_keys_tracked"]) / 1e3 for m in mem],
                  "s-", color="#8c564b", ms=3, lw=1, label="keys the books track (thousands)")  # fmt: skip
        twin.set_ylim(bottom=0)
        lines = ax.get_legend_handles_labels()
        more = twin.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="upper left")
        ax.set_title(f"a simulated day ({record['params']['day_live_sessions']:g} live sessions): leases end, "
                     "no growth", fontsize=10)  # fmt: skip
    else:
        ax.axis("off")
        ax.text(0.5, 0.5, "no simulated day in this run", ha="center", va="center", fontsize=10)
    fig.suptitle(f"Agentic trace: LRU against retention leases (median {record['trace']['turns_median_finished']:g} "
                 f"turns, {record['trace']['final_context_tokens_median_finished'] / 1e3:.0f}K tokens per session; "
                 f"{record['machine']['cores']}-core CPU, simulated time)", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/agentic-trace.json")
    ap.add_argument("--plot", default=None, help="the PNG (default: the JSON's name with .png)")
    ap.add_argument("--quick", action="store_true", help="a short trace, few sessions, a 3-hour day: seconds")
    ap.add_argument("--seed", type=int, default=54)
    ap.add_argument("--live-sessions", type=float, default=None, help="sessions live on average (8; quick 3)")
    ap.add_argument("--hours", type=float, default=None, help="simulated hours of the main trace (2; quick 1)")
    ap.add_argument("--warmup-s", type=float, default=None, help="turns not counted while the tiers fill (2400; 1200)")
    ap.add_argument("--oversubscription", type=float, default=2.0, help="live working set / (host + L3)")
    ap.add_argument("--host-share", type=float, default=0.5, help="host's share of host + L3 pages")
    ap.add_argument("--ttl-s", type=float, default=300.0, help="the leases' TTL (Anthropic's ephemeral default, 5m)")
    ap.add_argument("--priority", type=int, default=50)
    ap.add_argument("--decay", type=float, default=0.5, help="HICACHE_LEASE_DECAY (its default)")
    ap.add_argument("--cap", type=float, default=0.5, help="HICACHE_RETENTION_CAP (its default)")
    ap.add_argument("--caps", default=None, help="other caps for the sensitivity, comma-separated (1)")
    ap.add_argument("--lease-call", default="stack", choices=("regrant", "supersede", "stack", "chunks"))
    ap.add_argument(
        "--other-calls", default=None, help="other lease calls, comma-separated (supersede, stack, chunks; none)"
    )
    ap.add_argument(
        "--grant-at", default="finish", choices=("request", "finish"), help="when a turn's lease is granted"
    )
    ap.add_argument("--other-grant-at", default=None, help="a run with the other grant time (request; quick none)")
    ap.add_argument(
        "--hints",
        default="70,20",
        help="priorities while an agent waits on a tool, and on a slow tool or a human ('': no hinted run)",
    )
    ap.add_argument("--hint-caps", default="1", help="other caps for the hinted runs, comma-separated")
    ap.add_argument("--also-oversubscription", default=None, help="other capacities, comma-separated (1)")
    ap.add_argument(
        "--call-costs",
        default=None,
        help="lease calls whose bookkeeping is measured on a small trace (regrant,supersede,stack)",
    )
    ap.add_argument("--also-policies", default="lru,oracle", help="the policies run at the other capacities")
    ap.add_argument("--day-hours", type=float, default=None, help="the simulated day (24; quick 3; 0: none)")
    ap.add_argument("--day-live-sessions", type=float, default=None, help="sessions live during the day (3; quick 2)")
    ap.add_argument(
        "--tracemalloc",
        action="store_true",
        help="also trace the retention code's allocations during the day (about 10x slower)",
    )
    args = ap.parse_args(argv)
    quick = {"live_sessions": 3.0, "hours": 0.75, "warmup_s": 900.0, "caps": "", "other_calls": "", "call_costs": "",
             "other_grant_at": "", "also_oversubscription": "", "day_hours": 2.0,
             "day_live_sessions": 2.0}  # fmt: skip
    full = {"live_sessions": 8.0, "hours": 2.0, "warmup_s": 2400.0, "caps": "1", "other_calls": "",
            "other_grant_at": "request", "also_oversubscription": "1", "day_hours": 24.0,
            "call_costs": "regrant,supersede,stack",
            "day_live_sessions": 3.0}  # fmt: skip
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """Every run the record holds: the main trace under LRU, retention and the oracle, the sensitivities, the day."""
    params = TraceParams(seed=args.seed, live_sessions=args.live_sessions)
    sessions = make_trace(params, args.hours * 3600)
    sizes = sizes_for(sessions, args.hours, args.warmup_s, 60.0, args.oversubscription, args.host_share)

    def config(policy: str, where: dict[str, Any], **kw: Any) -> RunConfig:
        terms = {"cap": args.cap, "ttl_s": args.ttl_s, "priority": args.priority, "decay": args.decay,
                 "lease_call": args.lease_call, "grant_at": args.grant_at, "warmup_s": args.warmup_s} | kw  # fmt: skip
        return RunConfig(policy, where["host_pages"], where["l3_pages"], **terms)

    def one(name: str, cfg: RunConfig, trace: list[Session]) -> tuple[dict[str, Any], Run]:
        run = simulate_oracle(trace, cfg) if cfg.policy == "oracle" else simulate(trace, cfg)
        out = {"run": name, **summarize(run)}
        print(summary_lines([out])[-1], flush=True)
        return out, run

    print(summary_lines([])[0], flush=True)
    results, main, runs = [], {}, {}
    for policy in ("lru", "retention", "oracle"):
        out, runs[policy] = one(f"main {policy}", config(policy, sizes), sessions)
        results.append(out)
        main[policy] = out
    for cap in _floats(args.caps):
        results.append(one(f"retention cap {cap:g}", config("retention", sizes, cap=cap), sessions)[0])
    for call in [c for c in args.other_calls.split(",") if c]:
        results.append(one(f"retention {call}", config("retention", sizes, lease_call=call), sessions)[0])
    if args.hints:
        hinted = tuple(int(x) for x in args.hints.split(","))
        for cap in [args.cap, *_floats(args.hint_caps)]:
            name = f"retention hinted {hinted[0]}/{hinted[1]} cap {cap:g}"
            results.append(one(name, config("retention", sizes, cap=cap, hinted=hinted), sessions)[0])
    for grant_at in [g for g in args.other_grant_at.split(",") if g]:
        results.append(
            one(f"retention grant at {grant_at}", config("retention", sizes, grant_at=grant_at), sessions)[0]
        )
    for over in _floats(args.also_oversubscription):
        where = sizes_for(sessions, args.hours, args.warmup_s, 60.0, over, args.host_share)
        for policy in args.also_policies.split(","):
            results.append(one(f"{over:g}x {policy}", config(policy, where), sessions)[0])
    # What each way of leasing a turn costs the books (a small trace: stacked and superseded leases pile up).
    calls = []
    if args.call_costs:
        small = make_trace(TraceParams(seed=args.seed, live_sessions=3), 3600)
        where = sizes_for(small, 1.0, 1200.0, 60.0, args.oversubscription, args.host_share)
        for call in args.call_costs.split(","):
            run = simulate(small, config("retention", where, lease_call=call, warmup_s=1200.0))
            top = {f: max(x[n][f] for x in run.samples for n in ("host", "l3"))
                   for f in ("leases", "keys_tracked", "lease_refs")}  # fmt: skip
            calls.append({"lease_call": call, "max": top, "wall_s": run.wall_s,
                          "next_turn_under_ttl": summarize(run)["next_turn_under_ttl"]["token_hit_rate"]})  # fmt: skip
    ret = runs["retention"].samples
    series = {"main_retention": {"t": [x["t"] for x in ret],
                                 **{f"{n}_protected": [x[n]["protected_units"] for x in ret] for n in ("host", "l3")},
                                 **{f"{n}_cap": [x[n]["cap_units"] for x in ret] for n in ("host", "l3")},
                                 "leases": [x["host"]["leases"] + x["l3"]["leases"] for x in ret]},
              "working_set": sizes.pop("series")}  # fmt: skip
    day = day_trace = day_sizes = None
    if args.day_hours:
        day_params = TraceParams(seed=args.seed + 1, live_sessions=args.day_live_sessions)
        day_sessions = make_trace(day_params, args.day_hours * 3600)
        settle = min(2 * 3600.0, args.day_hours * 3600 / 3)
        day_sizes = sizes_for(day_sessions, args.day_hours, settle, 300.0, args.oversubscription, args.host_share)
        day_sizes.pop("series")
        cfg = config("retention", day_sizes, sample_s=300.0, memory_every_s=min(3600.0, args.day_hours * 3600 / 12))
        if args.tracemalloc:
            tracemalloc.start()
        try:
            run = simulate(day_sessions, cfg, duration_s=args.day_hours * 3600)
        finally:
            tracemalloc.stop()
        day = {"run": "day retention", **summarize_day(run, settle), "summary": summarize(run)}
        day_trace = {**asdict(day_params), **trace_stats(day_sessions)}
        series["day"] = {"t": [x["t"] for x in run.samples],
                         "leases": [x["host"]["leases"] + x["l3"]["leases"] for x in run.samples],
                         "past_end": [max(x["host"]["leases_past_session_end"], x["l3"]["leases_past_session_end"])
                                      for x in run.samples],
                         "keys_tracked": [x["host"]["keys_tracked"] + x["l3"]["keys_tracked"] for x in run.samples],
                         "lease_bound_pages": [x["lease_bound_pages"] for x in run.samples]}  # fmt: skip
        print(
            f"day: {len(run.rows)} turns, max leases past their session's end "
            f"{day['leases_past_session_end_max']}, {run.wall_s:.1f} s",
            flush=True,
        )
    return {"trace": {**asdict(params), **trace_stats(sessions)}, "sizes": sizes, "results": results,
            "lease_call_costs": calls,
            "bars": _bars(main, day, args.ttl_s), "day": day, "day_trace": day_trace, "day_sizes": day_sizes,
            "series": series}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    started = time.perf_counter()
    machine, versions = _record_env()
    record: dict[str, Any] = {
        "what": __doc__.splitlines()[0], "machine": machine, "versions": versions,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "params": {k: v for k, v in vars(args).items() if k not in ("out", "plot")} | {"page_tokens": PAGE},
        "definitions": DEFINITIONS,
        "real": ["hicache_core.retention.RetentionQueue: each tier's pages and its eviction order",
                 "hicache_core.retention.LeaseBook (retention): one per tier, leases, the cap, decay, refresh on a "
                 "hit to a lease's last page, ends", "hicache_core.retention.Retain: the terms of each lease"],
        "simulated": ["time (a clock the books read)", "bytes (a page is a key of size 1)",
                      "the model (a turn's time is drawn)", "the oracle (a reference, not a policy)"],
        **run_all(args),
    }  # fmt: skip
    record["findings"] = findings(record)
    record["wall_s"] = time.perf_counter() - started
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = Path(args.plot) if args.plot else out.with_suffix(".png")
    record["plot"] = str(png.name) if plot(png, record) else "not drawn: matplotlib is not installed"
    out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print("\n".join(record["findings"]))
    return record


if __name__ == "__main__":
    main()
