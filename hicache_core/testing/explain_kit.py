"""Every reason ``explain_miss`` gives, produced for real against a live store (any backend).

:func:`run_scenario` plays a server: a host pool of ``SHAPE`` (``--shape llama-8b --layers 2
--page-size 4 --layout page_first`` in ``hicache explain-miss`` terms) behind a
:class:`StorageController`, backs prefixes up, removes one page, corrupts another through the
store (``corrupt(backend, full_key, offset)``, the backend's own way), stores a prefix under
another layout, fills its host pool before a prefetch, and lets a slow store time a prefetch
out. It returns the :class:`Scenario`: the prefixes, the reasons each page must get, and the
outcome files the controllers wrote (``StorageController.write_outcomes``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..plugins.registry import get_registry
from ..pool.device_pools import DeclaredDevicePool
from ..pool.host_pool import make_host_pool
from ..storage import PrefetchTimeout, StorageController, make_storage, page_hashes
from ..storage.page_format import HEADER_SIZE

SHAPE, LAYERS, PAGE = "llama-8b", 2, 4
CLI_GEOMETRY = ["--shape", SHAPE, "--layers", str(LAYERS), "--page-size", str(PAGE), "--layout", "page_first"]

#: prefix name -> (token ids, host pages the caller's radix tree holds)
PREFIXES = {
    "mixed": (list(range(0, 32)), 1),
    "other_layout": (list(range(1000, 1008)), None),
    "host_full": (list(range(2000, 2008)), None),
    "timed_out": (list(range(3000, 3040)), None),
}
#: What the store alone says (no outcome memory).
FROM_STORE = {
    "mixed": ["in_host", "in_store", "not_in_store", "earlier_page_missing", "checksum_failed",
              "earlier_page_missing", "not_in_store", "not_in_store"],
    "other_layout": ["layout_mismatch"] * 2,
    "host_full": ["in_store"] * 2,
    "timed_out": ["in_store"] * 10,
}  # fmt: skip


@dataclass
class Scenario:
    url: str
    model_id: str
    host: Any
    storage: Any
    outcome_files: list[Path] = field(default_factory=list)
    timed_out_from: int = 0  # pages of "timed_out" the slow prefetch completed before its deadline
    live: dict[str, list[str]] = field(default_factory=dict)  # StorageController.explain_miss, controller open

    def from_store(self, name: str) -> list[str]:
        """The reasons of prefix ``name`` from the store alone: with a cluster key, the page whose payload
        was changed fails its MAC (``auth_failed``), checked before any checksum."""
        if self.storage.authenticated:
            return ["auth_failed" if r == "checksum_failed" else r for r in FROM_STORE[name]]
        return FROM_STORE[name]

    def remembered(self, name: str) -> list[str]:
        """The reasons of prefix ``name`` with the controllers' memory."""
        if name == "host_full":
            return ["host_pool_full"] * 2
        if name == "timed_out":
            return ["in_store"] * self.timed_out_from + ["timed_out"] * (10 - self.timed_out_from)
        return self.from_store(name)


def host_pool(layout: str = "page_first", pages: int = 16) -> Any:
    # The pool ``--shape llama-8b --layers 2`` names on the command line (hicache_core.tools.shapes), built
    # here from its declaration: the kit sits below the tools and resolves the kind's name itself.
    dev = DeclaredDevicePool(get_registry().pool_kinds["mha"], pages * PAGE, PAGE, LAYERS, "cpu",
                             dtype=torch.bfloat16, rows={"k": (8, 128), "v": (8, 128)}, extras={})  # fmt: skip
    return make_host_pool(dev, layout=layout, io_backend="auto", size=pages * PAGE)


class _Slow:
    """The store answers reads ``delay`` seconds late (a slow link), nothing else changes.

    Both read primitives are slowed: zero-copy backends read with ``get_objects_into``, others with ``get_objects``.
    """

    METHODS = ("get_objects_into", "get_objects")

    def __init__(self, storage: Any, delay: float) -> None:
        self.backend, self.delay = storage.backend, delay  # the plugin's primitives, under the page store
        self.real = {m: getattr(self.backend, m) for m in self.METHODS}
        for m in self.METHODS:
            setattr(self.backend, m, self._slowed(self.real[m]))

    def _slowed(self, fn: Callable) -> Callable:
        def read(*args: Any) -> Any:
            time.sleep(self.delay)
            return fn(*args)

        return read

    def undo(self) -> None:
        for m in self.METHODS:
            delattr(self.backend, m)


