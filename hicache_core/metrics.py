"""Counters and histograms of what hicache moved, and why the L3 tier missed: a plain Python API.

Every figure lives here once; ``hicache stats`` prints it, :func:`snapshot` returns it, and
:func:`register_prometheus` exports it through ``prometheus_client`` when that is installed
(an optional dependency: nothing here imports it otherwise).

Recording is cheap and lock-free on the hot path: each thread adds into its own shard
(a dict, touched only by that thread), and a reader sums the shards. A metric's labelled
child (``PAGES.labels(op="load", impl="x")``) is cached, so a record is a dict update.
Measured on the 2-core development VM (CPython 3.11): a counter ``inc`` 0.15 us, a histogram
``observe`` 0.25 us. One host pool transfer's record (two counters, one histogram) finds this thread's
three shards in one cached tuple and updates them in place.

What is measured:

* ``hicache_transfer_pages_total`` / ``_bytes_total`` {op, impl}: pages and bytes each host pool
  transfer call was given (``op`` is the operation: ``load_to_device_per_layer``,
  ``backup_from_device_per_layer`` or ``backup_from_device_all_layer``).
* ``hicache_transfer_submit_seconds`` {op, impl}: host time to *submit* one transfer call. GPU time
  is not measured: it would need a synchronisation on the caller's stream, which the hot path must
  never do; a server that wants it records CUDA events around its own calls.
* ``hicache_host_pool_pages`` {state}: host pool occupancy (``used``, ``capacity``), summed over the
  live host pools of this process, read when a snapshot is taken.
* ``hicache_host_pinned_bytes`` {pool}: host memory pinned by the live host pools of this process (their
  buffers, checksum tables and drop words) and by staging buffers, per pool label, read when a snapshot is taken.
* ``hicache_l3_pages_total`` {op, outcome}: every L3 page read or written, by its outcome
  (``ok``, ``missing``, ``corrupt``, ``mismatch``, ``auth_failed``, ``full``, ``error``, ``timeout``, ...).
* ``hicache_l3_bytes_total`` {op}: bytes of L3 pages moved (header included).
* ``hicache_l3_prefetch_pages_total`` {result, reason}: pages a prefetch asked for, ``hit`` or
  ``miss`` with the reason code of :mod:`hicache_core.storage.explain`.
* ``hicache_checksum_failures_total`` {tier}: pages whose checksum failed (``l3``, ``host``);
  :func:`record_checksum_failure` is the one entry point.
* ``hicache_l3_auth_failures_total`` {why}: L3 pages read that did not authenticate with the
  cluster key (``unkeyed``, ``other_key``, ``bad_tag``, ``no_key_here``); each is also an
  ``auth_failed`` outcome of ``hicache_l3_pages_total``. :func:`record_auth_failure` records them.
* ``hicache_dropped_indices_total``: transfer calls whose out-of-range or malformed indices a
  kernel masked (reported by ``check_dropped`` and the next call).
"""

from __future__ import annotations

import bisect
import json
import os
import threading
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .pool.pool_events import PoolObserver
from .settings.variables import METRICS_DIR

_LABEL_OK = frozenset("abcdefghijklmnopqrstuvwxyz_")
#: The folder where snapshots and outcome memories go by default, and where the tools read them.
ENV_METRICS_DIR = METRICS_DIR.name


def metrics_dir() -> str | None:
    """The folder ``HICACHE_METRICS_DIR`` names (``None``: unset or empty); read here only."""
    return METRICS_DIR.read()


