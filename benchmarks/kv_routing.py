"""KV-aware routing over hicache's tiers: a router that sees every tier's events against one that sees only the GPU.

    python benchmarks/kv_routing.py --out benchmarks/results/kv-routing-cpu.json
    python benchmarks/kv_routing.py --tiny --out /tmp/kv-routing.json      # a few seconds

``N`` serving instances share one L3 directory; a router sends each request of a shared-prefix trace
(many users, a few long system prompts, multi-turn sessions whose every turn extends the last) to one
of them. Two routers run the same trace on fresh instances:

* ``gpu_only``: the longest prefix in an instance's GPU cache (what a router fed only by the server's
  own GPU-tier events scores); ties and load by the instance's queue, then round robin;
* ``tier_aware``: the expected time to first token on each instance, from the longest prefix the
  instance can take from its GPU, its host tier or a store it reaches, each page priced by the tier's
  load cost from the publisher's tier statistics, against recomputing at the prefill rate.

What is real and what is simulated (also written into the JSON):

* real: each instance's :class:`~hicache_core.storage.PageStore` on the shared ``file://`` directory
  (``capacity=`` per instance: the file backend's own LRU, each instance evicting by its own view, as
  several processes on one directory do), reads and writes of real pages through a real host pool
  (timed), a real :class:`~hicache_core.events.KVEventPublisher` per instance (SGLang's format, TCP),
  the store's feed (``PageStore.publish_events``), its audit, and a real
  :class:`~hicache_core.events.EventSubscriber` per instance in the router; the router's host and L3
  views, and the tier costs it weighs, come only from those events and tier statistics;
* simulated: the GPU (an LRU of page hashes per instance; the router reads it directly, as Dynamo knows
  the GPU tier from the server's own events), the model (prefill at a stated rate), the host tier (an
  LRU of page hashes per instance that publishes ``BlockStored``/``BlockRemoved`` through the same
  publisher, with the host-to-GPU copy priced at a stated bandwidth), time (a simulated clock: requests
  arrive on the trace's schedule and an instance runs one prefill at a time; decode is not modelled).

Costs: the prefill rate and the host-to-GPU bandwidth are the project's own H200 measurements
(``benchmarks/results/ttft-h200.json``: Llama-3-8B's configuration, random weights, transformers'
SDPA, no hicache: the recompute row of 8192 + 256 tokens, and the measured H2D ceiling). The L3 load
cost is measured here, per page of this benchmark's pool (Llama-3-8B's KV heads, 4 of its 32 layers:
1 MiB pages of 64 tokens) and scaled by bytes to an 8B page (8 MiB): every figure is for Llama-3-8B.
The event stream is drained before each routing decision (the router has applied every event of
the requests before: at real request rates the events' lag is milliseconds), and each feed's audit runs
every ``--audit-every`` requests on the main thread (the 2 s audit of a live server), so a run is
deterministic.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from hicache_core.events import EventSubscriber, KVEventPublisher, Tier, sglang_block_hash
from hicache_core.plugins.registry import get_registry
from hicache_core.pool.device_pools import DeclaredDevicePool
from hicache_core.pool.host_pool import make_host_pool
from hicache_core.storage import make_storage, page_hashes

#: Tokens per page (SGLang's and hicache's usual page).
PAGE = 64
#: The benchmark pool: Llama-3-8B's KV (8 heads of 128, bf16) in 4 of its 32 layers, so a page is 1 MiB:
#: real bytes through the real store, a fraction of the disk traffic of full 8 MiB pages.
BENCH_LAYERS, MODEL_LAYERS = 4, 32
#: One page of Llama-3-8B: 32 layers x K and V x 8 heads x 128 x 2 bytes x 64 tokens.
MODEL_PAGE_BYTES = MODEL_LAYERS * 2 * 8 * 128 * 2 * PAGE
#: Prefill tokens per second: ttft-h200.json's recompute row, 8192-token prefix + 256 new in 0.2568 s.
PREFILL_TOK_S = (8192 + 256) / 0.25684876399999723
#: Host -> GPU bytes per second: ttft-h200.json's measured H2D ceiling (55.2 GB/s).
H2D_BYTES_S = 55.21808801518858e9
#: The seconds a host page takes to reach the GPU.
H2D_PAGE_S = MODEL_PAGE_BYTES / H2D_BYTES_S
PROVENANCE = {
    "prefill_tok_s": "benchmarks/results/ttft-h200.json, row recompute prefix 8192 new 256: Llama-3-8B config, "
                     "random weights, transformers SDPA, NVIDIA H200 (the project's own measurement)",
    "h2d_bytes_s": "benchmarks/results/ttft-h200.json, ceiling.h2d_gbps (NVIDIA H200, pinned host memory)",
    "l3_load": "measured in this run: PageStore read seconds per page (tier statistics' load_us_per_page, and "
               "each request's own timed read), scaled by bytes from this pool's page to Llama-3-8B's",
}  # fmt: skip
ROUTERS = ("gpu_only", "tier_aware")


# ---- the trace ------------------------------------------------------------------------------------


@dataclass
class TraceParams:
    users: int = 96
    system_prompts: int = 6
    system_pages: tuple[int, int] = (24, 40)  # pages of each system prompt (its tokens: x PAGE)
    turns: tuple[int, int] = (3, 7)
    user_tokens: tuple[int, int] = (96, 448)  # the user's message of each turn
    reply_tokens: tuple[int, int] = (64, 320)  # the answer, part of the next turn's prefix
    think_s: float = 2.0  # mean seconds between a request and the user's next turn
    session_rate: float = 15.0  # sessions started per second: with think_s, ~30 requests/s on the cluster
    zipf: float = 1.1  # system prompts' popularity: a few are used by most users
    seed: int = 53


@dataclass
class Request:
    t: float
    user: int
    turn: int
    prompt: list[int]
    reply: list[int]
    hashes: list[str] = field(default_factory=list)  # every whole page of prompt + reply, chained
    prompt_pages: int = 0  # how many of ``hashes`` lie wholly in the prompt


def make_trace(p: TraceParams) -> list[Request]:
    """Sessions of users over shared system prompts; each turn's prompt is the previous turn's prompt and
    reply, then the new message, so its page hashes extend the previous ones (SGLang's chained SHA-256)."""
    rng = random.Random(p.seed)
    vocab = 128_000
    systems = [[rng.randrange(vocab) for _ in range(PAGE * rng.randint(*p.system_pages))]
               for _ in range(p.system_prompts)]  # fmt: skip
    weights = [1 / (k + 1) ** p.zipf for k in range(p.system_prompts)]
    out: list[Request] = []
    start = 0.0
    for user in range(p.users):
        start += rng.expovariate(p.session_rate)
        history = list(rng.choices(systems, weights)[0])
        t = start
        for turn in range(rng.randint(*p.turns)):
            prompt = history + [rng.randrange(vocab) for _ in range(rng.randint(*p.user_tokens))]
            reply = [rng.randrange(vocab) for _ in range(rng.randint(*p.reply_tokens))]
            out.append(Request(t, user, turn, prompt, reply))
            history = prompt + reply
            t += rng.expovariate(1 / p.think_s)
    out.sort(key=lambda r: r.t)
    for r in out:
        r.hashes = page_hashes(r.prompt + r.reply, PAGE)
        r.prompt_pages = len(r.prompt) // PAGE
    return out


# ---- the simulated tiers ------------------------------------------------------------------------------


class PageLRU:
    """Page hashes, least recently used first. A request's pages are touched last-to-first, so a prefix
    outlives its continuations, as a radix cache evicts leaves first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.pages: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, h: str) -> bool:
        return h in self.pages

    def prefix(self, hashes: list[str]) -> int:
        return next((i for i, h in enumerate(hashes) if h not in self.pages), len(hashes))

    def put(self, hashes: list[str]) -> tuple[list[str], list[str]]:
        """Insert or touch ``hashes`` (chain order); returns (new, evicted)."""
        new = [h for h in hashes if h not in self.pages]
        for h in reversed(hashes):
            self.pages[h] = None
            self.pages.move_to_end(h)
        evicted = []
        while len(self.pages) > self.capacity:
            evicted.append(self.pages.popitem(last=False)[0])
        return new, evicted


class HostTier(PageLRU):
    """An instance's host tier, simulated, published through the instance's real publisher (host medium).

    It is attached to the publisher as a feed, so a late router's snapshot and the tier statistics carry
    it too; its load cost is the stated host-to-GPU copy of an 8B page, not a measurement here.
    """

    def __init__(self, capacity: int, publisher: KVEventPublisher, name: str) -> None:
        super().__init__(capacity)
        self.publisher = publisher
        self.tier = Tier("host", f"host://{name}", "LOCAL")
        publisher.attach(self)

    def put(self, hashes: list[str]) -> tuple[list[str], list[str]]:
        new, evicted = super().put(hashes)
        # Removals first: a page evicted and stored again in the same call is held at the end.
        self.publisher.removed(self.tier, [sglang_block_hash(h) for h in evicted])
        gone = set(evicted)
        kept = [h for h in new if h not in gone]
        if kept:
            self.publisher.stored(self.tier, [sglang_block_hash(h) for h in kept], PAGE)
        return kept, evicted

    def snapshot(self) -> tuple[Tier, int, list[Any]]:
        return self.tier, PAGE, [sglang_block_hash(h) for h in self.pages]

    def stats(self) -> dict[str, Any]:
        return {"kind": "host", "medium": self.publisher.format.medium(self.tier), "store": self.tier.store,
                "locality": "LOCAL", "reachable": True, "pages": len(self.pages), "page_bytes": MODEL_PAGE_BYTES,
                "block_size": PAGE, "capacity_pages": self.capacity, "load_us_per_page": H2D_PAGE_S * 1e6,
                "simulated": True}  # fmt: skip


# ---- an instance --------------------------------------------------------------------------------------


def staging_pool(pages: int) -> Any:
    """A real host pool of the benchmark's geometry: the pages the store reads into and writes from."""
    dev = DeclaredDevicePool(get_registry().pool_kinds["mha"], pages * PAGE, PAGE, BENCH_LAYERS, "cpu",
                             dtype=torch.bfloat16, rows={"k": (8, 128), "v": (8, 128)}, extras={})  # fmt: skip
    return make_host_pool(dev, layout="page_first", io_backend="auto", size=pages * PAGE)


@dataclass
class Served:
    """What one request did on its instance."""

    gpu: int = 0  # pages of the prompt in each tier
    host: int = 0
    l3: int = 0
    computed_tokens: int = 0  # prompt tokens prefilled
    recomputed_tokens: int = 0  # of those, in whole pages some tier of the cluster held
    l3_read_s: float = 0.0  # the real reads, wall time
    stale_l3: int = 0  # pages the router counted in L3 that the store no longer had


class Instance:
    def __init__(self, index: int, l3_dir: Path, args: argparse.Namespace) -> None:
        self.index = index
        self.name = f"instance-{index}"
        self.gpu = PageLRU(args.gpu_pages)
        self.publisher = KVEventPublisher("tcp://127.0.0.1:*", format="sglang", replay_endpoint="tcp://127.0.0.1:*",
                                          topic="kv", rank=0)  # fmt: skip
        self.host = HostTier(args.host_pages, self.publisher, self.name)
        self.pool = staging_pool(args.staging_pages)
        self.slots = self.pool.alloc(args.staging_pages * PAGE)
        capacity = args.l3_pages * (MODEL_PAGE_BYTES // (MODEL_LAYERS // BENCH_LAYERS) + 8192)
        self.store = make_storage(f"file://{l3_dir}?capacity={capacity}", self.pool, model_id="kv-routing/llama-3-8b",
                                  cluster_key=None)  # fmt: skip
        # Chained: each write's pages come in chain order. The audit runs on request (run_trace), not on a timer.
        self.feed = self.store.publish_events(self.publisher, audit_interval=None, chained=True)
        self.busy_until = 0.0
        self.staging = args.staging_pages

    def l3_read(self, hashes: list[str]) -> tuple[int, float]:
        """Read ``hashes`` from the store (a prefix of them may be had): pages read, wall seconds."""
        done, took = 0, 0.0
        for at in range(0, len(hashes), self.staging):
            chunk = hashes[at : at + self.staging]
            t0 = time.perf_counter()
            results = self.store.read_pages(chunk, self.slots[: len(chunk) * PAGE])
            took += time.perf_counter() - t0
            ok = next((i for i, r in enumerate(results) if not r.ok), len(results))
            done += ok
            if ok < len(chunk):
                break
        return done, took

    def l3_write(self, hashes: list[str]) -> float:
        took = 0.0
        for at in range(0, len(hashes), self.staging):
            chunk = hashes[at : at + self.staging]
            t0 = time.perf_counter()
            self.store.write_pages(chunk, self.slots[: len(chunk) * PAGE])
            took += time.perf_counter() - t0
        return took

    def serve(self, r: Request) -> Served:
        """Take what the tiers hold of the prompt's pages (GPU, then host, then the store, as hicache's
        prefetch does), recompute the rest; then keep the prompt and the reply in GPU and host and back the
        pages the store did not give up to it."""
        s = Served()
        pages = r.hashes[: r.prompt_pages]
        k = s.gpu = self.gpu.prefix(pages)
        while k < len(pages):
            if pages[k] in self.host:
                s.host += 1
                k += 1
                continue
            run = self.store.batch_exists(pages[k:])  # a real query; a miss also tells the feed
            if run == 0:
                break
            take = pages[k : k + run]
            in_host = [h in self.host for h in take]
            got, took = self.l3_read([h for h, here in zip(take, in_host) if not here])
            s.l3_read_s += took
            # A page read is usable only up to the first failed read (a chain is a prefix).
            ok_until, seen = 0, 0
            for here in in_host:
                if not here:
                    if seen == got:
                        break
                    seen += 1
                ok_until += 1
            s.host += sum(in_host[:ok_until])
            s.l3 += ok_until - sum(in_host[:ok_until])
            k += ok_until
            if ok_until < run:
                break
        s.computed_tokens = len(r.prompt) - k * PAGE
        return s

    def keep(self, r: Request, loaded_from_l3: int, first_computed: int) -> float:
        """After the request: prompt and reply into the GPU and host LRUs; computed pages to the store."""
        self.gpu.put(r.hashes)
        self.host.put(r.hashes)
        # The pages the store gave were there; everything computed (prompt or reply) is backed up.
        return self.l3_write(r.hashes[first_computed:])

    def close(self) -> None:
        self.feed.close()
        self.store.close()
        self.publisher.close()


# ---- the router ---------------------------------------------------------------------------------------


class Router:
    def __init__(self, mode: str, instances: list[Instance]) -> None:
        self.mode = mode
        self.instances = instances
        self.events = [0] * len(instances)

        def counter(i: int) -> Any:
            def on_batch(seq: int, batch: Any, received: float) -> None:
                self.events[i] += len(batch.events)

            return on_batch

        self.subs = [EventSubscriber(x.publisher.endpoint, format="sglang", replay_endpoint=x.publisher.replay_endpoint,
                                     topic="kv", on_batch=counter(i)) for i, x in enumerate(instances)]  # fmt: skip
        for sub in self.subs:
            sub.sync()
        self.l3_store = instances[0].feed.tier.store
        self.l3_medium = instances[0].publisher.format.medium(instances[0].feed.tier)
        self.costs: list[dict[tuple[str, str], float | None]] = [{} for _ in instances]
        self.reach: list[set[str]] = [set() for _ in instances]
        self.next_rr = 0

    def drain(self, timeout: float = 10.0) -> None:
        """Apply every event the instances published so far: each subscriber's view of the host tier and of
        the store equals what the instance holds (the publisher is asynchronous; this waits for its thread)."""
        deadline = time.monotonic() + timeout
        for x, sub in zip(self.instances, self.subs):
            host_medium = x.publisher.format.medium(x.host.tier)
            while True:
                want_host = {sglang_block_hash(h) for h in x.host.pages}
                want_l3 = {x.feed.block_hash(h) for h in x.feed.held()}
                if (sub.index.pages(host_medium, x.host.tier.store) == want_host
                        and sub.index.pages(self.l3_medium, self.l3_store) == want_l3):  # fmt: skip
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{x.name}'s events did not arrive within {timeout} s")
                sub.poll(0.002)

    def refresh_costs(self) -> None:
        """The tier statistics, asked of each publisher: which stores it reaches, what a page costs from each."""
        for i, sub in enumerate(self.subs):
            stats = sub.tier_stats()
            self.costs[i] = {}
            self.reach[i] = set()
            for t in stats["tiers"]:
                us = t.get("load_us_per_page")
                # Scaled by bytes to a Llama-3-8B page (the host tier's figure is already one).
                cost = us * 1e-6 * MODEL_PAGE_BYTES / t["page_bytes"] if us is not None else None
                self.costs[i][(t["medium"], t["store"])] = cost
                if t["kind"] != "host":
                    self.reach[i].add(t["store"])

    def l3_cost(self, i: int) -> float:
        """An 8B page from the store to instance ``i``'s GPU: its measured read, else any instance's, then H2D."""
        cost = self.costs[i].get((self.l3_medium, self.l3_store))
        if cost is None:
            known = [c[(self.l3_medium, self.l3_store)] for c in self.costs
                     if c.get((self.l3_medium, self.l3_store)) is not None]  # fmt: skip
            # Not measured yet: priced as recomputing the page, so no hit is claimed before a cost is known.
            cost = statistics.mean(known) if known else PAGE / PREFILL_TOK_S
        return cost + H2D_PAGE_S

    def expected(self, i: int, r: Request, t: float) -> tuple[float, int]:
        """Expected TTFT of ``r`` on instance ``i`` as this router sees it, and the pages it expects from L3."""
        x = self.instances[i]
        pages = r.hashes[: r.prompt_pages]
        wait = max(0.0, x.busy_until - t)
        k = x.gpu.prefix(pages)
        load, l3 = 0.0, 0
        if self.mode == "tier_aware":
            host_key = (x.publisher.format.medium(x.host.tier), x.host.tier.store)
            host_cost = self.costs[i].get(host_key) or H2D_PAGE_S
            l3_cost = self.l3_cost(i)
            host_index = self.subs[i].index
            while k < len(pages):
                bh = sglang_block_hash(pages[k])
                if host_index.holds(*host_key, bh):
                    load += host_cost
                elif self.l3_store in self.reach[i] and any(s.index.holds(self.l3_medium, self.l3_store, bh)
                                                            for s in self.subs):  # fmt: skip
                    load += l3_cost
                    l3 += 1
                else:
                    break
                k += 1
        compute = (len(r.prompt) - k * PAGE) / PREFILL_TOK_S
        return wait + load + compute, l3

    def choose(self, r: Request, t: float) -> tuple[int, int]:
        n = len(self.instances)
        scored = [(*self.expected(i, r, t), (i - self.next_rr) % n, i) for i in range(n)]
        best = min(scored, key=lambda s: (round(s[0], 9), s[2]))
        self.next_rr = (best[3] + 1) % n
        return best[3], best[1]

    def close(self) -> None:
        for sub in self.subs:
            sub.close()


# ---- one run ----------------------------------------------------------------------------------------------


def cluster_holds(instances: list[Instance], hashes: list[str]) -> list[bool]:
    """Whether any GPU, any host tier or the store holds each page: the truth, asked of the store itself
    (its backend, so no feed hears the question)."""
    x0 = instances[0]
    in_store = x0.store.backend.exists_objects(x0.store.namespace.keys(hashes)) if hashes else []
    return [any(h in x.gpu or h in x.host for x in instances) or s for h, s in zip(hashes, in_store)]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(round(q / 100 * (len(v) - 1)))))]