def run_scenario(url: str, corrupt: Callable[[Any, str, int], None], outdir: Path) -> Scenario:
    """Produce every reason in the store at ``url`` and in two controllers' memories (written to ``outdir``)."""
    model_id = f"explain-kit/{uuid.uuid4().hex[:10]}"
    host = host_pool()
    storage = make_storage(url, host, model_id=model_id)
    sc = Scenario(url, model_id, host, storage)
    ns = storage.namespace
    with StorageController(storage, prefetch_policy="wait_complete") as ctl:
        toks = PREFIXES["mixed"][0]
        keys = page_hashes(toks, PAGE)
        slots = host.alloc(6 * PAGE)
        ctl.backup(toks[: 6 * PAGE], slots).result(30)
        host.free(slots)  # the host copies are evicted; only the store holds the prefix
        storage.backend.remove_objects([ns.key(keys[2])])
        corrupt(storage.backend, ns.key(keys[4]), HEADER_SIZE + 7)
        toks = PREFIXES["host_full"][0]
        slots = host.alloc(len(toks))
        ctl.backup(toks, slots).result(30)
        host.free(slots)
        hold = host.alloc(host.available_size())
        res = ctl.prefetch(toks).result(30)
        if res.completed != 0 or "no room" not in (res.error or ""):
            raise AssertionError(f"the full host pool did not refuse the prefetch: {res}")
        host.free(hold)
        sc.live["mixed"] = _reasons(ctl.explain_miss(PREFIXES["mixed"][0], host_pages=PREFIXES["mixed"][1]))
        sc.live["host_full"] = _reasons(ctl.explain_miss(toks))
        sc.outcome_files.append(ctl.write_outcomes(outdir / "hicache-outcomes-1-rank0.json"))
    other = host_pool("layer_first")
    writer = make_storage(url, other, model_id=model_id)
    toks = PREFIXES["other_layout"][0]
    results = writer.write_pages(page_hashes(toks, PAGE), other.alloc(len(toks)))
    if not all(r.ok for r in results):
        raise AssertionError(f"the other layout's pages were not written: {results}")
    writer.close()
    limit = PrefetchTimeout(base_s=0.3, per_ki_token_s=0.0, max_s=0.3)
    with StorageController(storage, prefetch_policy="timeout", prefetch_timeout=limit, batch_pages=2) as ctl:
        toks = PREFIXES["timed_out"][0]
        slots = host.alloc(len(toks))
        ctl.backup(toks, slots).result(30)
        host.free(slots)
        slow = _Slow(storage, 0.2)
        res = ctl.prefetch(toks).result(30)
        slow.undo()
        if not res.terminated or res.completed >= 10:
            raise AssertionError(f"the slow prefetch was not timed out: {res}")
        sc.timed_out_from = res.completed
        host.free(res.host_indices)
        sc.live["timed_out"] = _reasons(ctl.explain_miss(toks))
        sc.live["other_layout"] = _reasons(ctl.explain_miss(PREFIXES["other_layout"][0]))
        sc.outcome_files.append(ctl.write_outcomes(outdir / "hicache-outcomes-2-rank0.json"))
    return sc


def _reasons(report: Any) -> list[str]:
    return [p.reason for p in report.pages]


def check_live_api(sc: Scenario) -> None:
    """``StorageController.explain_miss`` gave every reason, store-side and remembered."""
    for name in PREFIXES:
        assert sc.live[name] == sc.remembered(name), (name, sc.live[name])


def cli_args(sc: Scenario, name: str, *extra: str) -> list[str]:
    toks, host_pages = PREFIXES[name]
    args = ["explain-miss", sc.url, "--model-id", sc.model_id, *CLI_GEOMETRY, "--token-ids", ",".join(map(str, toks))]
    return args + (["--host-pages", str(host_pages)] if host_pages is not None else []) + list(extra)


def check_cli(sc: Scenario, run: Callable[[list[str]], tuple[int, str]], outdir: Path) -> None:
    """``hicache explain-miss --json`` gives the store's reasons, and the remembered ones with ``--outcomes``.

    ``run(argv)`` runs the command and returns its exit code and stdout.
    """
    import json

    for name in PREFIXES:
        code, out = run(cli_args(sc, name, "--json"))
        report = json.loads(out)
        assert [p["reason"] for p in report["pages"]] == sc.from_store(name), (name, report)
        assert report["namespace"] == sc.storage.namespace.prefix and report["outcomes_read"] is False
        assert code == (0 if set(FROM_STORE[name]) <= {"in_host", "in_store"} else 1)
        code, out = run(cli_args(sc, name, "--json", "--outcomes", str(outdir)))
        report = json.loads(out)
        assert [p["reason"] for p in report["pages"]] == sc.remembered(name), (name, report)
        assert report["outcomes_read"] is True


def check_against_server(url: str, corrupt: Callable[[Any, str, int], None], workdir: Path,
                         main: Callable[[list[str]], int], capsys: Any, *, unreachable: str = "",
                         start_hint: str = "") -> None:  # fmt: skip
    """The whole kit against a live store: the scenario, the live API and the command, every reason.

    ``main`` is ``hicache_core.cli.main`` and ``capsys`` pytest's fixture (the command's output). With
    ``unreachable`` (the URL of the same store where nothing answers: a port nothing listens on), the
    command must then exit 1 saying on one stderr line that the store is not reachable, with ``start_hint``
    (how to start its server) and no traceback.
    """
    import dataclasses

    outdir = workdir / "outcomes"
    outdir.mkdir()

    def run(argv: list[str]) -> tuple[int, str]:
        code = main(argv)
        return code, capsys.readouterr().out

    sc = run_scenario(url, corrupt, outdir)
    try:
        check_live_api(sc)
        check_cli(sc, run, outdir)
    finally:
        sc.storage.close()
    if unreachable:  # a store that does not answer: a failure (exit 1), one line on stderr
        code = main(cli_args(dataclasses.replace(sc, url=unreachable), "mixed"))
        out, err = capsys.readouterr()
        assert (code, out) == (1, "") and "not reachable" in err and start_hint in err, (code, out, err)
        assert err.count("\n") == 1 and "Traceback" not in err, err
