"""Moves vLLM's KV blocks between its device pages and a hicache host pool (and L3 behind it).

This is the worker's engine room, written without vLLM so that its CUDA path is tested where
vLLM's CUDA wheel cannot go. Semantics are vLLM's ``OffloadingWorker``'s:

* a store reads device blocks only after the work queued on the caller's stream (the model
  writing them); a load writes device blocks after the caller's stream (vLLM's zeroing of reused
  blocks), submitted layer by layer by hicache's layer loader (:mod:`hicache_core.loads.layer_loads`, as
  SGLang's adapter does), so the worker's thread returns at once;
* a job is finished (``get_finished``) only once its bytes have landed: device copies done (an
  event, on CUDA), and, with L3, pages read from the store and verified before the load copies,
  pages written to the store before the store job ends (so the host page is never reused while
  the store still reads it); a store job's lease (the request's retention hints) is granted on the
  pages it wrote, in the store's :class:`~hicache_core.retention.LeaseBook`, before the job ends;
* ``wait(jobs)`` returns once those jobs are finished in that sense;
* a job that cannot deliver its bytes (a page the store no longer holds or that fails its
  checksum, a layer whose copies failed) is reported by ``get_finished`` as failed, once, with a
  :class:`TransferFailed` that says why (``Finished.error``), and only once every copy it enqueued
  has finished (the layer loader's settle wait), so that vLLM may free or reuse its blocks; the
  other jobs go on being reported. vLLM 0.32's connector asserts that every job succeeded (it has
  no path for a failed load): there the engine stops, with the reason logged, rather than run a
  request on KV that did not arrive.

Host pages: chunk ``c`` of ``blocks_per_chunk`` device blocks is host pages
``c * blocks_per_chunk .. + blocks_per_chunk - 1`` (hicache pages are one device block).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hicache_core import BACKUP_ALL, LOAD, make_host_pool
from hicache_core.loads.layer_loads import LayerLoad, LayerLoadError
from hicache_core.retention.hints import RetentionHints

from .errors import NotServedError
from .pool_kind import VllmPagePool

log = logging.getLogger("hicache_vllm")

DEFAULT_LAYOUT = "page_first"
DEFAULT_IO_BACKEND = "auto"


def _outside_inference_mode(run):
    """vLLM's worker runs in torch's inference mode; hicache's index caches key on tensor version
    counters, which inference-mode tensors lack. The copies move bytes by address, so running them
    outside inference mode changes nothing else."""

    def wrapped() -> None:
        with torch.inference_mode(False):
            run()

    return wrapped


def _publish_events(storage: Any, dp_rank: int) -> Any:
    """Attach the worker's L3 store to hicache's KV-event publisher (``HICACHE_KV_EVENTS``; unset: ``None``).

    Only this store publishes: it is the one that writes and reads pages, so only it knows when a page is
    really there (written and acknowledged, or read back and checked) and when it is gone. The scheduler's
    probe (``spec.StorageProbe``) only asks whether keys exist, and vLLM's own offloading events already
    report the host tier, L3 hits promoted into it included (``complete_store`` in ``complete_load``).

    Events are vLLM's (``"vllm"``): the L3 key is ``bytes(OffloadKey).hex()``, whose event hash
    (``hicache_core.events.vllm_block_hash``) is vLLM's ``maybe_convert_block_hash(get_offload_block_hash(key))``,
    so a router's index names the page as it names the block in vLLM's GPU tier; medium ``STORAGE``. Not
    chained: a store job's keys need not be consecutive blocks of one prefix (vLLM stores what its
    manager chose, in any order), so no page is given a parent, as vLLM's own per-key offloading events.
    """
    from hicache_core.events import publish_store_events

    return publish_store_events(storage, "vllm", rank=dp_rank)


class TransferFailed(RuntimeError):
    """A job could not deliver its bytes; the request it serves must not run on them."""


@dataclass
class Job:
    """One submitted transfer: finished when its future (storage, copies off-thread) and event are done."""

    job_id: int
    is_load: bool
    num_bytes: int
    started: float
    event: Any = None  # torch.cuda.Event recorded after the device copies
    start_event: Any = None
    load: LayerLoad | None = None  # a load's layer-wise copies (event is its finish event)
    future: Future | None = None
    seconds: float | None = None
    error: BaseException | None = field(default=None, repr=False)

    def done(self) -> bool:
        """Whether every copy of the job has finished, failed or not (never raises)."""
        if self.future is not None and not self.future.done():
            return False
        if self.load is not None:
            return self.load.settled()
        if self.event is not None and not self.event.query():
            return False
        return True


@dataclass(frozen=True)
class Finished:
    """A finished job, for vLLM's ``TransferResult``: bytes over the device link and the seconds it took.

    ``error`` is set where the job failed (its bytes did not all land; every copy it made has finished).
    """

    job_id: int
    is_load: bool
    num_bytes: int
    seconds: float
    error: TransferFailed | None = None

    @property
    def ok(self) -> bool:
        """Whether the job delivered its bytes."""
        return self.error is None


class BlockMover:
    """vLLM's device pages <-> a hicache host pool of ``num_chunks`` chunks, through hicache's dispatcher.

    :param device_pages: one ``[num_blocks, page_bytes]`` int8 view per layer (vLLM's canonical tensors).
    :param block_size: tokens per vLLM block.
    :param num_chunks: host chunks (vLLM's manager hands out chunk ids ``0 .. num_chunks - 1``).
    :param blocks_per_chunk: device blocks per host chunk (vLLM's ``block_size`` / GPU block size).
    :param layout: hicache host layout (``page_first``: a chunk's layers are one contiguous run, one
        object in L3; ``layer_first``: vLLM's own CPU arrangement, one buffer row per layer).
    :param io_backend: hicache io backend (``auto`` picks per operation; ``direct``, ``kernel``, ...).
    :param storage_url: an L3 store behind the host tier (``file:///dir``, ``redis://...``, ``mooncake://...``).
    :param storage_options: options for the store (as in the URL's query).
    :param model_id: the model's name, part of every L3 key.
    :param dp_rank: this engine's data-parallel rank: the rank hicache's KV events name, and the offset of
        their endpoint's port (vLLM's own rule for its publisher's).
    """

    def __init__(
        self,
        device_pages: Sequence[torch.Tensor],
        *,
        block_size: int,
        num_chunks: int,
        blocks_per_chunk: int = 1,
        layout: str = DEFAULT_LAYOUT,
        io_backend: str = DEFAULT_IO_BACKEND,
        storage_url: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        model_id: str | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        pin_memory: bool = True,
        dp_rank: int = 0,
    ) -> None:
        if num_chunks < 1:
            raise NotServedError(
                f"the host tier has room for {num_chunks} chunks: raise its size (--kv-offloading-size GiB, "
                f"kv_offloading_size or cpu_bytes_to_use; one chunk here is "
                f"{blocks_per_chunk} blocks of {len(device_pages)} layer pages)"
            )
        if storage_url and blocks_per_chunk != 1:
            raise NotServedError(
                "hicache_storage_url needs one device block per offloaded chunk (vLLM's block_size equal to the "
                f"GPU block size); this has {blocks_per_chunk} blocks per chunk"
            )
        self.device_pool = VllmPagePool(device_pages, block_size)
        self.block_size = int(block_size)
        self.blocks_per_chunk = int(blocks_per_chunk)
        self.num_chunks = int(num_chunks)
        self.layers = self.device_pool.layer_num
        self.page_bytes = self.device_pool.page_bytes
        self.io_backend = io_backend
        self.host = make_host_pool(
            self.device_pool,
            layout=layout,
            io_backend=io_backend,
            size=self.num_chunks * self.blocks_per_chunk * self.block_size,
            pin_memory=pin_memory,
            operations=[LOAD, BACKUP_ALL],
            label=f"vLLM offload host tier (rank {tp_rank} of {tp_size})",
        )
        self.cuda = self.device_pool.device.type == "cuda"
        self.storage = None
        #: The L3 store's KV-event feed (hicache_core.events.StoreFeed), or None: no store, or events off.
        self.events: Any = None
        if storage_url:
            from hicache_core.storage import make_storage

            if not model_id:
                raise NotServedError("an L3 store needs the model's name (it is part of every key)")
            self.storage = make_storage(
                storage_url, self.host, model_id=model_id, tp_rank=tp_rank, tp_size=tp_size,
                **dict(storage_options or {}),
            )  # fmt: skip
            try:
                self.events = _publish_events(self.storage, dp_rank)
            except BaseException:  # a bad HICACHE_KV_EVENTS stops the worker: not with the store's threads left
                self.storage.close()
                self.host.destroy()
                raise
            from . import weight_updates

            weight_updates.track(self)
        self._streams: dict[bool, Any] = {}
        self._io: ThreadPoolExecutor | None = None
        self._jobs: dict[int, Job] = {}
        self._lock = threading.Lock()
        self.storage_write_failures = 0
        # Write-throughs of old weights' pages still running at a weight change, and whether the store holds
        # its writes until they are through (set_weight_version).
        self._hold_lock = threading.Lock()
        self._old_writes: set[Future] = set()
        self._holding = False
        self._offsets = torch.arange(self.block_size, dtype=torch.int64)

    # ---- index arithmetic -----------------------------------------------------------------------

    def host_pages(self, chunk_ids: np.ndarray, count: int, skip: int) -> np.ndarray:
        """Host pages of ``count`` device blocks starting ``skip`` blocks into the first chunk."""
        chunk_ids = np.asarray(chunk_ids, dtype=np.int64)
        bpc = self.blocks_per_chunk
        if chunk_ids.ndim != 1 or not 0 <= skip < bpc:
            raise ValueError(f"chunk ids must be 1-D and skip in [0, {bpc}), got {chunk_ids.shape}, skip {skip}")
        bad = chunk_ids[(chunk_ids < 0) | (chunk_ids >= self.num_chunks)]
        if bad.size:
            raise IndexError(f"host chunk {int(bad[0])} is outside the host tier ({self.num_chunks} chunks)")
        pages = (chunk_ids[:, None] * bpc + np.arange(bpc)[None, :]).reshape(-1)[skip : skip + count]
        if pages.size != count:
            raise ValueError(
                f"{chunk_ids.size} chunks of {bpc} blocks cannot hold {count} blocks after skipping {skip}"
            )
        return pages

    def _slots(self, pages: np.ndarray) -> torch.Tensor:
        """hicache's indices for whole pages: every token slot of each page, in page order."""
        # Made outside inference mode (vLLM's worker runs in it): hicache reuses converted indices by
        # the tensor's version counter, which inference tensors do not have.
        with torch.inference_mode(False):
            p = torch.from_numpy(np.ascontiguousarray(pages, dtype=np.int64))
            return (p[:, None] * self.block_size + self._offsets[None, :]).reshape(-1)

    def _device_slots(self, block_ids: np.ndarray) -> torch.Tensor:
        blocks = np.asarray(block_ids, dtype=np.int64)
        bad = blocks[(blocks < 0) | (blocks >= self.device_pool.num_pages)]
        if bad.size:
            raise IndexError(
                f"device block {int(bad[0])} is outside vLLM's KV cache ({self.device_pool.num_pages} blocks)"
            )
        return self._slots(blocks)

    # ---- jobs ----------------------------------------------------------------------------------

    def submit_store(self, job_id: int, block_ids: np.ndarray, chunk_ids: np.ndarray, skip: int = 0,
                     storage_keys: Sequence[str] | None = None,
                     lease: RetentionHints | None = None) -> None:  # fmt: skip
        """Copy device blocks ``block_ids`` into host chunks ``chunk_ids`` (and, with L3, on to the store).

        ``lease``: the request's retention hints: the store grants their lease on the pages written (in the
        order of ``storage_keys``), supersedes the session's earlier leases if they ask, and keeps the
        session's other leases alive.
        """
        self._check_new(job_id)
        if lease is not None and not isinstance(lease, RetentionHints):
            raise TypeError(f"a store job's lease is a RetentionHints, got {type(lease).__name__}")
        count = len(block_ids)
        pages = self.host_pages(chunk_ids, count, skip)
        host_slots, dev_slots = self._slots(pages), self._device_slots(block_ids)
        job = Job(job_id, False, count * self.layers * self.page_bytes, time.perf_counter())
        if count:
            self._copy(job, lambda: self.host.backup_from_device_all_layer(self.device_pool, host_slots, dev_slots,
                                                                          self.io_backend))  # fmt: skip
        if self.storage is not None and storage_keys:
            keys = list(storage_keys)
            if len(keys) != len(pages):
                raise ValueError(f"{len(keys)} storage keys for {len(pages)} stored pages")
            event = job.event
            job.future = self._pool().submit(self._write_through, event, keys, host_slots, lease)
        self._jobs[job_id] = job

    def submit_load(self, job_id: int, chunk_ids: np.ndarray, block_ids: np.ndarray, skip: int = 0,
                    fetch: Sequence[tuple[int, str]] = ()) -> None:  # fmt: skip
        """Copy host chunks into device blocks; ``fetch`` names chunks to read from L3 first (position, key)."""
        self._check_new(job_id)
        count = len(block_ids)
        pages = self.host_pages(chunk_ids, count, skip)
        host_slots, dev_slots = self._slots(pages), self._device_slots(block_ids)
        job = Job(job_id, True, count * self.layers * self.page_bytes, time.perf_counter())

        if fetch:
            if self.storage is None:
                raise ValueError("a load asks for pages from L3, but this worker has no store")
            chunk_ids = np.asarray(chunk_ids, dtype=np.int64)
            keys = [key for _, key in fetch]
            fetch_pages = np.array([chunk_ids[pos] for pos, _ in fetch], dtype=np.int64)
            fetch_slots = self._slots(fetch_pages)
            after = self._record_after_caller() if self.cuda else None
            job.future = self._pool().submit(self._fetch_then_load, job, keys, fetch_slots, after, host_slots,
                                             dev_slots, count)  # fmt: skip
        elif count:
            self._load(job, host_slots, dev_slots, self._record_after_caller() if self.cuda else None)
        self._jobs[job_id] = job

    def get_finished(self) -> list[Finished]:
        """Jobs finished since the last call: those whose bytes all landed, and those that failed (each once,
        with ``error`` set, after every copy it made finished). Never raises for a job's failure."""
        out = []
        for job_id in [j for j, job in self._jobs.items() if job.done()]:
            job = self._jobs.pop(job_id)
            finished = self._result(job)
            if finished.error is not None:
                log.error("hicache-vllm: %s", finished.error)
            out.append(finished)
        return out

    def set_weight_version(self, version: str) -> bool:
        """The weights changed: finish the transfers in flight (old pages, old keys), then key pages on ``version``.

        The keys move even when that wait fails (a load past ``HICACHE_LOAD_TIMEOUT_S``), and its error is
        raised after: the scheduler's probe has moved, and this worker's pages of the new weights must not go
        under the old keys, where other engines read them. Writes of stores still in flight then would land
        under the new keys: the store writes nothing (each page ``skipped``) until they are through."""
        if self.storage is None:
            return False
        try:
            self.wait(list(self._jobs))
        finally:
            switched = self._switch(version)
        return switched

    def _switch(self, version: str) -> bool:
        old_writes = [job.future for job in self._jobs.values()
                      if not job.is_load and job.future is not None and not job.future.done()]  # fmt: skip
        if old_writes:
            with self._hold_lock:
                if not self._holding:
                    # The store's own hold (weights.py) starts where the host pool holds pages at the change,
                    # and ends when it is cleared: this mover's chunks are not the pool's allocations, so one
                    # page is taken to stand for those of the stores in flight, and the pool cleared once
                    # they are all through (_old_write_done).
                    self.host.alloc(self.host.page_size)
                    self._holding = True
                self._old_writes.update(old_writes)
        switched = self.storage.set_weight_version(version)
        for future in old_writes:
            future.add_done_callback(self._old_write_done)  # at once if it is through already
        return switched

    def _old_write_done(self, future: Future) -> None:
        with self._hold_lock:
            self._old_writes.discard(future)
            if self._old_writes or not self._holding:
                return
            self._holding = False
        self.host.clear()  # ends the store's hold: no page of the old weights is written from now on

    def wait(self, job_ids: set[int] | Sequence[int]) -> None:
        """Block until these jobs are finished, failed or not (their results still come from ``get_finished``).

        Bounded for loads (``HICACHE_LOAD_TIMEOUT_S``): a load whose copies do not finish in time raises
        :class:`~hicache_core.loads.layer_loads.LayerLoadTimeout` (its blocks must not be reused)."""
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is None:
                continue
            if job.future is not None:
                job.future.exception()
            if job.load is not None:
                job.load.settled_event.synchronize()
            elif job.event is not None:
                job.event.synchronize()

    def shutdown(self) -> None:
        """Finish every job in flight, then release the store and the host pool.

        Raises the first error met: a wait that timed out, or a job that failed and was never reported."""
        errors = []
        for job in list(self._jobs.values()):
            try:
                self.wait([job.job_id])
                if job.done():
                    failed = self._result(job).error
                    if failed is not None:
                        errors.append(failed)
            except Exception as exc:  # noqa: BLE001 - every job is drained before the first error is raised
                errors.append(exc)
        self._jobs.clear()
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None
        if self.storage is not None:
            self.storage.close()
            self.storage = None
        self.host.destroy()
        if errors:
            raise errors[0]

    # ---- internals -----------------------------------------------------------------------------

    def _check_new(self, job_id: int) -> None:
        if job_id in self._jobs:
            raise ValueError(f"job {job_id} is already in flight")

    def _pool(self) -> ThreadPoolExecutor:
        if self._io is None:
            # One thread: L3 work of jobs runs in submission order, and never beside itself on one page.
            self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-vllm-l3")
        return self._io

    def _stream(self, is_load: bool):
        stream = self._streams.get(is_load)
        if stream is None:
            stream = self._streams[is_load] = torch.cuda.Stream(device=self.device_pool.device)
        return stream

    def _record_after_caller(self):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device_pool.device))
        return event

    def _copy(self, job: Job, run) -> None:
        """Run a store's copies: on CUDA on the store stream after the caller's work, else now."""
        run = _outside_inference_mode(run)
        if not self.cuda:
            t0 = time.perf_counter()
            run()
            job.seconds = time.perf_counter() - t0
            return
        stream = self._stream(job.is_load)
        stream.wait_stream(torch.cuda.current_stream(self.device_pool.device))
        job.start_event = torch.cuda.Event(enable_timing=True)
        job.event = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            job.start_event.record(stream)
            run()
            job.event.record(stream)

    def _load(self, job: Job, host_slots: torch.Tensor, dev_slots: torch.Tensor, after) -> None:
        """Hand every layer's copies to the layer loader, after ``after`` (an event already recorded)."""
        load = self.host.submit_load(self.device_pool, host_slots, dev_slots, self.io_backend, start_event=after,
                                     timing=self.cuda)  # fmt: skip
        job.event = load.finish_event
        job.start_event = load.start_event if self.cuda else None
        job.load = load

    def _write_through(self, event, keys: list[str], host_slots: torch.Tensor,
                       lease: RetentionHints | None = None) -> None:  # fmt: skip
        if event is not None:
            event.synchronize()
        results = self.storage.write_pages(keys, host_slots)
        if lease:
            self._lease(lease, [k for k, r in zip(keys, results) if r.ok])
        failed = [r for r in results if not r.ok]
        if failed:
            # The host tier holds these pages; the store only misses them later (a counted miss, not a wrong load).
            with self._lock:
                self.storage_write_failures += len(failed)
            log.warning("hicache-vllm: %d of %d pages were not written to %s: %s", len(failed), len(results),
                        self.storage.url.redacted, failed[0].detail or failed[0].status.value)  # fmt: skip

    def _lease(self, lease: RetentionHints, written: list[str]) -> None:
        """Grant a store job's lease on the pages it wrote (its session's other leases live on)."""
        if lease.session is not None:
            self.storage.leases.refresh_session(lease.session)
        if lease.retain is not None and written:
            self.storage.retain(written, lease.retain, supersede=lease.supersede)
        elif lease.supersede:
            self.storage.supersede(lease.session)

    def _fetch_then_load(self, job: Job, keys, fetch_slots, after, host_slots, dev_slots, count) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device_pool.device)
        results = self.storage.read_pages(keys, fetch_slots)
        bad = [r for r in results if not r.ok]
        if bad:
            raise TransferFailed(
                f"job {job.job_id}: {len(bad)} of {len(keys)} pages could not be read back from "
                f"{self.storage.url.redacted} ({bad[0].status.value}: {bad[0].detail}); the request they belong to "
                "cannot run on KV that did not arrive (vLLM 0.32's connector has no path for a failed load)"
            )
        if count:
            self._load(job, host_slots, dev_slots, after)
        if job.event is not None:
            job.event.synchronize()  # a failed load raises here once every copy it made finished

    def _error(self, job: Job) -> TransferFailed | None:
        """Why a finished job did not deliver its bytes, or ``None``."""
        exc = job.future.exception() if job.future is not None else None
        if exc is None and job.load is not None and job.load.error is not None:
            try:
                job.load.result()
            except LayerLoadError as failed:
                exc = failed
        if exc is None or isinstance(exc, TransferFailed):
            return exc
        error = TransferFailed(f"job {job.job_id} failed: {type(exc).__name__}: {exc}; the request it serves cannot "
                               "run on KV that did not arrive")  # fmt: skip
        error.__cause__ = exc
        return error

    def _result(self, job: Job) -> Finished:
        error = self._error(job)
        if error is not None:
            return Finished(job.job_id, job.is_load, job.num_bytes, time.perf_counter() - job.started, error)
        seconds = job.seconds
        if job.event is not None and job.start_event is not None:
            seconds = job.start_event.elapsed_time(job.event) * 1e-3
        if seconds is None:
            seconds = time.perf_counter() - job.started
        return Finished(job.job_id, job.is_load, job.num_bytes, seconds)