def run_trace(mode: str, trace: list[Request], args: argparse.Namespace) -> dict[str, Any]:
    l3_dir = Path(tempfile.mkdtemp(prefix=f"kv-routing-{mode}-", dir=args.l3_parent))
    instances = [Instance(i, l3_dir, args) for i in range(args.instances)]
    router = Router(mode, instances)
    wall0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    totals = {"prompt_tokens": 0, "gpu_tokens": 0, "host_tokens": 0, "l3_tokens": 0, "computed_tokens": 0,
              "recomputed_tokens": 0, "stale_l3_pages": 0, "l3_read_s": 0.0, "l3_write_s": 0.0}  # fmt: skip
    try:
        for n, r in enumerate(trace):
            if n % args.audit_every == 0:
                for (
                    x
                ) in instances:  # what the store dropped unseen (another instance's eviction), as a live feed finds it
                    x.feed.audit()
                router.drain()
                router.refresh_costs()
            router.drain()
            i, expected_l3 = router.choose(r, r.t)
            x = instances[i]
            pages = r.hashes[: r.prompt_pages]
            s = x.serve(r)
            k = s.gpu + s.host + s.l3
            s.recomputed_tokens = PAGE * sum(cluster_holds(instances, pages[k:]))
            s.stale_l3 = max(0, expected_l3 - s.l3) if mode == "tier_aware" else 0
            l3_s = s.l3_read_s * MODEL_PAGE_BYTES / x.store.page_bytes  # the real read, scaled to 8B pages
            load_s = (s.host + s.l3) * H2D_PAGE_S + l3_s
            compute_s = s.computed_tokens / PREFILL_TOK_S
            wait_s = max(0.0, x.busy_until - r.t)
            x.busy_until = r.t + wait_s + load_s + compute_s
            write_s = x.keep(r, s.l3, k)
            rows.append({"t": round(r.t, 4), "user": r.user, "turn": r.turn, "instance": i,
                         "prompt_tokens": len(r.prompt), "gpu_pages": s.gpu, "host_pages": s.host, "l3_pages": s.l3,
                         "computed_tokens": s.computed_tokens, "recomputed_tokens": s.recomputed_tokens,
                         "stale_l3_pages": s.stale_l3, "wait_s": wait_s, "load_s": load_s, "compute_s": compute_s,
                         "ttft_s": wait_s + load_s + compute_s})  # fmt: skip
            totals["prompt_tokens"] += len(r.prompt)
            totals["gpu_tokens"] += s.gpu * PAGE
            totals["host_tokens"] += s.host * PAGE
            totals["l3_tokens"] += s.l3 * PAGE
            totals["computed_tokens"] += s.computed_tokens
            totals["recomputed_tokens"] += s.recomputed_tokens
            totals["stale_l3_pages"] += s.stale_l3
            totals["l3_read_s"] += s.l3_read_s
            totals["l3_write_s"] += write_s
        router.drain()
        router.refresh_costs()
        wall = time.perf_counter() - wall0
        tiers = [sub.tier_stats()["tiers"] for sub in router.subs]
        published = sum(x.publisher.sent_events for x in instances)
        received = sum(router.events)
        feeds = [dict(x.feed.counts) for x in instances]
        l3_stats = [x.store.get_stats() for x in instances]
    finally:
        router.close()
        for x in instances:
            x.close()
        shutil.rmtree(l3_dir, ignore_errors=True)
    p = totals["prompt_tokens"]
    ttft = [row["ttft_s"] for row in rows]
    service = [row["load_s"] + row["compute_s"] for row in rows]
    per_instance = [sum(1 for row in rows if row["instance"] == i) for i in range(args.instances)]
    pages_read = sum(s.pages_read for s in l3_stats)
    read_s = sum(s.read_seconds for s in l3_stats)
    return {
        "router": mode,
        "requests": len(rows),
        "requests_per_instance": per_instance,
        "hit_rate": {
            "gpu": totals["gpu_tokens"] / p,
            "host": totals["host_tokens"] / p,
            "l3": totals["l3_tokens"] / p,
            "computed": totals["computed_tokens"] / p,
        },  # fmt: skip
        **{k: v for k, v in totals.items() if k.endswith("tokens") or k == "stale_l3_pages"},
        "ttft_s": {
            "p50": percentile(ttft, 50),
            "p90": percentile(ttft, 90),
            "p99": percentile(ttft, 99),
            "mean": statistics.fmean(ttft),
        },  # fmt: skip
        "ttft_without_queue_s": {
            "p50": percentile(service, 50),
            "p99": percentile(service, 99),
            "mean": statistics.fmean(service),
        },  # fmt: skip
        "l3": {
            "pages_read": pages_read,
            "read_s": read_s,
            "measured_us_per_bench_page": read_s / pages_read * 1e6 if pages_read else None,
            "us_per_8b_page": read_s / pages_read * 1e6 * MODEL_PAGE_BYTES / instances[0].store.page_bytes
            if pages_read
            else None,
            "write_s": totals["l3_write_s"],
            "evicted": sum(int(s.backend.get("evicted", 0)) for s in l3_stats),
        },  # fmt: skip
        "events": {
            "published": published,
            "received": received,
            "feeds": feeds,
            "replays": sum(s.replays for s in router.subs),
        },  # fmt: skip
        "tier_stats_at_end": tiers,
        "wall_s": wall,
        "rows": rows if args.rows else None,
    }


