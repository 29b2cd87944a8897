"""Multi-process scenarios for the L3 tier: ranks over gloo, servers sharing a store.

Each function here is the body of one spawned process (``multiprocessing`` "spawn"
context); results come back as JSON files, so the parent asserts on them and a rank that
hangs or dies shows up as a missing file, not a hung test. :func:`run_ranks` starts the
processes and always bounds the wait.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import torch

SHAPE = ("mha", "page_first", "plain", 4)  # pool kind, layout, variant, page size


def run_ranks(target, world: int, workdir: Path, timeout: float = 120.0, **kwargs: Any) -> list[dict]:
    """Run ``target(rank, world, init_file, out_file, **kwargs)`` in ``world`` processes; their JSON results.

    Raises ``AssertionError`` naming the ranks that did not finish in time or exited badly.
    """
    return start_ranks(target, world, workdir, **kwargs).join(timeout)


class Ranks:
    """Rank processes started by :func:`start_ranks`; :meth:`join` waits (bounded) and returns their results."""

    def __init__(self, procs: list, outs: list[Path]) -> None:
        self.procs = procs
        self.outs = outs

    def join(self, timeout: float) -> list[dict]:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(self.procs) if p.is_alive()]
        self.kill()
        bad = [(r, p.exitcode) for r, p in enumerate(self.procs) if p.exitcode != 0 and r not in hung]
        errors = {r: o.with_suffix(".err").read_text() for r, o in enumerate(self.outs)
                  if o.with_suffix(".err").exists()}  # fmt: skip
        assert not hung and not bad, (f"ranks still running after {timeout} s: {hung}; exit codes: {bad}; "
                                      f"errors: {errors}")  # fmt: skip
        return [json.loads(o.read_text()) for o in self.outs]

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(10)


def start_ranks(target, world: int, workdir: Path, **kwargs: Any) -> Ranks:
    """Start ``target(rank, world, init_file, out_file, **kwargs)`` in ``world`` spawned processes."""
    ctx = mp.get_context("spawn")
    workdir.mkdir(parents=True, exist_ok=True)
    init_file = workdir / f"gloo-{os.getpid()}-{time.monotonic_ns()}"
    outs = [workdir / f"rank{r}-{init_file.name}.json" for r in range(world)]
    procs = [ctx.Process(target=target, args=(r, world, str(init_file), str(outs[r])), kwargs=kwargs)
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    return Ranks(procs, outs)


def _init(rank: int, world: int, init_file: str):
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))  # fmt: skip
    return dist.group.WORLD


def _guarded(fn, rank, world, init_file, out_file, **kw) -> None:
    """Run one rank; write its exception to ``<out>.err`` (the parent shows it) and exit non-zero."""
    try:
        result = fn(rank, world, init_file, **kw)
        Path(out_file).write_text(json.dumps(result))
    except BaseException:
        import traceback

        Path(out_file).with_suffix(".err").write_text(traceback.format_exc())
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def make_rank_pool(rank: int, seed: int, pages: int = 24, shape=SHAPE):
    """A host pool of ``shape`` whose bytes depend only on (rank, seed): what a rank's server computed."""
    from ..storage.keys import page_hashes  # noqa: F401 - imported for callers' convenience
    from .storage_kit import StorageCase, make_pool

    return make_pool(StorageCase(*shape), pages=pages, seed=seed * 1000 + rank)


def prefix_tokens(n_pages: int, page_size: int, salt: int) -> list[int]:
    return [(salt * 104729 + i * 31) % 32000 for i in range(n_pages * page_size)]


def _page_digest(host, slot: int) -> str:
    from ..storage.page_format import checksum_bytes
    from .cases import as_bytes

    return f"{checksum_bytes(as_bytes(host.get_data_page(slot, flat=True)).numpy().tobytes()):016x}"


# ---- scenario: ranks agree, whatever happens locally -------------------------------------------