def default_path(file: str, who: str) -> Path:
    """``<HICACHE_METRICS_DIR>/<file>``, or ``ValueError`` saying that ``who`` needs a path."""
    folder = metrics_dir()
    if folder is None:
        raise ValueError(f"{who} needs a path, or {ENV_METRICS_DIR} set to a folder")
    return Path(folder) / file


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        if not name or not set(name) <= _LABEL_OK | set("0123456789"):
            raise ValueError(f"metric name {name!r}: lower-case letters, digits and _ only")
        for label in labelnames:
            if not label or not set(label) <= _LABEL_OK:
                raise ValueError(f"label name {label!r}: lower-case letters and _ only")
        self.name = name
        self.help = help
        self.labelnames = tuple(labelnames)
        self._tls = threading.local()
        self._shards: list[tuple[Any, dict]] = []  # (weakref to the thread, its shard)
        self._retired: dict = {}  # what shards of finished threads had added
        self._lock = threading.Lock()  # only for the shard list (once per thread) and for readers
        self._children: dict[tuple, Any] = {}

    def labels(self, **labels: Any) -> Any:
        """The child for these label values (cached: hold on to it on a hot path)."""
        key = tuple(str(labels.pop(n)) if n in labels else _missing(self, n) for n in self.labelnames)
        if labels:
            raise ValueError(f"{self.name} has no label(s) {', '.join(sorted(labels))}; labels: {self.labelnames}")
        child = self._children.get(key)
        if child is None:
            child = self._children.setdefault(key, self._child(key))
        return child

    def _shard(self) -> dict:
        try:
            return self._tls.shard
        except AttributeError:
            shard: dict = {}
            self._tls.shard = shard
            with self._lock:
                self._shards.append((weakref.ref(threading.current_thread()), shard))
            return shard

    def _collect(self) -> dict:
        """Label values -> the summed value, over every thread that ever recorded."""
        with self._lock:
            live = []
            for ref, shard in self._shards:
                if ref() is None or not ref().is_alive():
                    for k, v in list(shard.items()):
                        self._retired[k] = self._merge(self._retired.get(k), v)
                else:
                    live.append((ref, shard))
            self._shards = live
            total = dict(self._retired)
            shards = [s for _, s in live]
        for shard in shards:
            for k, v in list(shard.items()):
                total[k] = self._merge(total.get(k), v)
        return total

    def _reset(self) -> None:
        with self._lock:
            for _, shard in self._shards:
                shard.clear()
            self._retired.clear()


def _missing(metric: _Metric, label: str) -> str:
    raise ValueError(f"{metric.name} needs label {label!r} (labels: {', '.join(metric.labelnames)})")


class _CounterChild:
    __slots__ = ("_metric", "_key")

    def __init__(self, metric: Counter, key: tuple) -> None:
        self._metric, self._key = metric, key

    def inc(self, amount: float = 1) -> None:
        """Add ``amount`` (>= 0)."""
        if amount < 0:
            raise ValueError(f"{self._metric.name}: a counter only goes up, got {amount}")
        shard = self._metric._shard()
        shard[self._key] = shard.get(self._key, 0) + amount


class Counter(_Metric):
    """A monotonically increasing count per label values (``inc``)."""

    kind = "counter"

    def _child(self, key: tuple) -> _CounterChild:
        return _CounterChild(self, key)

    @staticmethod
    def _merge(a: Any, b: Any) -> Any:
        return b if a is None else a + b

    def inc(self, amount: float = 1, **labels: Any) -> None:
        self.labels(**labels).inc(amount)

    def values(self) -> dict[tuple, float]:
        return self._collect()


#: Seconds: from 10 us (a launch) to 10 s (an L3 batch against a slow store).
TIME_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)


class _HistogramChild:
    __slots__ = ("_metric", "_key", "_bounds")

    def __init__(self, metric: Histogram, key: tuple) -> None:
        self._metric, self._key, self._bounds = metric, key, metric.buckets

    def observe(self, value: float) -> None:
        shard = self._metric._shard()
        cell = shard.get(self._key)
        if cell is None:
            cell = shard[self._key] = [0] * (len(self._bounds) + 1) + [0.0]
        cell[bisect.bisect_left(self._bounds, value)] += 1
        cell[-1] += value


class Histogram(_Metric):
    """Observations per label values in fixed buckets, with their sum (``observe``)."""

    kind = "histogram"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = (),
                 buckets: Sequence[float] = TIME_BUCKETS) -> None:  # fmt: skip
        super().__init__(name, help, labelnames)
        if list(buckets) != sorted(set(buckets)) or not buckets:
            raise ValueError(f"{name}: buckets must be increasing and distinct, got {buckets}")
        self.buckets = tuple(float(b) for b in buckets)

    def _child(self, key: tuple) -> _HistogramChild:
        return _HistogramChild(self, key)

    @staticmethod
    def _merge(a: Any, b: Any) -> Any:
        return list(b) if a is None else [x + y for x, y in zip(a, b)]

    def observe(self, value: float, **labels: Any) -> None:
        self.labels(**labels).observe(value)

    def values(self) -> dict[tuple, dict[str, Any]]:
        """Label values -> ``{"count", "sum", "buckets": [(upper bound, cumulative count), ...]}``."""
        out = {}
        for key, cell in self._collect().items():
            cumulative, running = [], 0
            for bound, n in zip((*self.buckets, float("inf")), cell[:-1]):
                running += n
                cumulative.append((bound, running))
            out[key] = {"count": running, "sum": cell[-1], "buckets": cumulative}
        return out


