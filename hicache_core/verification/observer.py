"""A host pool's verification as an observer of the pool: whether it verifies and why, and its events.

:class:`Verification` decides, once, whether a pool verifies (``verify=`` or ``HICACHE_VERIFY``, else
the pool's default) and says why (``host.verify_reason``). While on, it observes the pool
(:class:`~hicache_core.pool.pool_events.PoolObserver`) and drives its
:class:`~hicache_core.verification.verify.PageVerifier`:
checksums taken at backup, loads checked, failures raised before the pool's next call, raw pages
forgotten, freed pages out of quarantine. Where bytes may change unseen (the whole memory handed
out, a call that moves part of a page) a default verification stops for good, saying why; a pool
asked to verify refuses instead.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..plugins.implementation import LOAD
from ..pool.pool_events import PoolObserver
from .check_batch import CheckBatch
from .verify import ENV_VERIFY, PageVerifier, host_rows, verify_default

_log = logging.getLogger("hicache")


class Verification(PoolObserver):
    """One host pool's verification policy and, while it verifies, its observer.

    ``verifier`` is the pool's :class:`~hicache_core.verification.verify.PageVerifier` (``None``: not verifying);
    ``reason`` says whether it verifies and why (``"on: ..."``, ``"off: ..."``).
    """

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.verifier: PageVerifier | None = None
        #: Per load implementation that can check in its copy: why it does not (empty: it does).
        self.in_copy: dict[str, list[str]] = {}
        self.reason = "off"
        self.asked = False

    # ---- the decision -----------------------------------------------------------------------

    def decide(self, verify: bool | None) -> None:
        """Turn verification on or off for the pool: ``verify``, else ``HICACHE_VERIFY``, else the default."""
        if verify is not None and not isinstance(verify, bool):
            raise TypeError(f"verify must be True, False or None (HICACHE_VERIFY), got {verify!r}")
        asked, source = (verify, "verify") if verify is not None else (verify_default(), ENV_VERIFY)
        said = f"{source}=1" if source == ENV_VERIFY else "verify=True"
        if asked:
            self.use(self.make_verifier())
            self.reason = f"on: {said}"
        elif asked is False:
            self.reason = f"off: {source}=0" if source == ENV_VERIFY else "off: verify=False"
        elif self.pool.plan.device.type != "cuda":
            self.reason = "off: a CPU pool (on by default on CUDA; on the CPU hashing costs more than the copy)"
        else:
            try:
                self.use(self.make_verifier())
                self.reason = "on: the default for a CUDA pool"
            except ValueError as exc:
                self.reason = f"off: {exc}"
        self.asked = bool(asked)

    def make_verifier(self, **kw: Any) -> PageVerifier:
        """A :class:`~hicache_core.verification.verify.PageVerifier` for the pool (its table, words and kernel)."""
        pool = self.pool
        try:
            return PageVerifier(pool.plan, pool.page_size, pool._drops._call, self.indices,
                                last_layers=(pool._owned - 1,), label=pool.label, **kw)  # fmt: skip
        except ValueError as exc:
            raise ValueError(f"host pool ({pool.geometry.kind}, layout {pool.layout}): {exc}") from None

    def use(self, verifier: PageVerifier | None) -> None:
        """Verify with ``verifier`` from now on (``None``: stop), observing the pool while it verifies."""
        was, self.verifier = self.verifier, verifier
        if was is not None:
            self.pool.unobserve(self)
        # The two events of every transfer call go straight to the verifier's methods (the pool calls what
        # these attributes hold): a server's loop of small per-layer loads is bound by host time, where one
        # Python call a layer is a measurable share of the load (benchmarks/verify_ablate.py).
        self.__dict__.pop("before_call", None)
        self.__dict__.pop("after_load", None)
        loads = list({id(e[0]): e[0] for (op, _), e in self.pool._impls.items() if op == LOAD and e[0].checks_loads}
                     .values())  # fmt: skip
        self.in_copy = {}
        for impl in loads:
            impl.bind_load_check(None)
        if verifier is not None:
            if verifier.in_copy:
                # Loads whose copy checks their pages: the pool tells this observer nothing of them.
                self.in_copy = {impl.name: impl.bind_load_check(verifier) for impl in loads}
            self.before_call = verifier.raise_if_flagged  # type: ignore[method-assign]
            self.after_load = verifier.check  # type: ignore[method-assign]
            self.pool.observe(self)

    def stop(self, why: str) -> None:
        """Turn default verification off for good (bytes can now change behind the pool's back); a pool asked
        to verify refuses instead."""
        v = self.verifier
        if v is None:
            return
        if self.asked:
            raise ValueError(
                f"this host pool verifies its pages ({self.reason[4:]}), but {why}. Make the pool with "
                "verify=False for this use"
            )
        v.close_run()
        v.raise_if_failed()
        self.use(None)
        self.reason = f"off: {why} (verification was on by default)"
        pool = self.pool
        _log.warning("host pool (%s, layout %s): verification turned %s", pool.geometry.kind, pool.layout,
                     self.reason)  # fmt: skip

    def indices(self, indices: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Indices as int64 on the pool's device for the checksum kernel: once per index tensor, never a sync."""
        key = ("verify", device)
        hit = self.pool._cache.lookup(indices, key)
        if hit is not None:
            return hit
        if device.type != "cuda":
            return self.pool._cache.store(indices, key, indices.to(device, torch.int64).contiguous())
        # Pageable memory would make the copy wait for the stream: stage it in pinned memory first.
        src = indices if indices.is_cuda or indices.is_pinned() else indices.to(torch.int64).pin_memory()
        return self.pool._cache.store(indices, key, src.to(device, torch.int64, non_blocking=True))

    # ---- the pool's events ------------------------------------------------------------------

    # before_call and after_load: while verifying, the verifier's own methods stand in for these (use).
    def before_call(self) -> None:
        self.verifier.raise_if_flagged()

    def before_backup(self) -> None:
        self.verifier.before_backup()

    def after_backup(self, h: torch.Tensor, d: torch.Tensor, layer: int | None, seq: int) -> None:
        self.verifier.backup(h, d, layer, seq)

    def after_load(self, h: torch.Tensor, d: torch.Tensor, layer: int, seq: int) -> None:
        self.verifier.check(h, d, layer, seq)

    def load_started(self, layers: int, engine: str) -> CheckBatch:
        # A layer-wise load's layers are checked in one launch after the last (check_batch.CheckBatch).
        self.verifier.close_run()
        return self.verifier.batch(layers, engine)

    def call_failed(self) -> None:
        self.verifier.close_run(wait_host=True)  # the caller may reuse the rows of a load it abandons

    def slots_freed(self, slots: torch.Tensor | None) -> None:
        if slots is not None:
            self.verifier.release(slots)

    def handed_out(self, pages: list[int] | None, why: str) -> None:
        if pages is None:
            self.stop(why)
        else:
            self.verifier.forget(pages)

    def page_written(self, page: int) -> None:
        # Bytes that did not come through a backup: their checksums from the host copy.
        self.verifier.rehash_host_page(page, host_rows(self.pool.plan, page))

    # ---- what the pool answers --------------------------------------------------------------

    def check(self, synchronize: bool) -> None:
        """Raise what the loads checked so far found (``synchronize``: after waiting for the device)."""
        v = self.verifier
        if v is None:
            return
        v.close_run()  # a run of per-layer loads that stopped short of the last layer
        if synchronize and self.pool.plan.device.type == "cuda":
            torch.cuda.synchronize(self.pool.plan.device)
        v.raise_if_failed()

    def take_failed(self) -> torch.Tensor:
        v = self.verifier
        return v.take_failed() if v is not None else torch.empty(0, dtype=torch.int64)

    def stats(self) -> dict[str, int]:
        v = self.verifier
        if v is None:
            return {"verify": 0, "failed_pages": 0, "failed_calls": 0, "quarantined_pages": 0}
        v.collect()
        return {"verify": 1, "failed_pages": v.failed_pages_total, "failed_calls": v.failed_calls_total,
                "quarantined_pages": len(v.quarantine)}  # fmt: skip

    @property
    def table(self) -> torch.Tensor | None:
        """The checksum table (a page's row travels with it to L3 and back); ``None`` when not verifying."""
        return self.verifier.table if self.verifier is not None else None

    def quarantined(self) -> set[int]:
        v = self.verifier
        if v is None:
            return set()
        v.collect()
        return set(v.quarantine)

    def __repr__(self) -> str:
        return f"Verification({self.reason!r})"
