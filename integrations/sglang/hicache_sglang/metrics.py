"""hicache's metrics on SGLang's own ``/metrics``, named in SGLang's style: ``sglang:hicache_...``.

SGLang 0.5.23 (``--enable-metrics``) runs prometheus_client in multiprocess mode: the launcher
sets ``PROMETHEUS_MULTIPROC_DIR`` before it starts the scheduler processes, every metric a
process creates keeps its values in a file of that folder, and the HTTP process serves
``/metrics`` from a fresh registry holding only prometheus_client's ``MultiProcessCollector``
over the folder (``sglang.srt.utils.add_prometheus_middleware``). hicache records its figures
(:mod:`hicache_core.metrics`) in the scheduler processes, where the host pools move pages; a
collector registered there would never be asked, and the HTTP process holds none of the numbers.

So each scheduler process *mirrors* hicache's figures into prometheus_client metrics of its own
(:class:`PrometheusMirror`): counters by the increase since the last sync, histograms bucket by
bucket, the host pool gauge as ``livesum`` (summed over the live ranks). prometheus_client writes
them to the folder; SGLang's collector reads them beside its own ``sglang:*`` metrics, and sums
the ranks. The mirror syncs every ``HICACHE_METRICS_INTERVAL`` seconds (default 5) from a daemon
thread, and once more at exit. Without ``PROMETHEUS_MULTIPROC_DIR`` (metrics off) nothing starts.
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Any

from hicache_core import metrics as hm
from hicache_core.settings import text

from .variables import METRICS_INTERVAL

logger = logging.getLogger(__name__)

PREFIX = "sglang:"
DEFAULT_INTERVAL: float = METRICS_INTERVAL.default
INTERVAL = METRICS_INTERVAL
ENV_INTERVAL = INTERVAL.name
#: SGLang's own variable: set (for --enable-metrics) where prometheus_client runs in multiprocess mode.
MULTIPROC_DIR = text("PROMETHEUS_MULTIPROC_DIR")

_lock = threading.Lock()
_mirror: PrometheusMirror | None = None


class PrometheusMirror:
    """prometheus_client metrics that follow hicache's, named ``prefix + name`` (``sglang:hicache_...``).

    :meth:`sync` brings them up to date with this process's :mod:`hicache_core.metrics`.
    In multiprocess mode their values land in ``PROMETHEUS_MULTIPROC_DIR``, where SGLang's
    HTTP process reads them.
    """

    def __init__(self, prefix: str = PREFIX) -> None:
        import prometheus_client as prom

        self.prefix = prefix
        self._mirrors: dict[str, Any] = {}
        self._seen: dict[tuple[str, tuple], Any] = {}
        self._lock = threading.Lock()
        for m in hm.METRICS:
            name = prefix + m.name
            # registry=None: values reach the multiprocess folder either way; no global registration to collide.
            if isinstance(m, hm.Counter):
                self._mirrors[m.name] = prom.Counter(name, m.help, m.labelnames, registry=None)
            elif isinstance(m, hm.Histogram):
                self._mirrors[m.name] = prom.Histogram(name, m.help, m.labelnames, registry=None, buckets=m.buckets)
            else:
                self._mirrors[m.name] = prom.Gauge(name, m.help, m.labelnames, registry=None,
                                                   multiprocess_mode="livesum")  # fmt: skip

    def sync(self) -> None:
        """Add what hicache recorded since the last sync (a counter that went down was reset: all of it is new)."""
        with self._lock:
            for m in hm.METRICS:
                mirror = self._mirrors[m.name]
                for key, value in m.values().items():
                    child = mirror.labels(*key) if m.labelnames else mirror
                    if isinstance(m, hm.Gauge):
                        child.set(value)
                    elif isinstance(m, hm.Counter):
                        before = self._seen.get((m.name, key), 0)
                        delta = value - before if value >= before else value
                        if delta:
                            child.inc(delta)
                    else:
                        self._sync_histogram(m.name, key, child, value)
                    self._seen[(m.name, key)] = value

    def _sync_histogram(self, name: str, key: tuple, child: Any, value: dict[str, Any]) -> None:
        counts = _per_bucket(value["buckets"])
        before = self._seen.get((name, key))
        old_counts, old_sum = (_per_bucket(before["buckets"]), before["sum"]) if before else ([0] * len(counts), 0.0)
        if before is not None and (value["count"] < before["count"] or any(n < o for n, o in zip(counts, old_counts))):
            old_counts, old_sum = [0] * len(counts), 0.0  # reset since the last sync
        # prometheus_client observes one value at a time; hicache hands over bucket counts, so they go
        # into the child's per-bucket values (prometheus_client 0.21: Histogram._buckets, ._sum).
        buckets = getattr(child, "_buckets", None)
        if buckets is None or len(buckets) != len(counts) or not hasattr(child, "_sum"):
            raise RuntimeError(f"{self.prefix}{name}: this prometheus_client's Histogram keeps no per-bucket values "
                               "hicache can add to (tested with prometheus_client 0.21.1)")  # fmt: skip
        for cell, new, old in zip(buckets, counts, old_counts):
            if new > old:
                cell.inc(new - old)
        if value["sum"] > old_sum:
            child._sum.inc(value["sum"] - old_sum)


def _per_bucket(cumulative: list) -> list[int]:
    out, prev = [], 0
    for _, n in cumulative:
        out.append(n - prev)
        prev = n
    return out


def start(interval: float | None = None) -> PrometheusMirror | None:
    """Start this process's mirror once (SGLang's host pool builder calls this); ``None`` where metrics are off.

    Metrics are on when ``PROMETHEUS_MULTIPROC_DIR`` is set (SGLang sets it for ``--enable-metrics``).
    """
    global _mirror
    if MULTIPROC_DIR.read() is None:
        return None
    with _lock:
        if _mirror is not None:
            return _mirror
        try:
            from prometheus_client import values
        except ImportError:
            logger.warning("hicache: PROMETHEUS_MULTIPROC_DIR is set but prometheus_client is not installed; "
                           "hicache's metrics are not on /metrics (pip install 'hicache-core[metrics]')")  # fmt: skip
            return None
        if values.ValueClass is values.MutexValue:
            logger.warning("hicache: prometheus_client was imported before PROMETHEUS_MULTIPROC_DIR was set, so this "
                           "process's metric values stay in memory and hicache's metrics cannot reach /metrics; "
                           "`hicache stats` and hicache_core.metrics.snapshot() still have them")  # fmt: skip
            return None
        if interval is None:
            interval = INTERVAL.read()
        _mirror = PrometheusMirror()
        _mirror.sync()
        threading.Thread(target=_loop, args=(_mirror, interval), name="hicache-metrics", daemon=True).start()
        atexit.register(_mirror.sync)
        return _mirror


def _loop(mirror: PrometheusMirror, interval: float) -> None:
    stop = threading.Event()
    while not stop.wait(interval):
        try:
            mirror.sync()
        except Exception:  # noqa: BLE001 - a failed sync is logged, never kills the scheduler; the next one retries
            logger.exception("hicache: syncing metrics to prometheus_client failed")


def sync() -> None:
    """Sync this process's mirror now (nothing where :func:`start` did not start one)."""
    if _mirror is not None:
        _mirror.sync()