class Gauge(_Metric):
    """A value read when a snapshot is taken, from a function (``set_function``)."""

    kind = "gauge"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help, labelnames)
        self._fn: Any = None

    def set_function(self, fn: Any) -> None:
        """``fn()`` returns ``{label values tuple: value}``."""
        self._fn = fn

    def values(self) -> dict[tuple, float]:
        return dict(self._fn()) if self._fn is not None else {}


# ---- hicache's metrics -------------------------------------------------------------------------

TRANSFER_PAGES = Counter("hicache_transfer_pages_total", "Host pool transfer pages, per operation and implementation",
                         ("op", "impl"))  # fmt: skip
TRANSFER_BYTES = Counter("hicache_transfer_bytes_total", "Host pool transfer bytes, per operation and implementation",
                         ("op", "impl"))  # fmt: skip
TRANSFER_SUBMIT = Histogram("hicache_transfer_submit_seconds", "Host time to submit one host pool transfer call "
                            "(not GPU time)", ("op", "impl"))  # fmt: skip
HOST_POOL_PAGES = Gauge("hicache_host_pool_pages", "Host pool pages of this process's live pools", ("state",))
HOST_PINNED_BYTES = Gauge("hicache_host_pinned_bytes", "Host memory pinned by this process's live host pools, tables "
                          "and staging buffers, per pool", ("pool",))  # fmt: skip
L3_PAGES = Counter("hicache_l3_pages_total", "L3 pages read or written, by outcome", ("op", "outcome"))
L3_BYTES = Counter("hicache_l3_bytes_total", "L3 bytes moved (pages read or written ok, header included)", ("op",))
L3_PREFETCH = Counter("hicache_l3_prefetch_pages_total", "Pages L3 prefetches asked for: hit, or miss by reason",
                      ("result", "reason"))  # fmt: skip
CHECKSUM_FAILURES = Counter("hicache_checksum_failures_total", "Pages whose checksum failed, per tier", ("tier",))
L3_AUTH_FAILURES = Counter("hicache_l3_auth_failures_total", "L3 pages read that the cluster key did not authenticate, "
                           "by why", ("why",))  # fmt: skip
DROPPED_INDICES = Counter("hicache_dropped_indices_total", "Transfer calls whose indices a kernel masked")

METRICS: tuple[_Metric, ...] = (TRANSFER_PAGES, TRANSFER_BYTES, TRANSFER_SUBMIT, HOST_POOL_PAGES, HOST_PINNED_BYTES,
                                L3_PAGES, L3_BYTES, L3_PREFETCH, CHECKSUM_FAILURES, L3_AUTH_FAILURES,
                                DROPPED_INDICES)  # fmt: skip

_POOLS: weakref.WeakSet = weakref.WeakSet()


def track_host_pool(pool: Any) -> None:
    """Count ``pool`` in ``hicache_host_pool_pages`` while it lives (``make_host_pool`` calls this)."""
    _POOLS.add(pool)


def live_host_pools() -> list[Any]:
    """The host pools of this process that were not garbage-collected (destroyed ones included)."""
    return list(_POOLS)


def _pool_pages() -> dict[tuple, float]:
    used = capacity = 0
    for pool in list(_POOLS):
        if getattr(pool, "_destroyed", False):
            continue
        page = pool.page_size
        capacity += pool.size // page
        used += (pool.size - pool.available_size()) // page
    return {("used",): used, ("capacity",): capacity}


HOST_POOL_PAGES.set_function(_pool_pages)


def _pinned_bytes() -> dict[tuple, float]:
    from .host_memory import pinned_bytes_by_label

    return {(label,): n for label, n in pinned_bytes_by_label().items() if n}