def _agreement(rank: int, world: int, init_file: str, rounds: int = 12) -> dict:
    """Per round, each rank's store holds a different number of pages, and some ranks fail in some way."""
    from ..storage.controller import StorageController
    from ..storage.make import make_storage

    group = _init(rank, world, init_file)
    page = SHAPE[3]
    host = make_rank_pool(rank, seed=1, pages=40)
    storage = make_storage(f"memory://agree-{os.getpid()}", host, model_id="agree", tp_rank=rank, tp_size=world)
    ctl = StorageController(storage, group=group, tp_rank=rank, prefetch_policy="wait_complete",
                            batch_pages=2, op_timeout=30)  # fmt: skip
    out = []
    for r in range(rounds):
        toks = prefix_tokens(6, page, salt=r)
        stored = (r + rank) % 7  # this rank's store holds the first `stored` pages
        src = host.alloc(6 * page)
        if stored:
            ctl.backup(toks[: stored * page], src[: stored * page]).result(30)
        fault = (r % 4, r // 4 % world)  # (kind, which rank)
        real_exists = storage.batch_exists
        if fault == (1, rank):
            def failing(keys, extra_info=None):
                raise ConnectionError("store unreachable on this rank")

            storage.batch_exists = failing
        if fault == (3, rank) and stored > 1:  # a damaged second page on this rank
            key = storage.namespace.key(_hashes(toks, page)[1])
            storage.backend.corrupt(key, 100)
        future = ctl.prefetch(toks)
        if fault == (2, rank):
            future.cancel()
        res = future.result(30)
        storage.batch_exists = real_exists
        digests_ok = all(
            _page_digest(host, int(res.host_indices[i * page])) == _page_digest(host, int(src[i * page]))
            for i in range(res.completed)
        )
        out.append({"round": r, "stored": stored, "local": res.local_hits, "agreed": res.agreed_hits,
                    "completed": res.completed, "tokens": res.tokens, "bytes_ok": digests_ok, "error": res.error,
                    "fault": list(fault)})  # fmt: skip
        if res.tokens:
            host.free(res.host_indices)
        host.free(src)
        storage.backend.remove_objects(storage.namespace.keys(_hashes(toks, page)))
    stats = ctl.stats()
    ctl.close()
    return {"rounds": out, "free_after": host.available_size(), "capacity": host.size, "stats": stats}


def agreement(rank: int, world: int, init_file: str, out_file: str, **kw: Any) -> None:
    """Process body: :func:`_agreement`'s rounds, result to ``out_file``."""
    _guarded(_agreement, rank, world, init_file, out_file, **kw)


def _hashes(toks, page):
    from ..storage.keys import page_hashes

    return page_hashes(toks, page)


# ---- scenario: two servers (each a group of ranks) share pages through one store ----------------


def _server(rank: int, world: int, init_file: str, *, url: str, role: str, model_id: str, seed: int,
            n_pages: int = 12, salt: int = 5, options: dict | None = None, start_after: str = "") -> dict:  # fmt: skip
    """``role="backup"``: compute (seeded) pages and back them up, then exit. ``"prefetch"``: a fresh pool finds,
    prefetches and checks them against the same seed, byte for byte. ``start_after``: a file; the store is
    not opened before it exists (180 s at most)."""
    from ..storage.controller import StorageController
    from ..storage.make import make_storage
    from .cases import as_bytes

    group = _init(rank, world, init_file)
    deadline = time.monotonic() + 180
    while start_after and not os.path.exists(start_after):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{start_after} did not appear within 180 s")
        time.sleep(0.05)
    page = SHAPE[3]
    toks = prefix_tokens(n_pages, page, salt)
    expected = make_rank_pool(rank, seed, pages=n_pages + 4)
    storage = make_storage(url, expected if role == "backup" else make_rank_pool(rank, seed + 1, n_pages + 4),
                           model_id=model_id, tp_rank=rank, tp_size=world, **(options or {}))  # fmt: skip
    host = storage.host_pool
    ctl = StorageController(storage, group=group, tp_rank=rank, prefetch_policy="wait_complete", op_timeout=60)
    result: dict[str, Any] = {"role": role, "rank": rank, "pid": os.getpid()}
    if role == "backup":
        slots = host.alloc(n_pages * page)
        res = ctl.backup(toks, slots).result(60)
        result.update(written=res.written, failed=[r.detail for r in res.failed], stored=res.stored_prefix)
    else:
        res = ctl.prefetch(toks).result(60)
        exp_slots = torch.arange(n_pages * page)  # the backup side's first alloc: pages 0..n-1 in order
        exp_alloc = expected.alloc(n_pages * page)
        same = [
            torch.equal(as_bytes(host.get_data_page(int(res.host_indices[i * page]), flat=True)),
                        as_bytes(expected.get_data_page(int(exp_alloc[i * page]), flat=True)))
            for i in range(res.completed)
        ]  # fmt: skip
        del exp_slots
        result.update(local=res.local_hits, agreed=res.agreed_hits, completed=res.completed, same=same,
                      error=res.error)  # fmt: skip
    result["stats"] = ctl.stats()
    ctl.close()
    storage.close()
    return result


def server(rank: int, world: int, init_file: str, out_file: str, **kw: Any) -> None:
    """Process body: one rank of a server that backs up or prefetches (:func:`_server`)."""
    _guarded(_server, rank, world, init_file, out_file, **kw)


# ---- scenario: ranks either agree or all fail ------------------------


def _late_rank(rank: int, world: int, init_file: str, *, mode: str, op_timeout: float = 2.0,
               delay: float = 4.0, url: str = "", outcomes: str = "") -> dict:  # fmt: skip
    """``mode="delay"``: rank 1's read takes ``delay`` s, past rank 0's agreement bound. ``"extra"``: rank 1
    submits a prefetch the others do not. Each rank reports what it got, and a second prefetch after.

    With ``url`` the ranks share that store and a pool of :mod:`.explain_kit`'s geometry (what
    ``hicache explain-miss`` can name), and each writes its outcome memory into the folder ``outcomes``.
    """
    from ..storage.controller import StorageController
    from ..storage.make import make_storage

    group = _init(rank, world, init_file)
    if url:
        from . import explain_kit

        page, host = explain_kit.PAGE, explain_kit.host_pool(pages=24)
    else:
        page, host = SHAPE[3], make_rank_pool(rank, seed=2, pages=24)
    storage = make_storage(url or f"memory://late-{os.getpid()}", host, model_id="late", tp_rank=rank,
                           tp_size=world)  # fmt: skip
    ctl = StorageController(storage, group=group, tp_rank=rank, prefetch_policy="wait_complete",
                            op_timeout=op_timeout)  # fmt: skip
    toks = prefix_tokens(8, page, salt=3)
    ctl.backup(toks, host.alloc(8 * page)).result(30)
    if mode == "delay" and rank == 1:
        real = storage.read_pages

        def slow(keys, slots):
            time.sleep(delay)
            return real(keys, slots)

        storage.read_pages = slow
    if mode == "extra" and rank == 1:
        ctl.prefetch(prefix_tokens(2, page, salt=99))  # only this rank: the collectives would shift
    t0 = time.monotonic()
    first = ctl.prefetch(toks).result(60)
    took = time.monotonic() - t0
    second = ctl.prefetch(toks).result(60)
    stats = ctl.stats()
    report = ctl.explain_miss(toks)
    if outcomes:
        ctl.write_outcomes(Path(outcomes) / f"hicache-outcomes-{os.getpid()}-rank{rank}.json")
    ctl.close()
    for res in (first, second):
        if res.tokens:
            host.free(res.host_indices)
    return {"first": [first.completed, first.error], "second": [second.completed, second.error], "took": took,
            "broken": stats["broken"], "reasons": [p.last_outcome for p in report.pages],
            "free": host.available_size(), "capacity": host.size - 8 * page}  # fmt: skip


def late_rank(rank: int, world: int, init_file: str, out_file: str, **kw: Any) -> None:
    """Process body: :func:`_late_rank`."""
    _guarded(_late_rank, rank, world, init_file, out_file, **kw)
