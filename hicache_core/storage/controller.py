"""The storage controller: asynchronous backup and prefetch between the host pool and a storage backend.

It works on host memory only: the caller moves pages device <-> host on its own CUDA
stream, and hands a backup an event to wait for (``ready=``); the controller's worker
thread waits for that event, never the caller's stream.

* **Backup** (one worker thread, a bounded queue): writes the pages of a token prefix
  that the store lacks, in batches of 128, stopping after a batch with a failure (later
  pages of a prefix are unreachable without it). Policies: ``write_through`` backs up
  on insertion, ``write_through_selective`` only once a prefix was hit ``selective_threshold``
  times, ``write_back`` only when the host pool evicts it (``evicting=True``).
* **Prefetch** (one worker thread, a bounded queue): finds how many leading pages the
  store holds, agrees with the other ranks on the minimum, reserves host slots, reads in
  batches, agrees again on what every rank loaded, and frees the slots it did not fill.
  Policies decide when a caller stops waiting: ``best_effort`` takes what has arrived,
  ``wait_complete`` waits for all of it, ``timeout`` waits up to
  ``min(max, base + per_ki_token * tokens / 1024)`` seconds.
* **Ranks** (``group=`` a gloo group): every rank must submit the same prefetches in the
  same order, as SGLang's scheduler does. Each prefetch then runs exactly two
  ``all_reduce(MIN)`` on every rank, whether it was cancelled, refused, failed or found
  nothing, so no rank can wait for a collective another rank skipped.

* **Weight versions** (:meth:`StorageController.set_weight_version`): a backup queued before the
  change writes nothing after it (its pages were computed with the old weights), and a prefetch
  whose reads overlapped the change completes no page.

Every wait has a timeout, and every page's outcome is reported (:class:`PageResult`) and
counted (:meth:`StorageController.stats`).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .. import metrics as _metrics
from .agreement import AgreementFailed, AgreementTimeout, RanksDisagreed, agree_min, check_group, keys_digest
from .backend import PageResult, PageStatus
from .explain import LOADED, Outcomes, explain_miss, reason_of_status
from .keys import page_hashes
from .page_store import STORAGE_BATCH_SIZE, PageStore
from .weights import OLD_WEIGHT_VERSION

log = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


@dataclass(frozen=True)
class PrefetchTimeout:
    """The ``timeout`` policy's limit: ``min(max_s, base_s + per_ki_token_s * tokens / 1024)`` (SGLang's defaults)."""

    base_s: float = 2.0
    per_ki_token_s: float = 0.1
    max_s: float = 30.0

    def for_tokens(self, tokens: int) -> float:
        return min(self.max_s, self.base_s + self.per_ki_token_s * tokens / 1024)


class _Future:
    """A result a worker thread fills in; poll with :meth:`done`, wait with :meth:`result` (always with a timeout)."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self._done = threading.Event()
        self._cancel = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> bool:
        """Ask the worker to skip what it has not started; false when it already finished."""
        self._cancel.set()
        return not self._done.is_set()

    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def _set(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._done.set()

    def _wait(self, timeout: float) -> Any:
        if not self._done.wait(timeout):
            raise TimeoutError(f"{type(self).__name__} not done within {timeout:g} s")
        if self._error is not None:
            raise self._error
        return self._value


@dataclass
class BackupResult:
    """What a backup did, page by page (``skipped``: already stored, or after a failed page)."""

    results: list[PageResult]

    @property
    def written(self) -> int:
        return sum(r.ok for r in self.results)

    @property
    def failed(self) -> list[PageResult]:
        return [r for r in self.results if r.status not in (PageStatus.OK, PageStatus.SKIPPED)]

    @property
    def stored_prefix(self) -> int:
        """Leading pages now in the store (written, or found there)."""
        n = 0
        for r in self.results:
            if not (r.ok or (r.status is PageStatus.SKIPPED and r.detail == _ALREADY)):
                break
            n += 1
        return n


class BackupFuture(_Future):
    """A pending backup."""

    def result(self, timeout: float = 60.0) -> BackupResult:
        return self._wait(timeout)


@dataclass
class PrefetchResult:
    """A finished prefetch.

    ``completed`` leading pages were loaded on every rank; their host slots are
    ``host_indices`` (whole pages, now the caller's: load them to the device, free them
    when done). Slots of pages that did not complete were already freed.
    """

    keys: list[str]
    local_hits: int
    agreed_hits: int
    completed: int
    host_indices: torch.Tensor
    results: list[PageResult] = field(default_factory=list)
    terminated: bool = False
    error: str = ""
    epoch: int = 0  # the store's weight-version epoch its pages were read under

    @property
    def tokens(self) -> int:
        return int(self.host_indices.numel())


class PrefetchFuture(_Future):
    """A pending prefetch. :meth:`result` waits as the controller's prefetch policy says."""

    def __init__(self, keys: list[str], controller: StorageController, tokens: int) -> None:
        super().__init__(keys)
        self._controller = controller
        self._terminate = threading.Event()
        self._deliver_lock = threading.Lock()
        self._abandoned: TimeoutError | None = None
        self.tokens_requested = tokens
        self.submitted = time.monotonic()

    def terminate(self) -> None:
        """Stop reading after the batch in flight; the result holds what arrived (agreed by all ranks)."""
        self._terminate.set()

    def result(self, timeout: float | None = None) -> PrefetchResult:
        """Wait per policy, then return what completed.

        Pages read under a weight version the store has left since are not handed over: their
        slots are freed and the result completes none (``error`` says why).

        ``best_effort``: terminate now, wait only for the batch in flight. ``wait_complete``:
        wait for every page. ``timeout``: wait until the policy's limit, then terminate.
        Waits after a terminate are bounded by the controller's ``op_timeout`` (or ``timeout``).

        When that wait runs out, the prefetch is *abandoned*: this raises ``TimeoutError``, and
        when the worker finishes it frees every host slot it reserved (none stays reserved for a
        caller who will never take it); a later ``result()`` raises the same ``TimeoutError``.
        """
        return self._controller._current_weights(self._result(timeout))

    def _result(self, timeout: float | None) -> PrefetchResult:
        ctl = self._controller
        bound = ctl.op_timeout if timeout is None else timeout
        if ctl.prefetch_policy == "best_effort":
            self.terminate()
        elif ctl.prefetch_policy == "timeout":
            limit = ctl.prefetch_timeout.for_tokens(self.tokens_requested)
            remaining = self.submitted + limit - time.monotonic()
            if remaining > 0 and self._done.wait(min(remaining, bound)):
                return self._wait(0)
            self.terminate()
        if self._done.wait(bound):
            return self._wait(0)
        with self._deliver_lock:
            if not self._done.is_set():
                self._abandoned = TimeoutError(
                    f"prefetch not done within {bound:g} s: abandoned; the worker frees its host slots when it finishes"
                )
        return self._wait(0) if self._abandoned is None else self._raise_abandoned()

    def _raise_abandoned(self) -> PrefetchResult:
        raise self._abandoned

    def _deliver(self, value: PrefetchResult | None = None, error: BaseException | None = None) -> bool:
        """Hand the worker's result over; false (the caller frees the slots) when the caller abandoned it."""
        with self._deliver_lock:
            if self._abandoned is not None:
                self._set(error=self._abandoned)
                return False
            self._set(value, error)
            return True


_ALREADY = "already in the store"


@dataclass
class _Backup:
    keys: list[str]
    pages: list[int]
    future: BackupFuture
    ready: Any
    epoch: int = 0


@dataclass
class _Prefetch:
    keys: list[str]
    future: PrefetchFuture
    refused: str = ""


_STOP = object()


class StorageController:
    """Backs pages up to, and prefetches them from, one storage backend, on worker threads.

    :param storage: a bound :class:`PageStore` (:func:`make_storage` with a host pool).
    :param write_policy: ``write_through``, ``write_through_selective`` or ``write_back``.
    :param prefetch_policy: ``best_effort``, ``wait_complete`` or ``timeout``.
    :param group: a gloo process group of the ranks that must agree on hit lengths
        (tensor-parallel ranks); ``None`` for one rank.
    :param tp_rank: this rank in its tensor-parallel group; with a rank-replicated pool (MLA)
        only rank 0 writes.
    :param queue_depth: requests each worker queue holds; beyond it a backup is refused
        (reported, counted) and a prefetch joins the queue as a refusal that only takes part
        in the rank agreement (contributing 0), so ranks stay in step.
    :param batch_pages: pages per backend call (128, as SGLang).
    :param op_timeout: the longest any single wait may take (collectives, events, results).
    """

    def __init__(
        self,
        storage: PageStore,
        *,
        write_policy: str = "write_through",
        prefetch_policy: str = "best_effort",
        prefetch_timeout: PrefetchTimeout | None = None,
        group: Any = None,
        tp_rank: int = 0,
        selective_threshold: int = 2,
        queue_depth: int = 64,
        batch_pages: int = STORAGE_BATCH_SIZE,
        op_timeout: float = 60.0,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy {write_policy!r}; choose one of {', '.join(WRITE_POLICIES)}")
        if prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"prefetch_policy {prefetch_policy!r}; choose one of {', '.join(PREFETCH_POLICIES)}")
        if storage.host_pool is None:
            raise ValueError("the page store is not bound to a host pool: use make_storage(url, host_pool, ...)")
        if not 1 <= batch_pages <= STORAGE_BATCH_SIZE:
            raise ValueError(f"batch_pages must be in [1, {STORAGE_BATCH_SIZE}], got {batch_pages}")
        if queue_depth < 1 or op_timeout <= 0:
            raise ValueError("queue_depth must be >= 1 and op_timeout > 0")
        if group is not None:
            check_group(group)
        self.storage = storage
        self.host_pool = storage.host_pool
        self.page_size = self.host_pool.page_size
        self.write_policy = write_policy
        self.prefetch_policy = prefetch_policy
        self.prefetch_timeout = prefetch_timeout or PrefetchTimeout()
        self.group = group
        self.selective_threshold = selective_threshold
        self.tp_rank = tp_rank
        self.batch_pages = batch_pages
        self.op_timeout = op_timeout
        self.writes_here = not (storage.namespace.share.startswith("replicated") and tp_rank != 0)
        self._counts: dict[str, int] = dict.fromkeys(
            ("backups", "backup_pages_written", "backup_pages_already_stored", "backup_pages_failed",
             "backup_skipped_by_policy", "backup_skipped_replica", "backup_refused_queue_full", "prefetches",
             "prefetch_refused_queue_full", "prefetch_cancelled", "prefetch_pages_hit", "prefetch_pages_agreed",
             "prefetch_pages_loaded", "prefetch_pages_failed", "prefetch_terminated", "prefetch_no_host_space",
             "prefetch_abandoned", "prefetch_abandoned_pages_freed", "agreement_timeouts", "agreement_disagreements",
             "backup_skipped_old_weights", "prefetch_pages_old_weights"),
            0,
        )  # fmt: skip
        self._lock = threading.Lock()
        self._broken = ""
        self._seq = 0  # collectives issued on this rank's group (carried in each one, see agreement.py)
        self.outcomes = Outcomes()  # the last outcome of each page key (bounded), for explain_miss
        self._backup_q: queue.Queue = queue.Queue(maxsize=queue_depth)
        self._prefetch_q: queue.Queue = queue.Queue()  # bounded by _prefetch_slots (see queue_depth)
        self._prefetch_slots = threading.BoundedSemaphore(queue_depth)
        self._closed = False
        self._threads = [
            threading.Thread(target=self._backup_loop, name="hicache-l3-backup", daemon=True),
            threading.Thread(target=self._prefetch_loop, name="hicache-l3-prefetch", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---- the caller's side ---------------------------------------------------------------------

    def backup(
        self,
        token_ids: Sequence[Any],
        host_indices: torch.Tensor,
        *,
        prior_hash: str | None = None,
        hit_count: int = 1,
        evicting: bool = False,
        ready: Any = None,
    ) -> BackupFuture:
        """Back up the host pages holding ``token_ids`` (whole pages at ``host_indices``).

        :param hit_count: how often this prefix was hit (``write_through_selective``).
        :param evicting: the host pool is about to evict these pages (``write_back`` backs up now;
            wait on the future before freeing the slots).
        :param ready: a CUDA event recorded after the device-to-host copy; the worker waits for it.
        Returns at once; the future's result lists every page's outcome.
        """
        self._check_open()
        keys = page_hashes(token_ids, self.page_size, prior_hash)
        pages = self.storage.page_ids(keys, _whole_pages(host_indices, len(keys), self.page_size))
        future = BackupFuture(keys)
        skip = self._policy_skip(hit_count, evicting)
        if skip:
            self._count("backup_skipped_by_policy" if "policy" in skip else "backup_skipped_replica")
            future._set(BackupResult([PageResult(k, PageStatus.SKIPPED, skip) for k in keys]))
            return future
        try:
            self._backup_q.put_nowait(_Backup(keys, pages, future, ready, self.storage.weights.epoch))
        except queue.Full:
            self._count("backup_refused_queue_full")
            detail = f"backup queue full ({self._backup_q.maxsize} pending)"
            future._set(BackupResult([PageResult(k, PageStatus.ERROR, detail) for k in keys]))
        return future

    def prefetch(self, token_ids: Sequence[Any], *, prior_hash: str | None = None) -> PrefetchFuture:
        """Start loading the stored pages of ``token_ids`` into newly reserved host slots."""
        self._check_open()
        keys = page_hashes(token_ids, self.page_size, prior_hash)
        future = PrefetchFuture(keys, self, len(keys) * self.page_size)
        request = _Prefetch(keys, future)
        if not self._prefetch_slots.acquire(blocking=False):
            # Refused here, but it still joins the queue (no I/O): the other ranks run this
            # prefetch's collectives too, and would wait forever for a rank that skipped them.
            self._count("prefetch_refused_queue_full")
            request.refused = "prefetch queue full"
        self._prefetch_q.put(request)
        return future

    def set_weight_version(self, version: str) -> bool:
        """The server's weights changed: serve ``version``'s pages from now on (:meth:`PageStore.set_weight_version`).

        Backups still queued write nothing; a prefetch whose reads overlap the change completes no
        page. False when ``version`` is the current one. Call it on every rank.
        """
        self._check_open()
        return self.storage.set_weight_version(version)

    def explain_miss(self, token_ids: Sequence[Any], *, prior_hash: str | None = None,
                     host_pages: int | Sequence[bool] | None = None) -> Any:  # fmt: skip
        """Why the pages of ``token_ids`` would not (or did not) hit (:func:`.explain.explain_miss`).

        :param host_pages: what the caller's host tier holds of this prefix (its radix tree knows):
            a count of leading pages, or one bool per page; ``None`` when unknown.
        """
        self._check_open()
        return explain_miss(self.storage, token_ids, prior_hash=prior_hash, host_pages=host_pages,
                            outcomes=self.outcomes, rank=self.tp_rank, broken=self._broken)  # fmt: skip

    def write_outcomes(self, path: str | os.PathLike | None = None) -> Path:
        """Write the outcome memory for ``hicache explain-miss`` (atomically), beside the metrics snapshot by default.

        Default path: ``$HICACHE_METRICS_DIR/hicache-outcomes-<pid>-rank<r>.json``. Only this memory
        knows ``timed_out``, ``ranks_disagreed``, ``host_pool_full`` and the like: they leave no
        trace in the store. A server calls this when it writes its metrics snapshot.
        """
        if path is None:
            path = _metrics.default_path(f"hicache-outcomes-{os.getpid()}-rank{self.tp_rank}.json", "write_outcomes")
        return self.outcomes.write(path, namespace=self.storage.namespace.prefix, rank=self.tp_rank,
                                   broken=self._broken)  # fmt: skip

    def stats(self) -> dict[str, Any]:
        """The controller's counters, and the backend's under ``storage``."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
        out["broken"] = self._broken
        out["backup_queue"] = self._backup_q.qsize()
        out["prefetch_queue"] = self._prefetch_q.qsize()
        out["storage"] = self.storage.get_stats().as_dict()
        return out

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued work, then stop the workers (each join bounded by ``timeout``)."""
        if self._closed:
            return
        self._closed = True
        self._backup_q.put(_STOP)
        self._prefetch_q.put(_STOP)
        for t in self._threads:
            t.join(timeout)
            if t.is_alive():
                log.warning("hicache L3 worker %s did not stop within %s s", t.name, timeout)

    def __enter__(self) -> StorageController:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- internals -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this StorageController is closed")

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _policy_skip(self, hit_count: int, evicting: bool) -> str:
        if not self.writes_here:
            return "rank-replicated pool: TP rank 0 writes the shared copy"
        if self.write_policy == "write_back" and not evicting:
            return "write_back policy backs up on eviction (evicting=True)"
        if self.write_policy != "write_back" and evicting:
            return f"{self.write_policy} policy backed up on insertion"
        if self.write_policy == "write_through_selective" and hit_count < self.selective_threshold:
            return f"write_through_selective policy: hit count {hit_count} < {self.selective_threshold}"
        return ""

    def _backup_loop(self) -> None:
        while True:
            job = self._backup_q.get()
            if job is _STOP:
                return
            try:
                job.future._set(self._run_backup(job))
            except BaseException as exc:  # noqa: BLE001 - reported on the future, the worker lives on
                log.exception("hicache L3 backup failed")
                job.future._set(error=exc)

    def _run_backup(self, job: _Backup) -> BackupResult:
        self._count("backups")
        results: list[PageResult] = []
        keys, pages = job.keys, job.pages
        if job.future.cancelled():
            return BackupResult([PageResult(k, PageStatus.CANCELLED) for k in keys])
        if job.epoch != self.storage.weights.epoch:
            self._count("backup_skipped_old_weights")
            detail = "the weight version changed after this backup was queued: its pages are of the old weights"
            return BackupResult([PageResult(k, PageStatus.SKIPPED, detail) for k in keys])
        if job.ready is not None and not _wait_event(job.ready, self.op_timeout):
            detail = f"device-to-host copy not finished within {self.op_timeout:g} s"
            self._count("backup_pages_failed", len(keys))
            return BackupResult([PageResult(k, PageStatus.TIMEOUT, detail) for k in keys])
        failed_at = None
        for start in range(0, len(keys), self.batch_pages):
            bk, bp = keys[start : start + self.batch_pages], pages[start : start + self.batch_pages]
            if failed_at is not None or job.future.cancelled():
                why = f"an earlier page ({failed_at}) failed" if failed_at else "cancelled"
                status = PageStatus.SKIPPED if failed_at else PageStatus.CANCELLED
                results += [PageResult(k, status, why) for k in bk]
                continue
            try:
                present = self.storage.backend.exists_objects(self.storage.namespace.keys(bk))
            except Exception:  # noqa: BLE001 - cannot tell: write them all
                present = [False] * len(bk)
            todo = [i for i, p in enumerate(present) if not p]
            written = self.storage.write_pages([bk[i] for i in todo], _slots(bp, todo, self.page_size))
            by_index = dict(zip(todo, written))
            for i, k in enumerate(bk):
                r = by_index.get(i, PageResult(k, PageStatus.SKIPPED, _ALREADY))
                results.append(r)
                if r.status not in (PageStatus.OK, PageStatus.SKIPPED) and failed_at is None:
                    failed_at = k[:12]
        with self._lock:
            self._counts["backup_pages_written"] += sum(r.ok for r in results)
            self._counts["backup_pages_already_stored"] += sum(r.detail == _ALREADY for r in results)
            self._counts["backup_pages_failed"] += sum(
                r.status not in (PageStatus.OK, PageStatus.SKIPPED, PageStatus.CANCELLED) for r in results
            )
        return BackupResult(results)

    def _prefetch_loop(self) -> None:
        while True:
            job = self._prefetch_q.get()
            if job is _STOP:
                return
            try:
                result = self._run_prefetch(job)
                if not job.future._deliver(result) and result.tokens:
                    self.host_pool.free(result.host_indices)  # abandoned by its caller: nothing stays reserved
                    self._count("prefetch_abandoned")
                    self._count("prefetch_abandoned_pages_freed", result.completed)
                    self.outcomes.record(result.keys[: result.completed], "timed_out",
                                         "loaded after the caller stopped waiting; its slots were freed")  # fmt: skip
            except BaseException as exc:  # noqa: BLE001
                log.exception("hicache L3 prefetch failed")
                job.future._deliver(error=exc)
            finally:
                if not job.refused:
                    self._prefetch_slots.release()

    def _agree(self, value: int, digest: int) -> int:
        if self._broken:
            raise AgreementTimeout(self._broken)
        self._seq += 1
        try:
            return agree_min(value, self.group, self.op_timeout, seq=self._seq, digest=digest)
        except AgreementFailed as exc:
            # Poisoned: every rank saw the same verdict (or timed out); no rank issues another collective,
            # so the others fail theirs within op_timeout instead of pairing with a stale one.
            self._broken = f"rank agreement lost: {exc}"
            self._count("agreement_disagreements" if isinstance(exc, RanksDisagreed) else "agreement_timeouts")
            raise

    def _run_prefetch(self, job: _Prefetch) -> PrefetchResult:
        self._count("prefetches")
        keys, fut = job.keys, job.future
        epoch = self.storage.weights.epoch
        digest = keys_digest(keys)
        empty = torch.empty(0, dtype=torch.int64)
        error, why = job.refused, ("queue_full" if job.refused else "")
        if fut.cancelled():
            self._count("prefetch_cancelled")
            error, why = error or "cancelled", why or "cancelled"
        local = 0
        if not error:
            try:
                local = self.storage.batch_exists(keys)
            except Exception as exc:  # noqa: BLE001 - this rank found nothing; it still takes part below
                error, why = f"batch_exists raised {type(exc).__name__}: {exc}", "store_unreachable"
        self._count("prefetch_pages_hit", local)
        try:
            agreed = self._agree(local, digest)
        except AgreementFailed as exc:
            self._explain(keys, local, 0, 0, 0, [], "ranks_disagreed", str(exc))
            return PrefetchResult(keys, local, 0, 0, empty, error=str(exc))
        self._count("prefetch_pages_agreed", agreed)
        slots = empty
        if agreed and not error:
            got = self.host_pool.alloc(agreed * self.page_size)
            if got is None:
                self._count("prefetch_no_host_space")
                error, why = f"host pool has no room for {agreed} pages", "host_pool_full"
            else:
                slots = got.to(torch.int64)
        results: list[PageResult] = []
        loaded, terminated = 0, False
        n = slots.numel() // self.page_size
        for start in range(0, n, self.batch_pages):
            if fut._terminate.is_set() or fut.cancelled():
                terminated = True
                break
            bk = keys[start : min(n, start + self.batch_pages)]
            bs = slots[start * self.page_size : (start + len(bk)) * self.page_size]
            batch = self.storage.read_pages(bk, bs)
            results += batch
            good = next((i for i, r in enumerate(batch) if not r.ok), len(batch))
            loaded += good
            if good < len(batch):
                break
        if terminated:
            self._count("prefetch_terminated")
        self._count("prefetch_pages_failed", sum(not r.ok for r in results))
        if loaded and epoch != self.storage.weights.epoch:  # read while the weights changed: maybe old pages
            self._count("prefetch_pages_old_weights", loaded)
            loaded, results = 0, []  # none is reported loaded: each page's reason is the change
            error, why = "the weight version changed while this prefetch read", OLD_WEIGHT_VERSION
        try:
            completed = self._agree(loaded, digest)
        except AgreementFailed as exc:
            if slots.numel():
                self.host_pool.free(slots)
            self._explain(keys, local, agreed, loaded, 0, results, "ranks_disagreed", str(exc))
            return PrefetchResult(keys, local, agreed, 0, empty, results, terminated, str(exc))
        keep = completed * self.page_size
        if slots.numel() > keep:
            self.host_pool.free(slots[keep:])
        self._count("prefetch_pages_loaded", completed)
        if terminated:
            why = why or "timed_out"
            error = error or "the caller stopped waiting (prefetch policy) before these pages were read"
        self._explain(keys, local, agreed, loaded, completed, results, why, error)
        return PrefetchResult(keys, local, agreed, completed, slots[:keep], results, terminated, error, epoch)

    def _explain(self, keys: list[str], local: int, agreed: int, loaded: int, completed: int,
                 results: list[PageResult], why: str, detail: str) -> None:  # fmt: skip
        """Remember, and count, why each page of a prefetch did or did not reach the host tier."""
        rec = self.outcomes.record
        rec(keys[:completed], LOADED, "")
        rec(keys[completed:loaded], "ranks_disagreed", "another rank did not load it")
        read = len(results)
        for i, r in enumerate(results[loaded:], start=loaded):
            rec([keys[i]], reason_of_status(r.status), r.detail)
            rec(keys[i + 1 : read], "earlier_page_failed", f"page {i} of the prefix failed: {r.status.value}")
            break
        if why:
            rec(keys[read:local], why, detail)
        elif read < agreed:
            rec(keys[read:agreed], "timed_out", "not read before the prefetch stopped")
        if not why or why in ("host_pool_full", "timed_out"):
            rec(keys[agreed:local], "ranks_disagreed", "another rank's store lacked it (the ranks took the minimum)")
        if local < len(keys) and why not in ("queue_full", "cancelled", "store_unreachable"):
            old = self._old_version(keys[local])
            if old is None:
                rec(keys[local : local + 1], "not_in_store", "")
            else:
                rec(keys[local : local + 1], OLD_WEIGHT_VERSION, f"stored for weight version {old!r}; the server "
                    f"now serves {self.storage.weight_version!r}")  # fmt: skip
            rec(keys[local + 1 :], "earlier_page_missing", f"page {local} of the prefix is not in the store")
        elif why:
            rec(keys[local:], why, detail)
        hits = _metrics.L3_PREFETCH
        if completed:
            hits.labels(result="hit", reason="loaded").inc(completed)
        for reason, count in self.outcomes.last_counts(keys[completed:]).items():
            hits.labels(result="miss", reason=reason).inc(count)

    def _current_weights(self, result: PrefetchResult) -> PrefetchResult:
        """``result``, or none of its pages when the weights changed after they were read (their slots freed)."""
        if not result.tokens or result.epoch == self.storage.weights.epoch:
            return result
        self.host_pool.free(result.host_indices)
        self._count("prefetch_pages_old_weights", result.completed)
        detail = "read before the weight version changed: not handed over, slots freed"
        self.outcomes.record(result.keys[: result.completed], OLD_WEIGHT_VERSION, detail)
        return replace(result, completed=0, host_indices=result.host_indices[:0], error=detail)

    def _old_version(self, key: str) -> str | None:
        if not self.storage.weights.previous:
            return None
        try:
            return self.storage.old_weight_version_of(key)
        except Exception:  # noqa: BLE001 - cannot tell: the page stays not_in_store
            return None


def _whole_pages(host_indices: torch.Tensor, pages: int, page_size: int) -> torch.Tensor:
    """The slots of the first ``pages`` pages (a prefix's trailing partial page is not stored)."""
    if not isinstance(host_indices, torch.Tensor):
        raise TypeError(f"host_indices must be a torch tensor of token slots, got {type(host_indices).__name__}")
    if host_indices.numel() < pages * page_size:
        raise ValueError(f"{pages} whole pages need {pages * page_size} host slots, got {host_indices.numel()}")
    return host_indices[: pages * page_size]


def _slots(pages: list[int], picked: list[int], page_size: int) -> torch.Tensor:
    if not picked:
        return torch.empty(0, dtype=torch.int64)
    starts = torch.tensor([pages[i] for i in picked], dtype=torch.int64) * page_size
    return (starts[:, None] + torch.arange(page_size)).reshape(-1)


def _wait_event(event: Any, timeout: float) -> bool:
    """Poll a CUDA event from this worker thread (never synchronising the caller's stream)."""
    deadline = time.monotonic() + timeout
    while not event.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0002)
    return True