HOST_PINNED_BYTES.set_function(_pinned_bytes)


_TRANSFER_SHARDS = threading.local()
_BOUNDS = TRANSFER_SUBMIT.buckets


def _transfer_shards(op: str, impl: str) -> tuple[dict, tuple, dict, tuple, dict, tuple]:
    """This thread's shards of the three transfer metrics and the keys of ``(op, impl)`` in them (cached per
    thread: a record is then three dict updates, with no lookup of a thread's shard per metric)."""
    try:
        cache = _TRANSFER_SHARDS.cache
    except AttributeError:
        cache = _TRANSFER_SHARDS.cache = {}
    found = cache[(op, impl)] = (TRANSFER_PAGES._shard(), TRANSFER_PAGES.labels(op=op, impl=impl)._key,
                                 TRANSFER_BYTES._shard(), TRANSFER_BYTES.labels(op=op, impl=impl)._key,
                                 TRANSFER_SUBMIT._shard(), TRANSFER_SUBMIT.labels(op=op, impl=impl)._key)  # fmt: skip
    return found


def record_transfer(op: str, impl: str, pages: int, nbytes: int, seconds: float) -> None:
    """One host pool transfer call: its pages, bytes and host submission time (the per-layer hot path)."""
    try:
        pshard, pkey, bshard, bkey, sshard, skey = _TRANSFER_SHARDS.cache[(op, impl)]
    except (AttributeError, KeyError):
        pshard, pkey, bshard, bkey, sshard, skey = _transfer_shards(op, impl)
    pshard[pkey] = pshard.get(pkey, 0) + pages
    bshard[bkey] = bshard.get(bkey, 0) + nbytes
    cell = sshard.get(skey)
    if cell is None:  # the first record, or the first since a reset
        cell = sshard[skey] = [0] * (len(_BOUNDS) + 1) + [0.0]
    cell[bisect.bisect_left(_BOUNDS, seconds)] += 1
    cell[-1] += seconds


class TransferMetrics(PoolObserver):
    """The transfer counters as an observer of host pools (``make_host_pool`` attaches it to every pool)."""

    # The function itself, not a method calling it: the pool calls this once per transfer call.
    transferred = staticmethod(record_transfer)  # type: ignore[assignment]


#: The one observer every host pool gets: it holds nothing, the counters it feeds are the process's.
TRANSFER_METRICS = TransferMetrics()


def record_checksum_failure(tier: str, pages: int = 1) -> None:
    """Pages whose checksum failed in ``tier`` (``"l3"``: a stored page; ``"host"``: a host-tier page)."""
    if tier not in ("l3", "host"):
        raise ValueError(f"checksum failure tier must be 'l3' or 'host', got {tier!r}")
    if not isinstance(pages, int) or isinstance(pages, bool) or pages < 1:
        raise ValueError(f"pages must be a positive int, got {pages!r}")
    CHECKSUM_FAILURES.labels(tier=tier).inc(pages)


#: Why a page read failed authentication (``hicache_l3_auth_failures_total``'s label).
AUTH_FAILURE_WHYS = ("unkeyed", "other_key", "bad_tag", "no_key_here")


def record_auth_failure(why: str, pages: int = 1) -> None:
    """L3 pages that failed authentication: written ``unkeyed`` (without a key), with an ``other_key``, a
    ``bad_tag`` (changed, or copied under another key), or keyed while this instance has ``no_key_here``."""
    if why not in AUTH_FAILURE_WHYS:
        raise ValueError(f"auth failure must be one of {AUTH_FAILURE_WHYS}, got {why!r}")
    L3_AUTH_FAILURES.labels(why=why).inc(pages)


def record_dropped_indices(calls: int = 1) -> None:
    """Transfer calls whose indices a kernel masked (counted when they are reported)."""
    DROPPED_INDICES.labels().inc(calls)


def snapshot() -> dict[str, Any]:
    """Every metric: ``{name: {"type", "help", "labels", "values": [{"labels": {...}, "value": ...}]}}``."""
    out: dict[str, Any] = {}
    for m in METRICS:
        rows = [{"labels": dict(zip(m.labelnames, key)), "value": value} for key, value in sorted(m.values().items())]
        out[m.name] = {"type": m.kind, "help": m.help, "labels": list(m.labelnames), "values": rows}
    return out