# ---- the record ----------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu, mem = "", 0
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
        mem = int(next(line.split()[1] for line in open("/proc/meminfo") if line.startswith("MemTotal"))) * 1024
    except (OSError, StopIteration):
        pass
    return {"hostname": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem,
            "platform": platform.platform(), "loadavg_before": open("/proc/loadavg").read().split()[:3]}  # fmt: skip


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("hicache-core", "hicache-storage-file", "pyzmq", "msgspec"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def summary_lines(results: Iterable[dict[str, Any]]) -> list[str]:
    lines = [f"{'router':11} {'gpu':>6} {'host':>6} {'l3':>6} {'comp':>6} {'recomputed':>11} {'p50 ms':>8} "
             f"{'p99 ms':>8} {'events':>7}"]  # fmt: skip
    for r in results:
        h = r["hit_rate"]
        lines.append(f"{r['router']:11} {h['gpu']:6.1%} {h['host']:6.1%} {h['l3']:6.1%} {h['computed']:6.1%} "
                     f"{r['recomputed_tokens']:11d} {r['ttft_s']['p50'] * 1e3:8.1f} {r['ttft_s']['p99'] * 1e3:8.1f} "
                     f"{r['events']['received']:7d}")  # fmt: skip
    return lines


def plot(path: Path, record: dict[str, Any]) -> bool:
    """Hit shares per tier, recomputed tokens and TTFT per router; ``False`` where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    res = record["results"]
    names = [r["router"] for r in res]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    bottom = [0.0] * len(res)
    for tier, colour in (("gpu", "#2ca02c"), ("host", "#1f77b4"), ("l3", "#9467bd"), ("computed", "#d62728")):
        vals = [r["hit_rate"][tier] * 100 for r in res]
        axes[0].bar(names, vals, bottom=bottom, color=colour, label=tier)
        bottom = [b + v for b, v in zip(bottom, vals)]
    axes[0].set_ylabel("% of prompt tokens")
    axes[0].set_title("where each prompt token came from")
    axes[0].legend(loc="lower right", fontsize=8)
    rec = [r["recomputed_tokens"] / 1e3 for r in res]
    axes[1].bar(names, rec, color="#d62728")
    for x, v in enumerate(rec):
        axes[1].text(x, v, f"{v * 1e3:,.0f}", ha="center", va="bottom")
    axes[1].set_ylabel("k tokens")
    axes[1].set_title("recomputed tokens (held somewhere in the cluster)")
    width = 0.35
    for j, (q, colour) in enumerate((("p50", "#7f7f7f"), ("p99", "#000000"))):
        vals = [r["ttft_s"][q] * 1e3 for r in res]
        axes[2].bar([x + (j - 0.5) * width for x in range(len(res))], vals, width, color=colour, label=q)
    axes[2].set_xticks(range(len(res)), names)
    axes[2].set_ylabel("ms")
    axes[2].set_title("implied TTFT (Llama-3-8B)")
    axes[2].legend(fontsize=8)
    fig.suptitle(f"KV-event routing: {record['params']['instances']} instances, shared file:// L3 "
                 f"({record['machine']['cores']}-core CPU, costs in the JSON)", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/kv-routing-cpu.json")
    ap.add_argument("--plot", default=None, help="the PNG (default: the JSON's name with .png)")
    ap.add_argument("--tiny", action="store_true", help="a small trace and cluster: seconds (the smoke test)")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--gpu-pages", type=int, default=160, help="pages each instance's GPU cache holds")
    ap.add_argument("--host-pages", type=int, default=640, help="pages each instance's host tier holds")
    ap.add_argument(
        "--l3-pages",
        type=int,
        default=320,
        help="pages each instance's view of the shared store may hold (the file backend's capacity)",
    )
    ap.add_argument("--staging-pages", type=int, default=48, help="the real host pool each store moves pages through")
    ap.add_argument("--audit-every", type=int, default=20, help="requests between two audits of every feed")
    ap.add_argument("--users", type=int, default=None)
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--l3-parent", default=None, help="where the shared L3 directory is made (default: the temp dir)")
    ap.add_argument("--rows", action="store_true", help="keep every request's row in the JSON")
    args = ap.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    params = TraceParams()
    if args.tiny:
        params = TraceParams(
            users=16, system_prompts=2, system_pages=(6, 10), turns=(3, 4), think_s=0.5, session_rate=8.0
        )
    if args.users is not None:
        params.users = args.users
    trace = make_trace(params)
    record: dict[str, Any] = {
        "what": __doc__.splitlines()[0],
        "machine": machine(),
        "versions": versions(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "params": {k: v for k, v in vars(args).items() if k not in ("out", "plot")},
        "trace": {**asdict(params), "requests": len(trace), "prompt_tokens": sum(len(r.prompt) for r in trace),
                  "distinct_pages": len({h for r in trace for h in r.hashes}), "page_tokens": PAGE},  # fmt: skip
        "costs": {"prefill_tok_s": PREFILL_TOK_S, "h2d_bytes_s": H2D_BYTES_S, "model_page_bytes": MODEL_PAGE_BYTES,
                  "h2d_us_per_page": H2D_PAGE_S * 1e6, "recompute_us_per_page": PAGE / PREFILL_TOK_S * 1e6,
                  "bench_layers": BENCH_LAYERS, "model_layers": MODEL_LAYERS, "provenance": PROVENANCE},  # fmt: skip
        "simulated": ["GPU prefix cache (an LRU of page hashes per instance, read directly by both routers)",
                      "the model (prefill priced at prefill_tok_s; decode not modelled)",
                      "host tier (an LRU of page hashes per instance publishing host-medium events through the "
                      "real publisher; its load priced at h2d_bytes_s)",
                      "time (a simulated clock; one prefill at a time per instance)"],
        "real": ["PageStore on a shared file:// directory per instance (its own LRU capacity), real page reads "
                 "and writes through a real host pool, timed", "KVEventPublisher per instance (SGLang format, "
                 "TCP, replay socket), StoreFeed with audits", "EventSubscriber per instance in the router "
                 "(snapshot, stream, tier statistics)"],
        "results": [],
    }  # fmt: skip
    for mode in args.routers.split(","):
        res = run_trace(mode, trace, args)
        record["results"].append(res)
        print(summary_lines([res])[-1], f"({res['wall_s']:.1f} s)", flush=True)
    by = {r["router"]: r for r in record["results"]}
    if "gpu_only" in by and "tier_aware" in by:
        g, a = by["gpu_only"], by["tier_aware"]
        record["tier_aware_vs_gpu_only"] = {
            "recomputed_tokens_cut": 1 - a["recomputed_tokens"] / g["recomputed_tokens"]
            if g["recomputed_tokens"] else 0.0,
            "computed_tokens_cut": 1 - a["computed_tokens"] / g["computed_tokens"],
            "ttft_p50_ratio": a["ttft_s"]["p50"] / g["ttft_s"]["p50"],
            "ttft_p99_ratio": a["ttft_s"]["p99"] / g["ttft_s"]["p99"],
        }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = Path(args.plot) if args.plot else out.with_suffix(".png")
    record["plot"] = str(png.name) if plot(png, record) else "not drawn: matplotlib is not installed"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print("\n".join(summary_lines(record["results"])))
    if "tier_aware_vs_gpu_only" in record:
        print({k: round(v, 3) for k, v in record["tier_aware_vs_gpu_only"].items()})
    return record


if __name__ == "__main__":
    main()
