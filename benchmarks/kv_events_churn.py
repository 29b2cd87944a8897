"""KV events under churn at scale: the lag from a page acknowledged to its event received, and the index's agreement.

Run on a CPU machine (no GPU needed)::

    python benchmarks/kv_events_churn.py --out benchmarks/results/kv-events-churn-cpu.json

One process plays a server instance: several page stores publish through one
:class:`~hicache_core.events.KVEventPublisher` (SGLang's format over TCP), each written by a thread of its own
(tens of thousands of page writes, as a server's backups run beside each other), with audits in the background
(``--audit-s``), and churn in the middle of the run: a ``file://`` tier whose LRU evicts (reported), a
redis-server under ``maxmemory`` with ``allkeys-lru`` (evicts unseen: the audits find it), pages written again,
a weight update, a cluster-key rotation, and a Redis server killed and restarted empty.

Two routers follow in OTHER processes over TCP (``--role subscriber``): one from the start, which times every
batch, and one that joins halfway through the snapshot. The lag of a batch is its ``ts`` (the time its first event
was queued, right after the store acknowledged the write) to the moment the subscriber received it; empty batches
(heartbeats) are left out. After the run (a last audit, every event in), each router's index is compared with what
each store holds: ``exists_objects`` on every key ever written, in the current namespace. Bars (issue 53): lag
p99 <= 50 ms, at most 0.1 % of an index's entries stale, no page a store holds missing from it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
FORMAT = "sglang"


# ---- the routers (other processes: no torch, only the events' own imports) ---------------------------------


def subscriber_main(args: argparse.Namespace) -> None:
    """Follow the publisher until ``--done`` names a sequence this router reached; then write what it saw."""
    from hicache_core.events import EventSubscriber

    lags: list[tuple[float, int]] = []  # (seconds, events) per non-empty batch

    def on_batch(seq: int, batch: Any, received: float) -> None:
        if batch.events:
            lags.append((received - batch.ts, len(batch.events)))

    sub = EventSubscriber(args.endpoint, format=FORMAT, replay_endpoint=args.replay,
                          on_batch=on_batch if args.timed else None)  # fmt: skip
    sub.sync(timeout=60)
    Path(args.ready).write_text("1")
    done = Path(args.done)
    final = None
    while True:
        sub.poll(0.05)
        if final is None and done.exists():
            final = int(done.read_text())
        if final is not None and sub.last_seq >= final:
            break
    index = {f"{medium}|{store}": sorted(pages) for (medium, store), pages in sub.index.tiers.items()}
    out = {"lags": lags, "index": index, "gaps": sub.gaps, "replays": sub.replays, "last_seq": sub.last_seq}
    Path(args.result).write_text(json.dumps(out))
    sub.close()


def _start_subscriber(endpoint: str, replay: str, work: Path, name: str, timed: bool) -> subprocess.Popen:
    argv = [sys.executable, str(Path(__file__).resolve()), "--role", "subscriber", "--endpoint", endpoint,
            "--replay", replay, "--ready", str(work / f"{name}.ready"), "--done", str(work / "done"),
            "--result", str(work / f"{name}.json")] + (["--timed"] if timed else [])  # fmt: skip
    proc = subprocess.Popen(argv)
    deadline = time.monotonic() + 60
    while not (work / f"{name}.ready").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the {name} subscriber did not start (exit code {proc.poll()})")
        time.sleep(0.01)
    return proc


# ---- the instance ---------------------------------------------------------------------------------------------


def _pool(pages: int, page_size: int) -> Any:
    """A small host pool (2 layers, one KV head of 64 bf16 values: 2 KiB pages at 4 tokens): the run is about events."""
    import torch

    from hicache_core.plugins.registry import get_registry
    from hicache_core.pool.device_pools import DeclaredDevicePool
    from hicache_core.pool.host_pool import make_host_pool

    dev = DeclaredDevicePool(get_registry().pool_kinds["mha"], pages * page_size, page_size, 2, "cpu",
                             dtype=torch.bfloat16, rows={"k": (1, 64), "v": (1, 64)}, extras={})  # fmt: skip
    host = make_host_pool(dev, layout="page_first", io_backend="auto", size=pages * page_size)
    gen = torch.Generator().manual_seed(pages)
    for t in host.plan.host_buffers.values():
        flat = t.reshape(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, generator=gen))
    return host


class Writer(threading.Thread):
    """Writes ``pages`` pages to one store in batches, rewriting some recent ones (overwrites); churn on request."""

    def __init__(self, name: str, store: Any, pages: int, batch: int, base: int, page_size: int,
                 overwrite_every: int) -> None:  # fmt: skip
        super().__init__(name=f"writer-{name}", daemon=True)
        self.tier_name = name
        self.store = store
        self.pages = pages
        self.batch = batch
        self.base = base
        self.page_size = page_size
        self.overwrite_every = overwrite_every
        self.written: set[str] = set()
        self.acked = 0
        self.failed = 0
        self.calls = 0
        self.half = threading.Event()  # half its pages written
        self.hooks: list[tuple[int, Any]] = []  # (at page count, callable) churn steps run in this thread
        self.error: BaseException | None = None

    def run(self) -> None:
        import torch

        from hicache_core.storage import page_hashes

        try:
            p = self.page_size
            slots = (torch.arange(self.batch)[:, None] * p + torch.arange(p)).reshape(-1)
            recent: list[str] = []
            done = 0
            while done < self.pages:
                for at, hook in list(self.hooks):
                    if done >= at:
                        hook()
                        self.hooks.remove((at, hook))
                tokens = range(self.base + done * p, self.base + (done + self.batch) * p)
                keys = page_hashes(list(tokens), p)
                self.calls += 1
                if self.overwrite_every and self.calls % self.overwrite_every == 0 and len(recent) >= self.batch:
                    keys = recent[-self.batch :]  # the same keys again
                else:
                    done += self.batch
                    recent = (recent + keys)[-4 * self.batch :]
                results = self.store.write_pages(keys, slots)
                ok = [r.key for r in results if r.ok]
                self.written.update(ok)
                self.acked += len(ok)
                self.failed += len(results) - len(ok)
                if done >= self.pages // 2:
                    self.half.set()
        except BaseException as exc:  # reported by the main thread
            self.error = exc
            self.half.set()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def machine() -> dict[str, Any]:
    import msgspec
    import zmq

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    redis = subprocess.run([shutil.which("redis-server") or "redis-server", "--version"], capture_output=True,
                           text=True).stdout.strip()  # fmt: skip
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(), "platform": platform.platform(),
            "python": platform.python_version(), "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(),
            "msgspec": msgspec.__version__, "redis_server": redis,
            "loadavg_before": open("/proc/loadavg").read().split()[:3]}  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    from hicache_core.events import KVEventPublisher, format_named
    from hicache_core.storage import make_storage
    from hicache_core.storage.page_auth import ClusterKey
    from hicache_core.testing.servers import start_redis

    fmt = format_named(FORMAT)
    work = Path(tempfile.mkdtemp(prefix="kv-events-churn-"))
    page_size = 4
    info = machine()
    servers = []
    stores: dict[str, Any] = {}
    procs: list[subprocess.Popen] = []
    publisher = None
    try:
        (work / "redis-lru").mkdir()
        (work / "redis-plain").mkdir()
        lru = start_redis(work / "redis-lru", "--maxmemory", args.redis_maxmemory, "--maxmemory-policy",
                          "allkeys-lru", "--maxmemory-samples", "10")  # fmt: skip
        plain = start_redis(work / "redis-plain")
        servers += [lru, plain]
        publisher = KVEventPublisher("tcp://127.0.0.1:*", format=FORMAT, replay_endpoint="tcp://127.0.0.1:*")
        key = ClusterKey(b"kv-events-churn-benchmark-key-0123456789abcdef", "benchmark key")
        rotated = ClusterKey(b"kv-events-churn-benchmark-key-rotated-fedcba98", "rotated key")
        pool = {name: _pool(args.batch, page_size) for name in ("file", "redis-lru", "redis-plain")}
        page_on_disk = None
        urls = {
            "file": f"file://{work / 'l3'}",
            "redis-lru": f"redis://127.0.0.1:{lru.port}/0?prefix=b:",
            "redis-plain": f"redis://127.0.0.1:{plain.port}/0?prefix=b:",
        }
        from hicache_core.storage.pages import PageMap

        pm = PageMap(pool["file"])
        page_on_disk = pm.page_bytes + pm.trailer_bytes + 4096  # the file tier's header block
        stores["file"] = make_storage(urls["file"] + f"?capacity={args.file_capacity_pages * page_on_disk}",
                                      pool["file"], model_id="churn-bench", cluster_key=key)  # fmt: skip
        for name in ("redis-lru", "redis-plain"):
            stores[name] = make_storage(urls[name], pool[name], model_id="churn-bench", cluster_key=None)
        feeds = {name: s.publish_events(publisher, audit_interval=args.audit_s) for name, s in stores.items()}
        early = _start_subscriber(publisher.endpoint, publisher.replay_endpoint, work, "early", timed=True)
        procs.append(early)

        writers = {name: Writer(name, s, args.pages, args.batch, base=i * 10_000_000, page_size=page_size,
                                overwrite_every=args.overwrite_every)
                   for i, (name, s) in enumerate(stores.items())}  # fmt: skip
        churn: list[dict[str, Any]] = []

        def step(what: str, fn: Any) -> Any:
            def hook() -> None:
                t0 = time.time()
                fn()
                churn.append({"step": what, "at_s": round(t0 - started, 3), "took_s": round(time.time() - t0, 3)})

            return hook

        def restart_empty() -> None:
            lru.stop()
            feeds["redis-lru"].audit()  # unreachable: everything removed
            lru.start()
            for _ in range(100):  # the connection the restart broke fails once; the audit's next pass finds it up
                feeds["redis-lru"].audit()
                if feeds["redis-lru"].reachable:
                    break
                time.sleep(0.02)

        third = args.pages // 3
        writers["redis-plain"].hooks.append((third, step("weight update (redis-plain)",
                                                         lambda: stores["redis-plain"].set_weight_version("v2"))))
        writers["file"].hooks.append((third, step("key rotation (file)",
                                                  lambda: stores["file"].rotate_cluster_key(rotated))))
        writers["redis-lru"].hooks.append((2 * third, step("redis-lru killed, restarted empty", restart_empty)))
        started = time.time()
        cpu0 = os.times()
        for w in writers.values():
            w.start()
        for w in writers.values():  # the second router joins halfway, through the snapshot
            w.half.wait()
        t_join = time.time()
        late = _start_subscriber(publisher.endpoint, publisher.replay_endpoint, work, "late", timed=False)
        procs.append(late)
        join_s = time.time() - t_join
        for w in writers.values():
            w.join()
            if w.error is not None:
                raise w.error
        churn_s = time.time() - started
        cpu1 = os.times()
        events_in_run = publisher.sent_events

        # After the run: the audits stop, a last pass each, every event out, then the routers' indexes.
        for f in feeds.values():
            f._stop.set()  # the background audit: the last pass is the one below
            if f._thread is not None:
                f._thread.join(30)
        for f in feeds.values():
            f.audit()
        while not publisher._queue.empty():
            time.sleep(0.01)
        time.sleep(0.1)  # the batch taken off the queue is sent
        (work / "done").write_text(str(publisher.sent_batches - 1))
        for p in procs:
            p.wait(120)
        seen = {name: json.loads((work / f"{name}.json").read_text()) for name in ("early", "late")}

        lag_ms = [lag * 1e3 for lag, _ in seen["early"]["lags"]]
        per_event = [lag * 1e3 for lag, n in seen["early"]["lags"] for _ in range(n)]
        agreement = {}
        for name, store in stores.items():
            feed = feeds[name]
            keys = sorted(writers[name].written)
            ns = store.namespace
            present: list[str] = []
            for at in range(0, len(keys), 512):
                chunk = keys[at : at + 512]
                present += [k for k, p in zip(chunk, store.backend.exists_objects(ns.keys(chunk))) if p]
            # What a reader would load: another instance of the cluster (its key, its weights, no events; a read
            # through the publishing store would announce what it checks) reads every page the store holds.
            checker = make_storage(urls[name], _pool(args.batch, page_size), model_id="churn-bench",
                                   cluster_key=store.cluster_key, weight_version=store.weight_version)  # fmt: skip
            try:
                status = {k: checker.check_page(k).status.value for k in present}
            finally:
                checker.close()
            held = {fmt.block_hash(k) for k in present}
            loadable = {fmt.block_hash(k) for k, st in status.items() if st == "ok"}
            # Not "missing": Redis may evict a page while the check reads others (its replies take memory too).
            refused = {fmt.block_hash(k) for k, st in status.items() if st not in ("ok", "missing")}
            tier_key = f"{fmt.medium(feed.tier)}|{feed.tier.store}"
            agreement[name] = {"pages_written": writers[name].acked, "write_failed": writers[name].failed,
                               "store_holds": len(held), "loadable": len(loadable),
                               "refused": len(refused),
                               "evicted_during_check": len(held) - len(loadable) - len(refused),
                               "feed_counts": dict(sorted(feed.counts.items()))}  # fmt: skip
            for who, result in seen.items():
                index = set(result["index"].get(tier_key, []))
                stale = len(index - held)
                agreement[name][who] = {"index_entries": len(index), "stale": stale,
                                        "stale_fraction": stale / len(index) if index else 0.0,
                                        "refused_indexed": len(index & refused),
                                        "missing": len(loadable - index)}  # fmt: skip
        figures = {
            "batches": len(lag_ms), "events": len(per_event),
            "p50_ms": statistics.median(lag_ms), "p99_ms": _percentile(lag_ms, 0.99), "max_ms": max(lag_ms),
            "per_event_p50_ms": statistics.median(per_event), "per_event_p99_ms": _percentile(per_event, 0.99),
        }  # fmt: skip
        bars = {
            "lag_p99_le_50ms": figures["p99_ms"] <= 50.0,
            "stale_le_0.1pct": all(a[w]["stale_fraction"] <= 0.001 for a in agreement.values() for w in seen),
            "none_missing": all(a[w]["missing"] == 0 for a in agreement.values() for w in seen),
            "no_refused_page_indexed": all(a[w]["refused_indexed"] == 0 for a in agreement.values() for w in seen),
        }
        return {
            "benchmark": "kv_events_churn",
            "what": "KV events of 3 page stores under churn (one publisher, SGLang format, TCP); routers in other "
            "processes; lag = batch ts (queued right after the store acknowledged) -> received",
            "machine": info,
            "config": {"pages_per_store": args.pages, "batch": args.batch, "page_bytes": pm.page_bytes,
                       "overwrite_every": args.overwrite_every, "audit_s": args.audit_s,
                       "file_capacity_pages": args.file_capacity_pages, "redis_maxmemory": args.redis_maxmemory,
                       "writer_threads": len(writers), "heartbeat_s": publisher.heartbeat},  # fmt: skip
            "run": {"churn_s": round(churn_s, 3), "page_writes": sum(w.acked + w.failed for w in writers.values()),
                    "write_calls": sum(w.calls for w in writers.values()),
                    "events_sent": events_in_run, "events_per_s": round(events_in_run / churn_s, 1),
                    "batches_sent": publisher.sent_batches,
                    "cpu_s": round((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system), 3),
                    "late_join_s": round(join_s, 3), "churn": churn,
                    "loadavg_after": open("/proc/loadavg").read().split()[:3],
                    "routers": {w: {k: seen[w][k] for k in ("gaps", "replays", "last_seq")}
                                for w in seen}},  # fmt: skip
            "lag": {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()},
            "agreement": agreement,
            "bars": bars,
        }
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for s in stores.values():
            s.close()
        if publisher is not None:
            publisher.close()
        for server in servers:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=("run", "subscriber"), default="run")
    parser.add_argument("--pages", type=int, default=12_000, help="pages written per store (default 12000)")
    parser.add_argument("--batch", type=int, default=16, help="pages per write (default 16)")
    parser.add_argument("--overwrite-every", type=int, default=8, help="every Nth write repeats recent keys")
    parser.add_argument("--audit-s", type=float, default=1.0, help="seconds between two audits of a store")
    parser.add_argument("--file-capacity-pages", type=int, default=3000)
    parser.add_argument("--redis-maxmemory", default="8mb")
    parser.add_argument("--out", type=Path, default=None)
    for name in ("endpoint", "replay", "ready", "done", "result"):
        parser.add_argument(f"--{name}")
    parser.add_argument("--timed", action="store_true")
    args = parser.parse_args()
    if args.role == "subscriber":
        subscriber_main(args)
        return 0
    sys.path.insert(0, str(HERE.parent))
    result = run(args)
    text = json.dumps(result, indent=2)
    print(json.dumps({"lag": result["lag"], "run": {k: v for k, v in result["run"].items() if k != "churn"},
                      "bars": result["bars"]}, indent=2))  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0 if all(result["bars"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