def reset() -> None:
    """Zero every counter and histogram of this process (tests, benchmarks)."""
    for m in METRICS:
        m._reset()


def merge_snapshots(snapshots: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Sum snapshots of several processes (counters and histograms add; gauges add too)."""
    out: dict[str, Any] = {}
    for snap in snapshots:
        for name, metric in snap.items():
            into = out.setdefault(name, {**metric, "values": []})
            for row in metric["values"]:
                same = next((r for r in into["values"] if r["labels"] == row["labels"]), None)
                if same is None:
                    into["values"].append(json.loads(json.dumps(row)))
                elif isinstance(row["value"], dict):
                    v, w = same["value"], row["value"]
                    v["count"] += w["count"]
                    v["sum"] += w["sum"]
                    v["buckets"] = [[b, x + y] for (b, x), (_, y) in zip(v["buckets"], w["buckets"])]
                else:
                    same["value"] += row["value"]
    return out


def write_snapshot(path: str | os.PathLike | None = None) -> Path:
    """Write :func:`snapshot` as JSON (atomically) to ``path``, default ``$HICACHE_METRICS_DIR/hicache-<pid>.json``."""
    if path is None:
        path = default_path(f"hicache-{os.getpid()}.json", "write_snapshot")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(snapshot(), default=_json_inf))
    os.replace(tmp, path)
    return path


def _json_inf(x: Any) -> Any:
    raise TypeError(f"not JSON serialisable: {x!r}")


def format_text(snap: dict[str, Any]) -> str:
    """The lines ``hicache stats`` prints: one per metric and label values (histograms: count, sum, mean)."""
    lines = []
    for name, metric in snap.items():
        for row in metric["values"]:
            labels = ",".join(f"{k}={v}" for k, v in row["labels"].items())
            shown = f"{name}{{{labels}}}" if labels else name
            value = row["value"]
            if isinstance(value, dict):
                mean = value["sum"] / value["count"] if value["count"] else 0.0
                lines.append(f"{shown} count={value['count']} sum={value['sum']:.6g}s mean={mean * 1e6:.1f}us")
            else:
                lines.append(f"{shown} {value:g}")
    return "\n".join(lines) if lines else "(no hicache metrics recorded)"


# ---- prometheus_client (optional) ----------------------------------------------------------------


def prometheus_collector(prefix: str = "") -> Any:
    """A ``prometheus_client`` collector of every metric, names prefixed (SGLang's style: ``"sglang:"``).

    :raises ImportError: ``prometheus_client`` is not installed (it is optional: pip install prometheus-client).
    """
    try:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    except ImportError as exc:
        raise ImportError("hicache's Prometheus export needs prometheus_client, an optional dependency: "
                          "pip install 'hicache-core[metrics]' (or prometheus-client)") from exc  # fmt: skip

    class _Collector:
        def collect(self) -> Any:
            for m in METRICS:
                name = prefix + m.name
                values = m.values()
                if isinstance(m, Counter):
                    fam = CounterMetricFamily(name.removesuffix("_total"), m.help, labels=m.labelnames)
                    for key, v in values.items():
                        fam.add_metric(list(key), v)
                elif isinstance(m, Histogram):
                    fam = HistogramMetricFamily(name, m.help, labels=m.labelnames)
                    for key, v in values.items():
                        buckets = [("+Inf" if b == float("inf") else repr(b), n) for b, n in v["buckets"]]
                        fam.add_metric(list(key), buckets, v["sum"])
                else:
                    fam = GaugeMetricFamily(name, m.help, labels=m.labelnames)
                    for key, v in values.items():
                        fam.add_metric(list(key), v)
                yield fam

        def describe(self) -> list:
            return []

    return _Collector()


def register_prometheus(registry: Any = None, prefix: str = "") -> Any:
    """Register :func:`prometheus_collector` with ``registry`` (default: prometheus_client's global one)."""
    collector = prometheus_collector(prefix)  # first: its ImportError says how to install the extra
    if registry is None:
        from prometheus_client import REGISTRY as registry  # noqa: N811
    registry.register(collector)
    return collector
