"""The conformance test base class a plugin author subclasses.

Every test here is parametrized by the kit's pytest plugin
(:mod:`hicache_core.testing.pytest_plugin`) with :class:`~hicache_core.testing.cases.Case`
objects generated from the implementation's declared claims. A combination the
implementation refuses is still generated, and skipped with the dispatcher's
reasons, so the report shows what is not covered and why.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import pytest
import torch

from ..plugins.dispatch import UnsupportedCombinationError, reasons_for
from ..plugins.implementation import BACKUP_ALL, LOAD, Implementation, TransferRequest
from ..plugins.registry import Registry, get_registry
from ..pool.drops import DroppedIndicesError
from ..pool.geometry import PoolGeometry, geometry_of
from ..pool.host_pool import make_host_pool
from ..settings.variables import KIT_ISOLATE
from . import cases as C
from .cases import Case
from .cuda_context import context_lost

#: Bad inputs the kit feeds every operation: (expected exception types, words the message must hold, validate).
BAD_INPUTS: dict[str, tuple[tuple[type[BaseException], ...], tuple[str, ...], bool]] = {
    "length_mismatch": ((ValueError,), ("length", "shape"), False),
    "float_indices": ((TypeError,), ("int32", "int64", "dtype"), False),
    "two_dim_indices": ((ValueError,), ("1-d", "dim", "shape"), False),
    "list_indices": ((TypeError,), ("tensor",), False),
    "host_index_past_end": ((IndexError, ValueError), ("range", "bound"), True),
    "device_index_past_end": ((IndexError, ValueError), ("range", "bound"), True),
    "negative_index": ((IndexError, ValueError), ("range", "bound", "negative"), True),
    "layer_out_of_range": ((IndexError, ValueError), ("layer",), False),
    "wrong_device_pool": ((ValueError,), ("device pool", "device_pool"), False),
    "not_whole_pages": ((ValueError,), ("page",), True),
    # No validating mode: the implementation may raise (before any byte moves), or drop the bad item,
    # move every valid pair, and report the drop at the pool's next call (hicache_core.pool.drops).
    "host_index_past_end_unvalidated": ((IndexError, ValueError), ("range", "bound"), False),
    "device_index_negative_unvalidated": ((IndexError, ValueError), ("range", "bound", "negative"), False),
}
ORDERS = ("shuffled", "descending")

_registries: dict[type, Registry] = {}
#: The first case after which the CUDA context was found broken (a device-side assert, an illegal
#: address): every later CUDA case skips with it, instead of failing for a reason of its own.
_cuda_lost: list[str] = []


@dataclass
class _Side:
    """One half of a comparison: a device pool, its drafts, and the host pool moving its bytes."""

    device_pool: Any
    drafts: tuple[Any, ...]
    host: Any
    io_backend: str

    def tensors(self) -> dict[str, torch.Tensor]:
        kind = self.host.geometry.decl
        return {**C.device_tensors(self.device_pool, self.drafts, kind), **C.host_tensors(self.host)}

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {name: C.as_bytes(t).to("cpu", copy=True) for name, t in self.tensors().items()}


class ConformanceTests:
    """Conformance tests for one transfer implementation; subclass it in a ``test_*.py`` module.

    Set :attr:`implementation` to the implementation's registered name (or its
    class). Everything else is optional:

    * :attr:`plugins`: ``{"name": plugin_object}`` to test plugins that are not
      installed (a fresh :class:`~hicache_core.Registry` is built from them; the
      default is the process registry, from installed entry points). Override
      :meth:`make_registry` for anything else; it is a class method because
      cases are generated at collection time, from the registry's layouts.
    * :attr:`device`: ``"cpu"`` or ``"cuda"`` (default: CUDA when available and claimed).
    * :attr:`isolate`: run each case in a child process (:mod:`hicache_core.testing.isolated`),
      so a case that crashes its process or breaks the CUDA context fails with what happened and
      later cases still run. Default: on CUDA; ``HICACHE_KIT_ISOLATE=1``/``0`` overrides the default.
    * :attr:`only_pool_kinds`, :attr:`only_layouts`, :attr:`only_operations`,
      :attr:`variants`, :attr:`page_sizes`, :attr:`index_dtypes`: narrow the matrix.

    Test ids read ``<pool kind>-<layout>-<operation>-<variant>-p<page size>-<index dtype>``,
    plus what a test varies (``-shuffled``, ``-length_mismatch``, ...).
    """

    implementation: ClassVar[str | type[Implementation] | None] = None
    plugins: ClassVar[Mapping[str, object] | None] = None
    device: ClassVar[str | None] = None
    isolate: ClassVar[bool | None] = None
    only_pool_kinds: ClassVar[Iterable[str] | None] = None
    only_layouts: ClassVar[Iterable[str] | None] = None
    only_operations: ClassVar[Iterable[str] | None] = None
    variants: ClassVar[Iterable[str]] = C.VARIANTS
    page_sizes: ClassVar[Iterable[int]] = C.PAGE_SIZES
    index_dtypes: ClassVar[Iterable[str]] = C.INDEX_DTYPES

    # ---- configuration, resolved once per class -------------------------------------------------

    @classmethod
    def make_registry(cls) -> Registry:
        """The registry the implementation is looked up in (called once per class)."""
        if cls.plugins is None:
            return get_registry()
        registry = Registry()
        for name, plugin in cls.plugins.items():
            registry.add_plugin(plugin, name)
        return registry

    @classmethod
    def registry_under_test(cls) -> Registry:
        """The registry of this class (from :meth:`make_registry`, made once)."""
        registry = _registries.get(cls)
        if registry is None:
            registry = _registries[cls] = cls.make_registry()
        return registry

    @classmethod
    def implementation_under_test(cls) -> type[Implementation]:
        """The implementation class under test, as registered."""
        target = cls.implementation
        if target is None:
            raise TypeError(
                f"{cls.__name__}: set `implementation = 'plugin.name'` (or the Implementation class) "
                "to tell the hicache conformance kit what to test"
            )
        name = target if isinstance(target, str) else getattr(target, "name", None)
        registry = cls.registry_under_test()
        impl = registry.implementations.get(name) if isinstance(name, str) else None
        if impl is None:
            known = ", ".join(sorted(registry.implementations)) or "none"
            failed = "; ".join(f"{r.name}: {' | '.join(r.errors)}" for r in registry.failed_plugins()) or "none"
            filtered = ", ".join(r.name for r in registry.plugins.values() if r.status == "filtered")
            left_out = f" Left out by HICACHE_PLUGINS: {filtered}." if filtered else ""
            raise LookupError(
                f"{cls.__name__}: implementation {name!r} is not registered. Registered: {known}. "
                f"Plugins that failed to load or register: {failed}.{left_out} Install the plugin that provides it "
                "(e.g. `pip install -e .`), or set `plugins = {'name': plugin_module}` on the test class."
            )
        # Compared by qualified name: a module imported twice (pytester, reloads) gives equal classes twice.
        if not isinstance(target, str) and _qualname(impl) != _qualname(target):
            raise LookupError(
                f"{cls.__name__}: the implementation registered as {name!r} is {impl.__module__}.{impl.__qualname__}, "
                f"not {target.__module__}.{target.__qualname__}"
            )
        return impl

    @classmethod
    def device_under_test(cls) -> torch.device:
        """:attr:`device`, or CUDA when it is available and claimed, else the CPU."""
        if cls.device is not None:
            return torch.device(cls.device)
        impl = cls.implementation_under_test()
        if torch.cuda.is_available() and "cuda" in impl.device_types:
            return torch.device("cuda")
        return torch.device("cpu")

    @classmethod
    def isolated(cls) -> bool:
        """Whether cases run in the case worker: :attr:`isolate`, else ``HICACHE_KIT_ISOLATE``, else on CUDA."""
        if cls.isolate is not None:
            return bool(cls.isolate)
        asked = KIT_ISOLATE.read()
        if asked is not None:
            return asked
        return cls.device_under_test().type == "cuda"

    @classmethod
    def hicache_run_isolated(cls, item: pytest.Function) -> bool | None:
        """Run a matrix test's case in the case worker (called by the pytest plugin); ``None``: run it here.

        The worker's answer becomes this case's outcome. A worker that died (a signal, an abort)
        or a case that broke the CUDA context fails the case with what happened, its case id and
        the worker's last stderr lines; the next case gets a fresh worker.
        """
        if "hicache_case" not in item.fixturenames or not cls.isolated():
            return None
        from .isolated import run_case

        case = item.funcargs["hicache_case"]
        answer = run_case(item, case)
        outcome, message = answer["outcome"], answer.get("message", "")
        if outcome == "passed":
            return True
        if outcome == "skipped":
            pytest.skip(message)
        name = cls.implementation_under_test().name
        who = f"{name} (plugin {cls.registry_under_test().plugin_of(name)})"
        if outcome == "crashed":
            stderr = answer.get("stderr") or "(nothing)"
            pytest.fail(
                f"{who} [{case.id}] crashed the process it ran in ({message}); the run goes on, the next case in a "
                f"fresh process. The case worker's last words:\n{stderr}",
                pytrace=False,
            )
        if outcome == "lost":
            pytest.fail(f"{who} [{case.id}] {message}; the next case runs in a fresh process", pytrace=False)
        pytest.fail(message, pytrace=False)

    # ---- case generation (called by the pytest plugin) ------------------------------------------

    @classmethod
    def hicache_parametrize(cls, metafunc: pytest.Metafunc) -> None:
        """Parametrize ``metafunc`` with the cases of the test's matrix (see :func:`_matrix`)."""
        matrix = getattr(metafunc.function, "_hicache_matrix", None)
        if matrix is None or "hicache_case" not in metafunc.fixturenames:
            return
        problem = None
        try:
            params = [_param(case, refusal) for case, refusal in _CASES[matrix](cls)]
        except (LookupError, TypeError) as exc:  # a misconfigured test class: one clean collection error
            problem = str(exc)
        if problem is not None:
            pytest.fail(problem, pytrace=False)
        if not params:
            params = [pytest.param(None, id="no-cases", marks=pytest.mark.skip(reason=_nothing_claimed(cls)))]
        metafunc.parametrize("hicache_case", params)

    @pytest.fixture
    def hicache_case(self) -> Case:
        pytest.fail(
            "the hicache conformance kit's pytest plugin is not loaded, so no cases were generated. It loads "
            "through the `pytest11` entry point of hicache-core; with PYTEST_DISABLE_PLUGIN_AUTOLOAD set, "
            "pass `-p hicache_core.testing.pytest_plugin`.",
            pytrace=False,
        )

    @pytest.fixture(autouse=True)
    def _hicache_one_cpu_thread(self):
        """The kit's tensors are tiny: one CPU thread is fastest, and immune to a busy machine's contention."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(threads)

    @pytest.fixture(autouse=True)
    def _hicache_cuda_guard(self, request):
        """Pin a broken CUDA context on the case that broke it: that case fails, and the run ends there.

        A sticky CUDA error leaves the context unusable, so every later CUDA case would fail for
        that reason and not its own; the session stops after this case with a report naming it.
        """
        if _cuda_lost and self.device_under_test().type == "cuda":
            pytest.fail(f"the CUDA context was lost in an earlier case ({_cuda_lost[0]})", pytrace=False)
        yield
        lost = context_lost()
        if lost is not None:
            _cuda_lost.append(f"{request.node.nodeid}: {lost}")
            request.session.shouldstop = (
                f"hicache conformance kit: the CUDA context was lost in {request.node.nodeid} ({lost}); the run stops "
                "here, since every later CUDA case would fail for that reason"
            )
            pytest.fail(f"this case left the CUDA context broken: {lost}", pytrace=False)

    @pytest.fixture
    def hicache_registry(self) -> Registry:
        """The registry the kit uses, for an author's own extra tests."""
        return type(self).registry_under_test()

    # ---- the tests ------------------------------------------------------------------------------

    def test_declaration(self) -> None:
        """The implementation is registered cleanly and its declaration is well formed."""
        impl = self.implementation_under_test()
        registry = self.registry_under_test()
        problems = impl.declaration_problems()
        assert not problems, f"{impl.name}: malformed declaration: {'; '.join(problems)}"
        record = registry.plugins.get(registry.plugin_of(impl.name))
        errors = record.errors if record is not None else ["no plugin record"]
        assert not errors, f"{impl.name}: its plugin {registry.plugin_of(impl.name)} reported errors: {errors}"
        assert impl in registry.candidates(impl.io_backend), f"{impl.name} is not a candidate for {impl.io_backend!r}"
        missing = [name for name in _claimed_layouts(type(self)) if registry.layouts[name].oracle is None]
        assert not missing, "; ".join(_no_oracle(registry, name) for name in missing)

    def test_round_trip(self, hicache_case: Case) -> None:
        """Byte-exact against the reference: pages in random order, every host layer, every byte compared."""
        case = hicache_case
        impl_side, ref_side = self._pair(case)
        h, d = self._round_trip_indices(case, impl_side)
        self._run_both(case, impl_side, ref_side, h, d)
        self._assert_same(case, impl_side, ref_side)

    def test_indices_in_any_order(self, hicache_case: Case) -> None:
        """Indices shuffled item by item (page by page for page-item pools) or descending still match."""
        case = hicache_case
        impl_side, ref_side = self._pair(case)
        h, d = self._round_trip_indices(case, impl_side)
        p = case.page_size if impl_side.host.geometry.items_are_pages else 1
        hp, dp = h.reshape(-1, p), d.reshape(-1, p)
        if case.extra == "descending":
            order = torch.argsort(hp[:, 0], descending=True)
        else:
            order = torch.randperm(hp.shape[0], generator=torch.Generator().manual_seed(case.seed + 1))
        h, d = hp[order.to(hp.device)].reshape(-1), dp[order.to(dp.device)].reshape(-1)
        self._run_both(case, impl_side, ref_side, h, d)
        self._assert_same(case, impl_side, ref_side)

    def test_partial_last_page(self, hicache_case: Case) -> None:
        """The last page of each pool: a partly filled device page (token pools), the last host page."""
        case = hicache_case
        impl_side, ref_side = self._pair(case)
        kind = impl_side.host.geometry.decl
        p = case.page_size
        host_pages = impl_side.host.page_num
        if kind.items_are_pages:
            h = C.pages_of(torch.tensor([1, host_pages - 1]), p)
            d = C.pages_of(torch.tensor([0, C.device_pages(kind, p) - 1]), p)
        else:
            rows = C.device_size(kind, p) + p
            tail = rows % p or p
            h = torch.cat([C.pages_of(torch.tensor([2]), p), (host_pages - 1) * p + torch.arange(tail)])
            d = torch.cat([C.pages_of(torch.tensor([1]), p), (rows - tail) + torch.arange(tail)])
        self._run_both(case, impl_side, ref_side, self._host_idx(case, h), self._device_idx(case, impl_side, d))
        self._assert_same(case, impl_side, ref_side)

    def test_pool_untouched_outside_indices(self, hicache_case: Case) -> None:
        """One page of one layer moves; every other byte of both pools stays as it was."""
        case = hicache_case
        impl_side, ref_side = self._pair(case)
        p = case.page_size
        h = self._host_idx(case, C.pages_of(torch.tensor([2]), p))
        d = self._device_idx(case, impl_side, C.pages_of(torch.tensor([1]), p))
        before = impl_side.snapshot()
        written = self._written_mask(case, ref_side, h, d)
        self._transfer(case, impl_side, h, d, one_layer=True)
        self._sync()
        after = impl_side.snapshot()
        moved = False
        for name, old in before.items():
            changed = after[name] != old
            moved = moved or bool((changed & written[name]).any())
            stray = changed & ~written[name]
            if bool(stray.any()):
                first = int(torch.nonzero(stray)[0])
                pytest.fail(
                    f"{self._who()} [{case.id}] wrote {int(stray.sum())} bytes of {name} outside the indices "
                    f"it was given (first at byte {first})",
                    pytrace=False,
                )
        if not moved:
            pytest.fail(f"{self._who()} [{case.id}] moved nothing: the page it was given is unchanged", pytrace=False)

    def test_rejects_bad_input(self, hicache_case: Case) -> None:
        """Bad input raises a clear error, or (without validation) is dropped and reported; then good input works.

        A raise must come before any byte moves. An implementation that masks out-of-range
        indices instead must move every valid pair, touch nothing else, and leave the report
        for the pool's next call (:class:`~hicache_core.pool.drops.DroppedIndicesError`, naming the
        faulty call). Every case then moves good indices through the same pool (one layer of a
        per-layer operation) and compares with the reference, so the implementation itself is
        exercised in each one.
        """
        case = hicache_case
        kinds, words, validate = BAD_INPUTS[case.extra]
        impl_side, ref_side = self._pair(case, validate=validate)
        kind = impl_side.host.geometry.decl
        p = case.page_size
        h: Any = self._host_idx(case, C.pages_of(torch.tensor([1, 2]), p))
        d: Any = self._device_idx(case, impl_side, C.pages_of(torch.tensor([2, 0]), p))
        good_h, good_d = h, d
        host_items = impl_side.host.size
        device_slots = C.device_size(kind, p) + (0 if kind.items_are_pages else p)
        layer_id = impl_side.host.start_layer
        pool = impl_side.device_pool
        bad = case.extra
        allowed_h, allowed_d = h, d  # the in-range pairs a dropping implementation must still move
        if bad == "length_mismatch":
            d = d[:-p]
        elif bad == "float_indices":
            h = h.to(torch.float32)
        elif bad == "two_dim_indices":
            h, d = h.reshape(2, -1), d.reshape(2, -1)
        elif bad == "list_indices":
            h, d = h.tolist(), d.tolist()
        elif bad in ("host_index_past_end", "host_index_past_end_unvalidated"):
            h = h.clone()
            h[-p:] = host_items + torch.arange(p)
            allowed_h, allowed_d = h[:-p], d[:-p]
        elif bad == "device_index_past_end":
            d = d.clone()
            d[-p:] = device_slots + torch.arange(p, device=d.device)
        elif bad in ("negative_index", "device_index_negative_unvalidated"):
            d = d.clone()
            d[-p:] = torch.arange(-p, 0, device=d.device)
            allowed_h, allowed_d = h[:-p], d[:-p]
        elif bad == "layer_out_of_range":
            layer_id = impl_side.host.layer_num + 5
        elif bad == "wrong_device_pool":
            pool, _ = C.build_device_pools(kind, case.variant, p, self.device_under_test())
        elif bad == "not_whole_pages":
            h = h + 1
        before = impl_side.snapshot()
        raised: BaseException | None = None
        try:
            self._transfer(case, impl_side, h, d, one_layer=True, layer_id=layer_id, device_pool=pool)
        except Exception as exc:  # noqa: BLE001 - the type is checked just below
            raised = exc
        self._sync()
        after = impl_side.snapshot()
        if raised is None and bad.endswith("_unvalidated"):
            self._check_dropped_and_reported(case, impl_side, ref_side, allowed_h, allowed_d)
        elif raised is None:
            pytest.fail(f"{self._who()} [{case.id}] accepted bad input ({bad}) without an error", pytrace=False)
        else:
            if not isinstance(raised, kinds):
                pytest.fail(
                    f"{self._who()} [{case.id}] raised {type(raised).__name__} for {bad}; expected "
                    f"{' or '.join(k.__name__ for k in kinds)}: {raised}",
                    pytrace=False,
                )
            message = str(raised).lower()
            assert message, f"{self._who()} [{case.id}] raised {type(raised).__name__} with an empty message for {bad}"
            if words and not any(w in message for w in words):
                pytest.fail(
                    f"{self._who()} [{case.id}] error for {bad} does not say what is wrong (expected one of "
                    f"{words}): {raised}",
                    pytrace=False,
                )
            for name, old in before.items():
                if not torch.equal(after[name], old):
                    pytest.fail(
                        f"{self._who()} [{case.id}] raised for {bad} but had already changed {name}: bad input must "
                        "be rejected before any byte moves (a per-item or per-layer loop that raises half way, or "
                        "torch's index_copy_ meeting a bad index, leaves a half-written pool)",
                        pytrace=False,
                    )
        # The positive control: the same pool, good indices, byte-exact against the reference. One layer of a
        # per-layer operation shows the pool still works; test_round_trip moves every layer.
        self._run_both(case, impl_side, ref_side, good_h, good_d, one_layer=True)
        self._assert_same(case, impl_side, ref_side)

    def _check_dropped_and_reported(self, case: Case, impl_side: _Side, ref_side: _Side, h, d) -> None:
        """A dropping implementation moved exactly the valid pairs, and the pool reports the drop next."""
        faulty = impl_side.host.plan.drop_report.seq
        self._transfer(case, ref_side, h, d, one_layer=True)
        self._sync()
        got, want = impl_side.snapshot(), ref_side.snapshot()
        for name in got:
            if not torch.equal(got[name], want[name]):
                diff = got[name] != want[name]
                pytest.fail(
                    f"{self._who()} [{case.id}] neither raised nor dropped the bad items cleanly: {name} differs "
                    f"from the valid pairs alone in {int(diff.sum())} bytes (a dropping implementation must move "
                    "every valid pair and write nothing else)",
                    pytrace=False,
                )
        p = case.page_size
        h_next = self._host_idx(case, C.pages_of(torch.tensor([3]), p))
        d_next = self._device_idx(case, impl_side, C.pages_of(torch.tensor([1]), p))
        try:
            self._transfer(case, impl_side, h_next, d_next, one_layer=True)
        except DroppedIndicesError as exc:
            if exc.call != faulty or f"call #{faulty}" not in str(exc):
                pytest.fail(
                    f"{self._who()} [{case.id}] the drop was reported against call #{exc.call}, not the faulty "
                    f"call #{faulty}: {exc}",
                    pytrace=False,
                )
            return
        pytest.fail(
            f"{self._who()} [{case.id}] returned normally from a call with out-of-range indices and the pool's next "
            "call did not report it: a kernel that masks indices must store plan.drop_report.seq at "
            "plan.drop_report.address (see hicache_core.pool.drops), or raise in the call",
            pytrace=False,
        )

    def test_layout_matches_its_oracle(self, hicache_case: Case) -> None:
        """After a transfer, every moved item sits where the layout's oracle says, independently of its axes.

        The reference reads the same declaration as the implementation, so a declaration whose
        axes differ from what its author meant passes every round trip; the oracle (for the
        built-in layouts: written from SGLang's shapes) catches it.
        """
        case = hicache_case
        registry = self.registry_under_test()
        oracle = registry.layouts[case.layout].oracle
        if oracle is None:
            pytest.fail(_no_oracle(registry, case.layout), pytrace=False)
        impl_side, _ = self._pair(case)
        h, d = self._round_trip_indices(case, impl_side)
        self._transfer(case, impl_side, h, d)
        self._sync()
        host = impl_side.host
        page = host.geometry.items_are_pages
        hs = (h[:: case.page_size] // case.page_size if page else h).tolist()
        ds = (d[:: case.page_size] // case.page_size if page else d).tolist()
        layers = range(host.layer_num) if case.operation == BACKUP_ALL or host.layer_num else ()
        if case.operation != BACKUP_ALL:  # per-layer operations ran on every owned and draft layer
            layers = range(host.layer_num)
        for layer in layers:
            for part in host.plan.parts:
                device = part.device_layer_view(layer)
                for hi, di in zip(hs, ds):
                    want = device[di].reshape(-1).cpu()
                    got = oracle(host, part.spec.name, layer, hi).reshape(-1).contiguous().view(torch.uint8)
                    if not torch.equal(got.cpu(), want):
                        pytest.fail(
                            f"{self._who()} [{case.id}] part {part.spec.name!r} of item {hi}, host layer {layer}, "
                            f"is not where layout {case.layout!r}'s oracle puts it: the layout's axes "
                            f"{registry.layouts[case.layout].axes} disagree with its oracle, or the implementation "
                            "wrote elsewhere",
                            pytrace=False,
                        )

    def test_beside_compute_stream(self, hicache_case: Case) -> None:
        """On CUDA: the transfer runs on the caller's current stream while a GEMM runs on another one.

        The caller's stream is held back (``torch.cuda._sleep``) and then writes the data the
        transfer depends on; an implementation that ignores the current stream reads or writes
        too early and the bytes differ from the reference. Indices are handed over where the
        implementation wants them, so the core never drains the stream on its behalf.
        """
        case = hicache_case
        device = self.device_under_test()
        if device.type != "cuda" or not hasattr(torch.cuda, "_sleep"):
            pytest.skip("needs CUDA: runs the transfer on a side stream beside a GEMM on another stream")
        impl_side, ref_side = self._pair(case)
        h, d = self._round_trip_indices(case, impl_side)
        if self.implementation_under_test().index_device == "cpu":
            h, d = h.cpu(), d.cpu()
        kind = impl_side.host.geometry.decl
        dev_names = list(C.device_tensors(impl_side.device_pool, impl_side.drafts, kind))
        gen = torch.Generator().manual_seed(case.seed + 2)
        fresh = {
            n: torch.randint(0, 256, C.as_bytes(t).shape, dtype=torch.uint8, generator=gen).to(device)
            for n, t in C.device_tensors(impl_side.device_pool, impl_side.drafts, kind).items()
        }
        gemm = torch.randn(1024, 1024, device=device)
        torch.cuda.synchronize(device)
        side, compute = torch.cuda.Stream(device), torch.cuda.Stream(device)
        with torch.cuda.stream(compute):
            out = gemm
            for _ in range(8):
                out = torch.tanh(out @ gemm)
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            tensors = C.device_tensors(impl_side.device_pool, impl_side.drafts, kind)
            self._prepare_stream_step(case, tensors, fresh)
            self._transfer(case, impl_side, h, d)
            seen = {n: C.as_bytes(tensors[n]).clone() for n in dev_names}
        side.synchronize()
        compute.synchronize()
        self._prepare_stream_step(case, C.device_tensors(ref_side.device_pool, ref_side.drafts, kind), fresh)
        self._transfer(case, ref_side, h, d)
        torch.cuda.synchronize(device)
        self._assert_same(case, impl_side, ref_side)
        want = C.device_tensors(ref_side.device_pool, ref_side.drafts, kind)
        for n in dev_names:
            assert torch.equal(seen[n].cpu(), C.as_bytes(want[n]).cpu()), (
                f"{self._who()} [{case.id}] {n}: a read on the caller's stream right after the call saw other bytes "
                "than the reference: the transfer did not run on the current stream"
            )

    def test_layer_events_order_a_consumer(self, hicache_case: Case) -> None:
        """On CUDA, as a server loads a cached prefix: every layer's load issued on a load stream, an
        event recorded after each layer's call, and a consumer stream that waits on layer ``l``'s
        event and then reads the device pool (a kernel on the consumer stream). Whatever layers
        ``0..l`` moved must be there, byte for byte, when the consumer reads: an implementation
        that returns before its copies are ordered on the load stream (a worker thread, a side
        stream) fails here. The load stream is held back first, so the copies are still queued
        when the events are recorded.
        """
        case = hicache_case
        device = self.device_under_test()
        if device.type != "cuda" or not hasattr(torch.cuda, "_sleep"):
            pytest.skip("needs CUDA: a consumer stream waits on per-layer events of a load stream")
        if case.operation == BACKUP_ALL:
            pytest.skip("per-layer events are what a layer-wise load records; an all-layer backup has one")
        impl_side, ref_side = self._pair(case)
        h, d = self._round_trip_indices(case, impl_side)
        if self.implementation_under_test().index_device == "cpu":
            h, d = h.cpu(), d.cpu()
        kind = impl_side.host.geometry.decl
        host = impl_side.host
        # What the reference leaves after each layer (run on the default stream, synchronously).
        watch = (lambda side: C.device_tensors(side.device_pool, side.drafts, kind)) if case.operation == LOAD else (
            lambda side: C.host_tensors(side.host))  # fmt: skip
        for side in (impl_side, ref_side):
            for t in watch(side).values():
                C.as_bytes(t).fill_(0xA5)
        torch.cuda.synchronize(device)
        layers = list(range(host.start_layer, host.end_layer))
        method = getattr(ref_side.host, case.operation)
        want, before = [], {n: C.as_bytes(t).clone() for n, t in watch(ref_side).items()}
        for layer in layers:
            method(ref_side.device_pool, h, d, layer, "reference")
            torch.cuda.synchronize(device)
            want.append({n: C.as_bytes(t).clone() for n, t in watch(ref_side).items()})
        load, consumer = torch.cuda.Stream(device), torch.cuda.Stream(device)
        events = [torch.cuda.Event() for _ in layers]
        seen = []
        impl_method = getattr(host, case.operation)
        with torch.cuda.stream(load):
            torch.cuda._sleep(50_000_000)
            for layer, event in zip(layers, events):
                impl_method(impl_side.device_pool, h, d, layer, impl_side.io_backend)
                event.record(load)
        with torch.cuda.stream(consumer):
            for event in events:
                consumer.wait_event(event)
                # A read ordered on the consumer stream: a copy kernel for device bytes, a DMA for host bytes.
                seen.append({n: C.as_bytes(t).clone() if t.is_cuda else C.as_bytes(t).to(device, non_blocking=True)
                             for n, t in watch(impl_side).items()})  # fmt: skip
        torch.cuda.synchronize(device)
        for i, layer in enumerate(layers):
            for n, got in seen[i].items():
                got, ref = got.cpu(), want[i][n].cpu()
                moved = ref != before[n].cpu()  # bytes layers <= layer changed in the reference
                if not torch.equal(got[moved], ref[moved]):
                    bad = int((got[moved] != ref[moved]).sum())
                    pytest.fail(
                        f"{self._who()} [{case.id}] {n}: a consumer waiting on the event recorded after layer "
                        f"{layer}'s call saw {bad} of {int(moved.sum())} moved bytes not yet there: the copies were "
                        "not ordered before that event on the caller's stream",
                        pytrace=False,
                    )
        self._assert_same(case, impl_side, ref_side)

    def test_unpinned_host(self, hicache_case: Case) -> None:
        """On CUDA, a host pool that is not pinned is refused at construction with a reason, or works."""
        case = hicache_case
        if self.device_under_test().type != "cuda":
            pytest.skip("needs CUDA: host memory is only pinned where CUDA exists")
        try:
            impl_side, ref_side = self._pair(case, pin_memory=False, skip_refused=False)
        except UnsupportedCombinationError as exc:
            assert "pinned" in str(exc), f"{self._who()} refused an unpinned host pool without saying why: {exc}"
            return
        h, d = self._round_trip_indices(case, impl_side)
        self._run_both(case, impl_side, ref_side, h, d)
        self._assert_same(case, impl_side, ref_side)

    # ---- helpers --------------------------------------------------------------------------------

    def _who(self) -> str:
        impl = self.implementation_under_test()
        return f"{impl.name} (plugin {self.registry_under_test().plugin_of(impl.name)})"

    def _pair(
        self, case: Case, *, validate: bool = False, pin_memory: bool = True, skip_refused: bool = True
    ) -> tuple[_Side, _Side]:
        """Twin pools with the same random bytes: one moved by the implementation, one by the reference."""
        impl = self.implementation_under_test()
        registry = self.registry_under_test()
        device = self.device_under_test()
        if device.type == "cuda" and not torch.cuda.is_available():
            pytest.skip("device 'cuda' was asked for, but CUDA is not available")
        kind = registry.pool_kinds[case.pool_kind]
        sides = []
        for backend, name in ((impl.io_backend, impl.name), ("reference", "reference")):
            pool, drafts = C.build_device_pools(kind, case.variant, case.page_size, device)
            if skip_refused and name == impl.name:
                reasons = _reasons(impl, registry, case, pool, drafts, pin_memory)
                if reasons:
                    pytest.skip(_refusal(impl, reasons))
            host = make_host_pool(
                pool,
                layout=case.layout,
                io_backend=backend,
                implementation=name,
                operations=[case.operation],
                size=C.host_size(kind, case.page_size),
                pin_memory=pin_memory,
                draft_pools=drafts,
                validate=validate,
                registry=registry,
                verify=False,  # the kit checks the implementation's bytes itself (verification: tests/test_verify.py)
            )
            sides.append(_Side(pool, drafts, host, backend))
        gen = torch.Generator().manual_seed(case.seed)
        impl_side, ref_side = sides
        mine, theirs = list(impl_side.tensors().values()), list(ref_side.tensors().values())
        for image, twin in zip(C.fill_random(mine, gen), theirs):
            C.as_bytes(twin).copy_(image)
        return impl_side, ref_side

    def _host_idx(self, case: Case, slots: torch.Tensor) -> torch.Tensor:
        return slots.to(case.dtype)

    def _device_idx(self, case: Case, side: _Side, slots: torch.Tensor) -> torch.Tensor:
        return slots.to(device=side.host.plan.device, dtype=case.dtype)

    def _sync(self) -> None:
        if self.device_under_test().type == "cuda":
            torch.cuda.synchronize()

    def _round_trip_indices(self, case: Case, side: _Side) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole pages in random order: always the last host page, and device pages anywhere."""
        p = case.page_size
        gen = torch.Generator().manual_seed(case.seed)
        host_pages = side.host.page_num
        device_pages = C.device_pages(side.host.geometry.decl, p)
        count = min(host_pages, device_pages, 12 if p == 1 else 3)
        h = C.pages_of(C.pick(count, host_pages, gen, include=host_pages - 1), p)
        d = C.pages_of(C.pick(count, device_pages, gen), p)
        return self._host_idx(case, h), self._device_idx(case, side, d)

    def _transfer(
        self,
        case: Case,
        side: _Side,
        h: Any,
        d: Any,
        *,
        one_layer: bool = False,
        layer_id: int | None = None,
        device_pool: Any = None,
    ) -> None:
        """Run the case's operation: per-layer operations on every host layer (or just one)."""
        host, backend = side.host, side.io_backend
        pool = side.device_pool if device_pool is None else device_pool
        if case.operation == BACKUP_ALL:
            host.backup_from_device_all_layer(pool, h, d, backend)
            return
        method: Callable[..., None] = getattr(host, case.operation)
        if host.start_layer > 0 and layer_id is None:  # a layer this rank does not own: must be a no-op
            method(pool, h, d, 0, backend)
        if one_layer:
            method(pool, h, d, host.start_layer if layer_id is None else layer_id, backend)
            return
        for layer_id in range(host.start_layer, host.end_layer):
            method(pool, h, d, layer_id, backend)
        for j, draft in enumerate(side.drafts):
            method(draft, h, d, host.geometry.layer_num + j, backend, is_draft=True)

    def _run_both(self, case: Case, impl_side: _Side, ref_side: _Side, h: torch.Tensor, d: torch.Tensor, *,
                  one_layer: bool = False) -> None:  # fmt: skip
        self._transfer(case, impl_side, h, d, one_layer=one_layer)
        self._transfer(case, ref_side, h.clone(), d.clone(), one_layer=one_layer)
        self._sync()

    def _written_mask(self, case: Case, ref_side: _Side, h: torch.Tensor, d: torch.Tensor) -> dict[str, torch.Tensor]:
        """Which bytes a correct transfer of (h, d) may write: run the reference from ones onto zeros."""
        source_is_host = case.operation == LOAD
        saved = ref_side.snapshot()
        for name, t in ref_side.tensors().items():
            C.as_bytes(t).fill_(1 if name.startswith("host") == source_is_host else 0)
        self._transfer(case, ref_side, h, d, one_layer=True)
        marks = {}
        for name, image in ref_side.snapshot().items():
            destination = name.startswith("host") != source_is_host
            marks[name] = image != 0 if destination else torch.zeros_like(image, dtype=torch.bool)
        for name, t in ref_side.tensors().items():
            C.as_bytes(t).copy_(saved[name])
        return marks

    def _prepare_stream_step(
        self, case: Case, tensors: dict[str, torch.Tensor], fresh: dict[str, torch.Tensor]
    ) -> None:
        if case.operation == LOAD:  # the destination is overwritten first: a load must land after this
            for t in tensors.values():
                C.as_bytes(t).fill_(0xA5)
        else:  # the source is produced on the stream: a backup must read it after this
            for n, t in tensors.items():
                C.as_bytes(t).copy_(fresh[n], non_blocking=True)

    def _assert_same(self, case: Case, impl_side: _Side, ref_side: _Side) -> None:
        got, want = impl_side.snapshot(), ref_side.snapshot()
        problems = []
        for name in got:
            a, b = got[name], want[name]
            if torch.equal(a, b):
                continue
            diff = a != b
            first = int(torch.nonzero(diff)[0])
            problems.append(
                f"  {name}: {int(diff.sum())} of {a.numel()} bytes differ from the reference "
                f"(first at byte {first}: got {int(a[first])}, want {int(b[first])})"
            )
        if problems:
            pytest.fail(f"{self._who()} [{case.id}] is not byte-exact:\n" + "\n".join(problems), pytrace=False)


# ---- case matrices ------------------------------------------------------------------------------


def _matrix(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a test method with the matrix its cases come from."""

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn._hicache_matrix = name  # type: ignore[attr-defined]
        return fn

    return mark


_matrix("round_trip")(ConformanceTests.test_round_trip)
_matrix("order")(ConformanceTests.test_indices_in_any_order)
_matrix("partial")(ConformanceTests.test_partial_last_page)
_matrix("untouched")(ConformanceTests.test_pool_untouched_outside_indices)
_matrix("bad")(ConformanceTests.test_rejects_bad_input)
_matrix("oracle")(ConformanceTests.test_layout_matches_its_oracle)
_matrix("stream")(ConformanceTests.test_beside_compute_stream)
_matrix("stream")(ConformanceTests.test_layer_events_order_a_consumer)
_matrix("unpinned")(ConformanceTests.test_unpinned_host)


@functools.cache
def _cpu_geometry(kind, variant: str, page_size: int, registry: Registry) -> PoolGeometry:
    pool, drafts = C.build_device_pools(kind, variant, page_size, "cpu")
    return geometry_of(pool, draft_pools=drafts, pool_kinds=registry.pool_kinds)


def _reasons(impl, registry: Registry, case: Case, pool: Any, drafts: tuple, pin_memory: bool) -> list[str]:
    """The dispatcher's reasons for refusing ``case`` on the pools just built."""
    geometry = geometry_of(pool, draft_pools=drafts, pool_kinds=registry.pool_kinds)
    return reasons_for(impl, _request(impl, registry, case, geometry, pin_memory))


def _request(impl, registry: Registry, case: Case, geometry: PoolGeometry, pin_memory: bool) -> TransferRequest:
    pinned = pin_memory and geometry.device_type == "cuda" and torch.cuda.is_available()
    return TransferRequest(impl.io_backend, case.operation, geometry, registry.layouts[case.layout], pinned)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _refusal(impl, reasons: list[str]) -> str:
    return f"{impl.name} refuses: " + "; ".join(reasons)


def _param(case: Case, refusal: str | None):
    marks = [pytest.mark.skip(reason=refusal)] if refusal else []
    return pytest.param(case, id=case.id, marks=marks)


def _nothing_claimed(cls: type[ConformanceTests]) -> str:
    impl = cls.implementation_under_test()
    return (
        f"no case of this test fits what {impl.name} claims and {cls.__name__}'s filters "
        "(only_*, variants, page_sizes, index_dtypes) allow"
    )


def _storable(registry: Registry, kind: str, layout: str) -> bool:
    """Whether ``layout`` can store pools of ``kind`` at all (so cases for it mean something)."""
    geometry = _cpu_geometry(registry.pool_kinds[kind], "plain", 4, registry)
    return TransferRequest("reference", LOAD, geometry, registry.layouts[layout]).storable


def _axes(cls: type[ConformanceTests]):
    """The implementation's claims, intersected with the registry and the class's filters."""
    impl = cls.implementation_under_test()
    registry = cls.registry_under_test()
    kinds = [k for k in registry.pool_kinds if impl.pool_kinds is None or k in impl.pool_kinds]
    if cls.only_pool_kinds is not None:
        kinds = [k for k in kinds if k in set(cls.only_pool_kinds)]
    layouts = {
        k: [
            name
            for name in registry.layouts
            if _storable(registry, k, name)
            and (impl.layouts is None or name in impl.layouts)
            and (cls.only_layouts is None or name in set(cls.only_layouts))
        ]
        for k in kinds
    }
    ops = [op for op in C.OPERATION_ORDER if op in impl.operations]
    if cls.only_operations is not None:
        ops = [op for op in ops if op in set(cls.only_operations)]
    return impl, registry, kinds, layouts, ops


def _claimed_layouts(cls: type[ConformanceTests]) -> list[str]:
    """The layouts the kit runs the implementation on (any pool kind it claims)."""
    _, _, _, layouts, _ = _axes(cls)
    return sorted({name for names in layouts.values() for name in names})


def _collection_refusal(cls: type[ConformanceTests], impl, registry: Registry, case: Case) -> str | None:
    device = cls.device_under_test()
    kind = registry.pool_kinds[case.pool_kind]
    geometry = replace(_cpu_geometry(kind, case.variant, case.page_size, registry), device_type=device.type)
    reasons = reasons_for(impl, _request(impl, registry, case, geometry, True))
    return _refusal(impl, reasons) if reasons else None


def _big_page(cls: type[ConformanceTests]) -> int | None:
    sizes = [p for p in cls.page_sizes if p > 1]
    return 64 if 64 in sizes else (max(sizes) if sizes else None)


def _one_dtype(cls: type[ConformanceTests]) -> str:
    dtypes = list(cls.index_dtypes)
    return "int64" if "int64" in dtypes or not dtypes else dtypes[0]


def _full(cls):
    impl, registry, kinds, layouts, ops = _axes(cls)
    for kind in kinds:
        for layout in layouts[kind]:
            for op in ops:
                for variant in cls.variants:
                    for p in cls.page_sizes:
                        for dt in cls.index_dtypes:
                            case = Case(kind, layout, op, variant, p, dt)
                            yield case, _collection_refusal(cls, impl, registry, case)


def _per_layout(
    cls,
    variants: Iterable[str],
    extras_for: Callable[[Any, str, int], Iterable[str]] = lambda kind, op, p: ("",),
    *,
    partial_pages: bool = False,
):
    """One case per pool kind, layout and operation (times ``variants`` and extras), on the biggest page."""
    impl, registry, kinds, layouts, ops = _axes(cls)
    p = _big_page(cls) or (None if partial_pages else 1)
    if p is None:
        return
    for kind in kinds:
        for layout in layouts[kind]:
            for op in ops:
                for variant in variants:
                    for extra in extras_for(registry.pool_kinds[kind], op, p):
                        case = Case(kind, layout, op, variant, p, _one_dtype(cls), extra)
                        yield case, _collection_refusal(cls, impl, registry, case)


def _no_oracle(registry: Registry, layout: str) -> str:
    return (
        f"layout {layout!r} (plugin {registry.plugin_of(layout, 'layout')}) declares no oracle, so the kit cannot "
        "check where it puts each byte independently of the reference (which reads the same declaration). Since "
        "hicache-core 0.2.0 this fails instead of skipping. Declare one: Layout(..., oracle=fn), where "
        "fn(host_pool, part, layer, item) returns the host bytes of that item of that part and layer, written from "
        "the server's shapes, not from the layout's axes (hicache_core.declared.layout_oracles does it for SGLang's "
        "layouts)"
    )


def _bad_inputs(kind, op: str, page_size: int) -> list[str]:
    names = []
    for name in BAD_INPUTS:
        if name == "layer_out_of_range" and op == BACKUP_ALL:
            continue
        if name == "not_whole_pages" and (not kind.items_are_pages or page_size == 1):
            continue
        names.append(name)
    return names


_CASES: dict[str, Callable[[type[ConformanceTests]], Iterable[tuple[Case, str | None]]]] = {
    "round_trip": lambda cls: list(_full(cls)),
    "order": lambda cls: list(_per_layout(cls, ["plain"], lambda kind, op, p: ORDERS)),
    "partial": lambda cls: list(_per_layout(cls, ["plain"], partial_pages=True)),
    "untouched": lambda cls: list(_per_layout(cls, [v for v in ("plain", "sharded") if v in set(cls.variants)])),
    "bad": lambda cls: list(_per_layout(cls, ["plain"], _bad_inputs)),
    "oracle": lambda cls: list(_per_layout(cls, ["plain"])),
    "stream": lambda cls: list(_per_layout(cls, ["plain"])),
    "unpinned": lambda cls: list(_per_layout(cls, ["plain"])),
}

#: Each matrix in words, as docs/plugin-kit.md's kit table states it (tests/test_kit_docs.py keeps them equal).
MATRIX_DOCS: dict[str, str] = {
    "round_trip": "pool kind x layout x operation x plain/sharded/draft x page size 1 and 64 x int32/int64",
    "order": "pool kind x layout x operation x order",
    "partial": "pool kind x layout x operation",
    "untouched": "pool kind x layout x operation x plain/sharded",
    "bad": "pool kind x layout x operation x bad input",
    "oracle": "pool kind x layout x operation",
    "stream": "pool kind x layout x operation",
    "unpinned": "pool kind x layout x operation",
}
assert set(MATRIX_DOCS) == set(_CASES), "every matrix is described for the docs"

__all__ = ["BAD_INPUTS", "MATRIX_DOCS", "ORDERS", "ConformanceTests"]
