"""Host-tier verification: every page's checksum taken on the device at backup, checked on the device after load.

On by default for CUDA pools that can be verified (its cost: ``docs/verification-cost.md``), off for CPU
pools, where hashing costs more than the copy;
``make_host_pool(..., verify=True/False)`` or ``HICACHE_VERIFY=1/0`` decides for a pool or every
pool. ``HICACHE_VALIDATE`` does not imply it: validation checks a call's arguments on the
host, verification checks the bytes, and costs a table and a pass of device time per transfer.

* **At backup** (all-layer or per-layer), beside the copy (on CUDA a side stream, ordered after what
  the caller's stream held before the copy; the caller's stream waits for it after), a
  kernel reads the *device pool's* rows of the pages it backs up and stores their checksums
  (:mod:`hicache_core.verification.page_checksum`: one 64-bit word per page, host layer, component and group
  of 8 items) in the pool's checksum table, indexed by host page. The table is host memory,
  pinned on CUDA, next to the host buffers, reached by the kernel through UVA.
* **After a load**, a kernel checksums the device rows that were just loaded and compares them with
  the table, once for all the layers of a load, after the last one
  (:class:`~hicache_core.verification.check_batch.CheckBatch`), in order on the stream its copies went on: a
  layer-wise load's (``HostPool.submit_load``) on the loader's stream once the last layer's event is
  recorded, and a server's loop of per-layer loads (consecutive layers, the same indices, one stream:
  a *run*) when the run reaches the pool's last layer, on the caller's stream. The layers' consumers
  do not wait for it; what follows the last layer on the caller's stream and on the copies' stream
  does. A run that stops
  short is checked at the pool's next call of another kind (a backup, ``check_verified``, another
  load), and before an error leaves a call (waited for on the host: the caller may reuse the rows
  of a load it abandons). A mismatch stores the call's number in a
  pinned failure word and in the failing host pages' slots, as a kernel that masks indices
  reports them (:mod:`hicache_core.pool.drops`): no host sync, no host hashing, nothing on the link
  when every page is good.
* **Reporting.** The pool's first transfer call after the check ran on the device (it runs behind the
  load, so on a busy GPU that may be a later call than the next one) reads the word (a plain host load) and raises
  :class:`PageVerificationError` before any byte of the new call moves, naming the failing host
  pages (``.pages``, and their token slots, ``.host_indices``), the call, its operation and layer.
  ``HostPool.check_verified()`` waits for the device and raises at once.
* **Quarantine.** A page that failed is dropped from the host tier: its pages are held in the
  pool's quarantine until their slots are freed, and the storage controller never writes a
  quarantined page to L3. The server's radix tree learns them from the error's ``host_indices``,
  or at any time from ``HostPool.take_failed_pages()`` (the slots of pages that failed and were
  not yet taken): it evicts the nodes holding those slots and frees them, as for any eviction.
* **L3.** The table row of a page travels with it to the store (after the payload, covered by the
  store's own checksum) and lands back in the table when the page is prefetched, so the load after
  a prefetch is checked against the checksum taken on the device at the original backup: device,
  host, store, host, device.

CPU pools compute the same checksum in torch (:func:`hicache_core.verification.page_checksum.checksum_rows`).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from .. import metrics as _metrics
from ..host_memory import host_tensor
from ..loads.layer_loads import at_load_end
from ..settings.variables import VERIFY, VERIFY_IN_COPY
from .check_batch import CheckBatch
from .page_checksum import (
    ENTRY_COLUMNS,
    NO_CHECKSUM,
    checksum_rows,
    groups_per_page,
    pages_per_program,
    row_words,
    seed,
    tile_shape,
)

ENV_VERIFY = VERIFY.name


def verify_default() -> bool | None:
    """What ``HICACHE_VERIFY`` asks for: True, False, or None when unset or blank (each pool's default: CUDA
    pools that can be verified are, CPU pools are not). A value it does not take raises."""
    return VERIFY.read()


class PageVerificationError(RuntimeError):
    """Pages loaded by an earlier call did not match the checksums taken when they were backed up.

    The device now holds wrong KV for them. ``pages`` are the host pages (sorted), ``host_indices``
    their token slots (whole pages, int64): evict the radix-tree nodes that hold them. ``calls``
    lists ``(call number, operation, layer_id)`` of the failing calls (``None`` where older than the
    pool's memory of calls); ``layer_ids`` the layers named.
    """

    def __init__(self, message: str, pages: list[int], host_indices: torch.Tensor,
                 calls: list[tuple[int, str | None, int | None]]) -> None:  # fmt: skip
        super().__init__(message)
        self.pages = pages
        self.host_indices = host_indices
        self.calls = calls
        self.layer_ids = sorted({c[2] for c in calls if c[2] is not None})


def table_shapes(num_pages: int, num_layers: int, components: int, tokens_per_page: int) -> tuple[tuple, tuple]:
    """The int64 shapes a verifier pins: the checksum table ``(pages, layers, components, groups)``, and the
    failure words (word 0: a call whose check failed; then one per host page, the call that failed it)."""
    return (num_pages, num_layers, components, groups_per_page(tokens_per_page)), (1 + num_pages,)


class PageVerifier:
    """One host pool's checksum table, failure words and quarantine (see the module doc).

    :param plan: the pool's transfer plan (host buffers and the device pool's layers).
    :param page_size: tokens per page.
    :param describe: ``seq -> (operation, layer_id, items)`` of a remembered call, or ``(None, None, 0)``.
    :param move: ``(tensor, device) -> int64 tensor on that device`` (the pool's cached index move).
    :param kernel: use the Triton kernel (default: on CUDA pools; on CPU pools only under ``TRITON_INTERPRET=1``,
        which is how the tests hold the kernel to the torch definition).
    :param last_layers: host layers that end a run of per-layer loads (default: the last one; a pool
        with draft layers also ends one at its last model layer).
    :param in_copy: let load implementations that can (``Implementation.checks_loads``) check per-layer loads
        in the copy itself, with the checksum kernel (:mod:`hicache_core.gpu.checked_load`); ``False``: every
        load is checked apart, after its last layer; ``None``: ``HICACHE_VERIFY_IN_COPY``.
    :raises ValueError: a pool this cannot verify (rows not whole 32-bit words, CUDA without triton,
        CUDA under the Triton interpreter, unpinned host memory on CUDA).
    """

    def __init__(self, plan: Any, page_size: int, describe: Callable[[int], tuple],
                 move: Callable[[torch.Tensor, torch.device], torch.Tensor], *,
                 kernel: bool | None = None, last_layers: tuple[int, ...] = (),
                 label: str = "host pool", in_copy: bool | None = None) -> None:  # fmt: skip
        geometry = plan.geometry
        self.tokens = plan.tokens_per_page
        self.page_size = page_size
        self.in_copy = VERIFY_IN_COPY.read() if in_copy is None else bool(in_copy)
        self.num_pages = plan.spec.num_pages
        self.num_layers = plan.num_layers
        by_component: dict[int, tuple[torch.Tensor, ...]] = {}
        for part in plan.parts:
            by_component.setdefault(part.spec.component, part.device_layers)
        self.components = [by_component[c] for c in sorted(by_component)]
        self.words = []
        for comp, layers in zip(geometry.components, self.components):
            try:
                self.words.append(row_words(layers[0].shape[1]))
            except ValueError as exc:
                raise ValueError(
                    f"verify=True cannot verify pool kind {geometry.kind!r}: in component {comp.name!r}, {exc} "
                    "(the page checksum reads 32-bit words); pass verify=False for this pool"
                ) from None
        self._run_ends = frozenset(last_layers) | {self.num_layers - 1}
        self._run: CheckBatch | None = None  # the open run of per-layer loads
        self.groups = groups_per_page(self.tokens)
        self.columns = self.num_layers * len(self.components) * self.groups
        self.device = plan.device
        self.cuda = self.device.type == "cuda"
        pinned = False
        #: The current stream's handle on a device (CUDA pools; the cheapest way to compare streams).
        self._raw_stream_of: Callable[[int], int] | None = None
        #: The current stream's handle on this pool's device, 0 where no stream is compared (CPU pools).
        self._stream_handle: Callable[[], int] = _no_stream
        if self.cuda:
            from ..gpu.device import cuda_current_functions, interpreting, triton_available

            self._raw_stream_of = cuda_current_functions()[1]

            if not triton_available():
                raise ValueError("verify=True on a CUDA pool needs triton (the checksum kernel); pip install triton")
            if interpreting():
                raise ValueError(
                    "verify=True cannot check CUDA pools while TRITON_INTERPRET=1 (the interpreter runs kernels on "
                    "host copies of CUDA tensors); unset it, or verify CPU pools"
                )
            unpinned = [a for a, t in plan.host_buffers.items() if not t.is_pinned()]
            if unpinned:
                raise ValueError(
                    "verify=True on a CUDA pool needs pinned host memory (the kernel reaches the checksum table "
                    f"through UVA); pin_memory=False left {', '.join(unpinned)} unpinned"
                )
            misaligned = [i for layers in self.components for i, t in enumerate(layers) if t.data_ptr() % 4]
            if misaligned:
                raise ValueError("verify=True needs device layers aligned to 4 bytes")
            pinned = True
        #: ``(pages, layers, components, groups)`` int64: the checksum words, indexed by host page.
        table, words = table_shapes(self.num_pages, self.num_layers, len(self.components), self.tokens)
        self.table = host_tensor(table, torch.int64, label=label, name="checksum table", pinned=pinned,
                                 fill=NO_CHECKSUM)  # fmt: skip
        self._words = host_tensor(words, torch.int64, label=label, name="failure words", pinned=pinned)
        #: The failure words (word 0, then one per host page), for kernels that check loads (their offsets).
        self.failure_words = self._words
        self._flag = ctypes.c_int64.from_address(self._words.data_ptr())
        self._failed = self._words[1:]
        self._describe = describe
        self._move = move
        self._pending: PageVerificationError | None = None
        # The L3 worker collects (before a write) while the server's thread may raise: one at a time.
        self._lock = threading.RLock()
        #: Host pages that failed, held until their slots are freed (never written to L3 meanwhile).
        self.quarantine: set[int] = set()
        self._untaken: set[int] = set()
        #: Pages that failed a check, and checks that failed, since the pool was made (the metrics read these).
        self.failed_pages_total = 0
        self.failed_calls_total = 0
        #: Pages whose checksums were dropped because their bytes were handed out as raw pointers (a store or
        #: a transfer engine may write them): their next load takes its checksum instead of checking it.
        self.unchecked_pages_total = 0
        if kernel and not self.cuda:
            from ..gpu.device import interpreting

            if not interpreting():
                raise ValueError("the checksum kernel runs CPU pools only under TRITON_INTERPRET=1")
        self.kernel = self.cuda if kernel is None else bool(kernel)
        # On CUDA a backup's checksums run on a side stream beside its copies (they read the same device
        # rows). A load is checked in order on its copies' own stream, after the last layer: enqueued early
        # on a side stream behind an event wait, the pending check slowed the copies running meanwhile, in
        # some processes and not others (benchmarks/verify_probe.py). Every wait between two streams is on a
        # recorded event.
        self._side: Any = None
        self._before: Any = None  # recorded on the caller's stream before a backup's copies
        # A batched check writes numbers of its own, one per layer (negative, never a call's): they map back to
        # the layers' calls through a ring of the newest batches, each ``(its first number, its layers' calls)``,
        # about _BATCH_CALLS numbers in all. One slot a batch: a launch stores one tuple, not one per layer.
        self._batch_ring: list[tuple[int, list[int]] | None] = [None] * max(1, _BATCH_CALLS // self.num_layers)
        self._batches = 0
        self._next_batch_number = -1
        self._all_layers = list(range(self.num_layers))
        if self.kernel:
            self._bind_kernel()
            if self.cuda:
                self._side = torch.cuda.Stream(self.device)
                self._stream_handle = functools.partial(self._raw_stream_of, self._device_index)

    # ---- the device side --------------------------------------------------------------------

    def _bind_kernel(self) -> None:
        self._anchor = self.components[0][0]
        self._device_index = self.device.index if self.device.index is not None else -1
        if self.cuda and self.device.index is None:
            self._device_index = torch.cuda.current_device()
        base = self._anchor.data_ptr()
        self._base = base

        def entries(layers: range) -> torch.Tensor:
            rows = []
            for layer in layers:
                for c, comp_layers in enumerate(self.components):
                    t = comp_layers[layer]
                    column = ((layer * len(self.components)) + c) * self.groups
                    rows.append([t.data_ptr() - base, t.stride(0), self.words[c], seed(layer, c), column, t.shape[0]])
            out = torch.tensor(rows, dtype=torch.int64).to(self.device)
            assert out.shape[1] == ENTRY_COLUMNS
            return out

        self._entries_all = entries(range(self.num_layers))
        self._entries_off_all = self._entries_all.data_ptr() - base
        self._entries_layer = [entries(range(layer, layer + 1)) for layer in range(self.num_layers)]
        self._table_off = self.table.data_ptr() - base
        self._flag_off = self._words.data_ptr() - base
        self._failed_off = self._flag_off + 8
        self._tile = tile_shape(self.tokens, max(self.words))
        self._pages_per_program = pages_per_program(self.tokens, max(self.words))
        if self._pages_per_program > 1:  # a step's words shared by the pages a program takes
            tile_t, group, block_w = self._tile
            self._tile = (tile_t, group, max(4, block_w // self._pages_per_program))
        # Rows that all start on 16 bytes (offsets, strides, lengths) are read in 16-byte vectors.
        facts = [t.data_ptr() - base for layers in self.components for t in layers]
        facts += [layers[0].stride(0) for layers in self.components] + [4 * w for w in self.words]
        self._align = next(a for a in (4, 2, 1) if all(f % (4 * a) == 0 for f in facts))
        # Compiled: the word loop is software-pipelined; the interpreter runs plain loops.
        self._stages = 0 if not self.cuda else 6
        self._launcher: Any = None  # made at the first launch: the kernel's module imports triton
        if self.cuda:
            torch.cuda.synchronize(self.device)  # the entry tables are on the device before the first launch

    def _entries(self, layers: int | list[int] | None) -> tuple[torch.Tensor, int]:
        """The entry table of ``layers`` (None: every layer) and its byte offset from the anchor."""
        if layers is None:
            return self._entries_all, self._entries_all.data_ptr() - self._base
        if type(layers) is int:
            t = self._entries_layer[layers]
            return t, t.data_ptr() - self._base
        first = layers[0]
        if layers == self._all_layers:  # a whole load's layers, in order (the common case): no slicing
            return self._entries_all, self._entries_off_all
        if layers == list(range(first, first + len(layers))):  # a run of layers: a slice of the whole table
            t = self._entries_all[first * len(self.components) : (first + len(layers)) * len(self.components)]
        else:
            t = torch.cat([self._entries_layer[layer] for layer in layers])
        return t, t.data_ptr() - self._base

    def _launch(self, hidx: torch.Tensor, didx: torch.Tensor, layers: int | list[int] | None, seq: int, check: bool,
                seq_step: int = 0, moved: bool = False) -> None:  # fmt: skip
        if self.cuda and torch._C._cuda_getDevice() != self._device_index:  # Triton launches on the current device
            with torch.cuda.device(self._device_index):
                return self._launch(hidx, didx, layers, seq, check, seq_step, moved)
        entries, entries_off = self._entries(layers)
        h, d = (hidx, didx) if moved else (self._move(hidx, self.device), self._move(didx, self.device))
        base = self._base
        launcher = self._launcher
        if launcher is None:
            from ..gpu.page_checksum_kernel import ChecksumLaunch

            launcher = self._launcher = ChecksumLaunch(self._anchor, self.tokens, self.groups, self._tile, self._align,
                                                       self._stages, self._device_index,
                                                       self._pages_per_program)  # fmt: skip
        launcher((h.shape[0] // self.tokens, entries.shape[0]),
                 (entries_off, h.data_ptr() - base, d.data_ptr() - base, self._table_off, self._flag_off,
                  self._failed_off, seq, self.num_pages, self.columns), check, seq_step)  # fmt: skip

    # ---- the torch side (CPU pools) ---------------------------------------------------------

    def _sums(self, hidx: torch.Tensor, didx: torch.Tensor, layer: int, comp: int):
        """``(host pages, their checksums (pages, groups))`` of the pages whose indices are all in range."""
        t = self.tokens
        h = hidx.to("cpu", torch.int64).view(-1, t)
        d = didx.to("cpu", torch.int64).view(-1, t)
        rows = self.components[comp][layer]
        hp = h[:, 0] // t
        ok = ((d >= 0) & (d < rows.shape[0])).all(dim=1) & (h[:, 0] >= 0) & (hp < self.num_pages)
        hp, d = hp[ok], d[ok]
        return hp, checksum_rows(rows[d.reshape(-1)], layer, comp, t)

    def _torch(self, hidx: torch.Tensor, didx: torch.Tensor, layer: int | None, seq: int, check: bool) -> None:
        layers = range(self.num_layers) if layer is None else (layer,)
        for lyr in layers:
            for c in range(len(self.components)):
                hp, sums = self._sums(hidx, didx, lyr, c)
                if not check:
                    self.table[hp, lyr, c] = sums
                    continue
                stored = self.table[hp, lyr, c]
                unset = stored == NO_CHECKSUM  # no checksum to check against: this load's is taken
                if bool(unset.any()):
                    self.table[hp, lyr, c] = torch.where(unset, sums, stored)
                bad = ((stored != sums) & ~unset).any(dim=1)
                if bool(bad.any()):
                    self._failed[hp[bad]] = seq
                    self._flag.value = seq

    # ---- the pool's calls -------------------------------------------------------------------

    def before_backup(self) -> None:
        """Mark the caller's stream before a backup's copies, so its checksums can run beside them (CUDA).

        A backup rewrites table rows that a load's check may still be reading: it follows the last check."""
        self.close_run()
        if self._side is not None:
            self._before = torch.cuda.Event()
            self._before.record(torch.cuda.current_stream(self.device))

    def backup(self, hidx: torch.Tensor, didx: torch.Tensor, layer: int | None, seq: int) -> None:
        """Take the checksums of the backed-up pages (``layer=None``: every host layer) into the table.

        On CUDA they run on the side stream beside the copies, and the caller's stream waits for them
        before what follows the backup (a free of the device rows, say)."""
        before, self._before = self._before, None
        if before is None:
            return (self._launch if self.kernel else self._torch)(hidx, didx, layer, seq, False)
        done = self._on_side(hidx, didx, layer, seq, False, before)
        torch.cuda.current_stream(self.device).wait_event(done)

    def check(self, hidx: torch.Tensor, didx: torch.Tensor, layer: int, seq: int) -> None:
        """Note the loaded pages of ``layer`` for a check against the table (see the module doc).

        A server loads layer after layer with the same indices: such a run is checked in one launch
        when it reaches the pool's last layer, on the run's stream after that layer's copies, so what
        the caller enqueues next follows it (a per-layer check beside the next layer's copy kernel
        slowed it by up to 14 %). Any other call closes an open run first."""
        # A server's loop of small per-layer loads is bound by host time, and this runs on each of its calls
        # (the pool calls it directly: Verification.use): the common call is the stream's handle, one lock
        # acquire and CheckBatch.extend's few comparisons and two appends.
        raw = self._stream_handle()
        lock = self._lock
        lock.acquire()
        try:
            run = self._run
            if run is None or not run.extend(hidx, didx, layer, seq, raw):
                if run is not None:
                    self._close_run()
                run = self._run = CheckBatch(self, self.num_layers, raw_stream=raw)
                run.add(hidx, didx, layer, seq)
                # A layer-loader step that stops short of the last layer leaves the run open: it is checked when
                # the load stops, before its consumers may reuse the rows (and a failed load's, waited on).
                at_load_end(self.close_run)
            if layer in self._run_ends:
                self._close_run()
        finally:
            lock.release()

    def raise_if_flagged(self) -> None:
        """Raise what the device reported, if it reported anything (the pool calls this before every call's
        bytes move: one host load when nothing failed)."""
        if self._flag.value or self._pending is not None:
            self.raise_if_failed()

    def close_run(self, wait_host: bool = False) -> None:
        """Check the open run of per-layer loads now; the current stream and the run's own wait for the check
        (CUDA), and with ``wait_host`` this thread too.

        The pool calls this before a backup, a layer-wise load or ``check_verified``, and before an
        error leaves a per-layer load (``wait_host``: the caller may reuse the rows of a load it
        abandons, on any stream, once it learns of the error)."""
        if self._run is not None:
            with self._lock:
                self._close_run(wait_host)

    def _close_run(self, wait_host: bool = False) -> None:
        run, self._run = self._run, None
        if run is not None:
            run.flush(wait_host)

    def batch(self, layers: int, engine: str = "sm") -> CheckBatch:
        """A batch for the checks of one layer-wise load of ``layers`` layers, whose copies run on ``engine``
        (:class:`~hicache_core.verification.check_batch.CheckBatch`)."""
        return CheckBatch(self, layers, None, engine)

    def _check_layers(self, hidx: torch.Tensor, didx: torch.Tensor, layers: list[int], seqs: list[int],
                      stream: Any = None, in_order: bool = False, moved: bool = False) -> Any:  # fmt: skip
        """Check ``layers`` (whose calls were ``seqs``) in one launch; on CUDA on ``stream`` (the copies'; default:
        the current one) with ``in_order``, else on the side stream after what ``stream`` holds now, returning
        the event that ends it (in order: None; what follows on ``stream`` follows the check). ``moved``: the
        indices are already the kernel's (:meth:`_launch`)."""
        if not self.kernel:
            for layer, seq in zip(layers, seqs):
                self._torch(hidx, didx, layer, seq, True)
            return None
        n = len(layers)
        with self._lock:
            first = self._next_batch_number
            self._next_batch_number -= n
            ring = self._batch_ring
            ring[self._batches % len(ring)] = (first, seqs)
            self._batches += 1
        step = len(self.components)
        if self._side is None:
            return self._launch(hidx, didx, layers, first, True, step, moved)
        if in_order:
            if stream is None or stream.cuda_stream == self._raw_stream_of(self._device_index):
                self._launch(hidx, didx, layers, first, True, step, moved)
            else:
                with torch.cuda.stream(stream):
                    self._launch(hidx, didx, layers, first, True, step, moved)
            return None
        return self._on_side(hidx, didx, layers, first, True, None, seq_step=step, caller=stream)

    def _on_side(self, hidx, didx, layers, seq, check, before, seq_step: int = 0, caller: Any = None) -> Any:
        if caller is None:
            caller = torch.cuda.current_stream(self.device)
        if before is None:
            before = torch.cuda.Event()
            before.record(caller)
        side = self._side
        side.wait_event(before)
        with torch.cuda.stream(side):
            self._launch(hidx, didx, layers, seq, check, seq_step)
            done = torch.cuda.Event()
            done.record(side)
        for t in (hidx, didx):
            if t.is_cuda:
                t.record_stream(side)
        return done

    def flagged(self) -> bool:
        """Whether a failure is to be reported (a plain host load; the pool's hot path calls this)."""
        return bool(self._flag.value) or self._pending is not None

    def collect(self) -> None:
        """Move failures the device reported into the quarantine and a pending error (no raise, no sync).

        The pages' slots are scanned even when the word is clear: a kernel still running may have set the
        word before it was cleared here and a page's slot after an earlier scan (two stores, in no set order).
        """
        with self._lock:
            self._collect()

    def _collect(self) -> None:
        self._flag.value = 0
        failed = self._failed.clone()
        pages = torch.nonzero(failed).reshape(-1)
        seqs = failed[pages]
        self._failed[pages] = 0
        page_list = pages.tolist()
        if not page_list:
            return
        by_call: dict[int, list[int]] = {}
        for page, s in zip(page_list, seqs.tolist()):
            by_call.setdefault(self._call_of(s), []).append(page)
        calls, parts = [], []
        for s in sorted(by_call):
            op, layer_id, items = self._describe(s)
            calls.append((s, op, layer_id))
            where = f"call #{s} on this host pool" + (
                f" ({op}{f', layer_id {layer_id}' if layer_id is not None else ''}, {items} indices)" if op else ""
            )
            parts.append(f"{where}: host pages {_pages_text(by_call[s])}")
        self.quarantine.update(page_list)
        self._untaken.update(page_list)
        self.failed_pages_total += len(page_list)
        _metrics.record_checksum_failure("host", len(page_list))
        self.failed_calls_total += len(by_call)
        if self._pending is not None:  # not yet raised: one error names everything so far
            pages_all = sorted(set(self._pending.pages) | set(page_list))
            calls = self._pending.calls + calls
            parts = [str(self._pending).split("\n", 1)[0]] + parts
        else:
            pages_all = sorted(page_list)
        message = (
            "host-tier verification failed: " + "; ".join(parts) + ". These pages' bytes on the device do not match "
            "the checksums taken on the device when they were backed up: the device holds wrong KV for them.\n"
            "They are dropped from the host tier (quarantined until their slots are freed, never written to L3): "
            "evict the radix-tree nodes holding error.host_indices (or host.take_failed_pages()) and free them."
        )
        self._pending = PageVerificationError(message, pages_all, self.slots_of(pages_all), calls)

    def _call_of(self, number: int) -> int:
        """The call a failure word names: a batched check's number maps back to its layer's call while in the
        ring; a call's own number (positive), or a batch number too old to know, is returned as it is."""
        if number < 0:
            for batch in self._batch_ring:  # a failure's report: a scan of the ring costs nothing that counts
                if batch is not None and batch[0] >= number > batch[0] - len(batch[1]):
                    return batch[1][batch[0] - number]
        return number

    def raise_if_failed(self) -> None:
        """Raise :class:`PageVerificationError` for failures reported since the last raise."""
        with self._lock:
            self._collect()
            pending, self._pending = self._pending, None
        if pending is not None:
            raise pending

    def take_failed(self) -> torch.Tensor:
        """Token slots of the pages that failed and were not taken yet (whole pages, int64); marks them taken."""
        with self._lock:
            self._collect()
            pages = sorted(self._untaken)
            self._untaken.clear()
        return self.slots_of(pages)

    def release(self, slots: torch.Tensor) -> None:
        """Freed slots leave the quarantine, and their checksums are dropped (whatever is written there next
        is checksummed by its backup, or by its first load)."""
        starts = slots.to("cpu", torch.int64).reshape(-1)[:: self.page_size] // self.page_size
        self.table[starts] = NO_CHECKSUM
        if not self.quarantine:
            return
        pages = set(starts.tolist())
        with self._lock:
            self.quarantine -= pages
            self._untaken -= pages

    def forget(self, pages: list[int]) -> None:
        """Drop the checksums of ``pages``, whose bytes were handed out as raw pointers (see :data:`NO_CHECKSUM`).

        A store that writes a page through them leaves no checksum; one that only reads it leaves the
        page unchanged, and its next load takes the same checksum again."""
        if pages:
            self.table[torch.tensor(pages, dtype=torch.int64)] = NO_CHECKSUM
            self.unchecked_pages_total += len(pages)

    def slots_of(self, pages: list[int]) -> torch.Tensor:
        if not pages:
            return torch.empty(0, dtype=torch.int64)
        starts = torch.tensor(pages, dtype=torch.int64) * self.page_size
        return (starts[:, None] + torch.arange(self.page_size)).reshape(-1)

    def rehash_host_page(self, page: int, host_views: list[tuple[int, int, torch.Tensor]]) -> None:
        """Recompute a page's table row from host bytes written by other means (a flat page set by a server).

        ``host_views``: per (layer, component), ``(layer, component, (tokens, row_bytes) uint8)`` in device-row order.
        """
        for layer, comp, rows in host_views:
            self.table[page, layer, comp] = checksum_rows(rows, layer, comp, self.tokens)[0]


#: Batched checks' numbers remembered (layers of recent loads).
_BATCH_CALLS = 1 << 16


def _no_stream() -> int:
    return 0


def _pages_text(pages: list[int], limit: int = 16) -> str:
    shown = ", ".join(str(p) for p in pages[:limit])
    return f"[{shown}{', ...' if len(pages) > limit else ''}] ({len(pages)} page{'s' if len(pages) != 1 else ''})"


def host_rows(plan: Any, page: int) -> list[tuple[int, int, torch.Tensor]]:
    """A host page's bytes per (host layer, component), in device-row order: ``(tokens, row_bytes)`` uint8.

    Built from the layout's declared parts, so it holds for every layout (a component split
    across buffers is joined back along each head, as the device row holds it).
    """
    out = []
    for layer in range(plan.num_layers):
        by_comp: dict[int, list] = {}
        for part in plan.parts:
            by_comp.setdefault(part.spec.component, []).append(part)
        for comp, parts in sorted(by_comp.items()):
            views = [p.host_layer_view(layer)[page] for p in sorted(parts, key=lambda p: p.spec.dim_start)]
            joined = views[0] if len(views) == 1 else torch.cat(views, dim=-1)
            out.append((layer, comp, joined.reshape(joined.shape[0], -1)))
    return out
