"""The conformance kit itself: cases come from claims, correct code passes, each kind of broken code fails."""

from __future__ import annotations

import textwrap

import pytest
import torch

from hicache_core.testing import Case, ConformanceTests
from hicache_core.testing.conformance import _CASES

pytest_plugins = ["pytester"]

#: Implementations for the kit to judge: one correct, and one per kind of mistake it must catch.
IMPLS = '''
import torch

import hicache_core as hc
from hicache_core import hookimpl


class Good(hc.Implementation):
    """Correct: the reference copy, behind a bounds check."""

    name = "kit.good"
    io_backend = "kit_good"
    device_types = frozenset({"cpu", "cuda"})
    index_dtypes = frozenset({torch.int32, torch.int64})

    def check(self, h, d):
        if int(h.min()) < 0 or int(h.max()) >= self.plan.num_items:
            raise IndexError("host index out of range")
        if int(d.min()) < 0 or int(d.max()) >= self.plan.device_rows:
            raise IndexError("device index out of range")

    def load_to_device_per_layer(self, h, d, layer):
        self.check(h, d)
        hc.reference_copy(self.plan, h, d, [layer], to_device=True)

    def backup_from_device_per_layer(self, h, d, layer):
        self.check(h, d)
        hc.reference_copy(self.plan, h, d, [layer], to_device=False)

    def backup_from_device_all_layer(self, h, d):
        self.check(h, d)
        hc.reference_copy(self.plan, h, d, range(self.plan.num_layers), to_device=False)


class OffByOne(Good):
    """Loads into the device row after the right one."""

    name = "kit.off_by_one"
    io_backend = "kit_off_by_one"

    def load_to_device_per_layer(self, h, d, layer):
        hc.reference_copy(self.plan, h, (d + 1) % self.plan.device_rows, [layer], to_device=True)


class WritesOutside(Good):
    """Correct bytes, plus a stray write to the last device row or host item."""

    name = "kit.writes_outside"
    io_backend = "kit_writes_outside"

    def load_to_device_per_layer(self, h, d, layer):
        super().load_to_device_per_layer(h, d, layer)
        self.plan.parts[0].device_layer_view(layer)[-1].fill_(0x5A)

    def backup_from_device_per_layer(self, h, d, layer):
        super().backup_from_device_per_layer(h, d, layer)
        self.plan.parts[0].host_layer_view(layer)[-1, -1].fill_(0x5A)

    def backup_from_device_all_layer(self, h, d):
        super().backup_from_device_all_layer(h, d)
        self.plan.parts[0].host_layer_view(0)[-1, -1].fill_(0x5A)


class ThroughFloat(Good):
    """Loads through a bf16 -> float32 -> bf16 round trip, which rewrites NaN bit patterns."""

    name = "kit.through_float"
    io_backend = "kit_through_float"

    def load_to_device_per_layer(self, h, d, layer):
        super().load_to_device_per_layer(h, d, layer)
        for part in self.plan.parts:
            view = part.device_layer_view(layer)
            rows = view[d.long()]
            view[d.long()] = rows.view(torch.bfloat16).float().to(torch.bfloat16).view(torch.uint8)


class NoBoundsCheck(Good):
    """Trusts its indices: a negative one wraps around to the last row (as raw pointer arithmetic would)."""

    name = "kit.no_bounds_check"
    io_backend = "kit_no_bounds_check"

    def load_to_device_per_layer(self, h, d, layer):
        hc.reference_copy(self.plan, h % self.plan.num_items, d % self.plan.device_rows, [layer], to_device=True)

    def backup_from_device_per_layer(self, h, d, layer):
        hc.reference_copy(self.plan, h % self.plan.num_items, d % self.plan.device_rows, [layer], to_device=False)

    def backup_from_device_all_layer(self, h, d):
        layers = range(self.plan.num_layers)
        hc.reference_copy(self.plan, h % self.plan.num_items, d % self.plan.device_rows, layers, to_device=False)


class SortsHostOnly(Good):
    """Sorts host indices without carrying the device indices along."""

    name = "kit.sorts_host_only"
    io_backend = "kit_sorts_host_only"

    def load_to_device_per_layer(self, h, d, layer):
        hc.reference_copy(self.plan, torch.sort(h).values, d, [layer], to_device=True)


class NoDrafts(Good):
    """Correct, but claims only layer_first, and no pools with draft layers."""

    name = "kit.no_drafts"
    io_backend = "kit_no_drafts"
    draft = False
    layouts = frozenset({"layer_first"})


class LoadOnly(Good):
    name = "kit.load_only"
    io_backend = "kit_load_only"
    operations = frozenset({"load_to_device_per_layer"})


class NoOp(Good):
    """Moves nothing at all."""

    name = "kit.noop"
    io_backend = "kit_noop"

    def load_to_device_per_layer(self, h, d, layer):
        self.check(h, d)

    def backup_from_device_per_layer(self, h, d, layer):
        self.check(h, d)

    def backup_from_device_all_layer(self, h, d):
        self.check(h, d)


class SwapsKV(Good):
    """Loads K into V's place and V into K's (MHA: equal shapes, so nothing else notices)."""

    name = "kit.swaps_kv"
    io_backend = "kit_swaps_kv"

    def load_to_device_per_layer(self, h, d, layer):
        self.check(h, d)
        parts = self.plan.parts
        pages, tokens = h.long() // self.plan.tokens_per_page, h.long() % self.plan.tokens_per_page
        rows = d.long().to(self.plan.device)
        for part, other in zip(parts, reversed(parts)):
            other.device_layer_view(layer)[rows] = part.host_layer_view(layer)[pages, tokens].to(self.plan.device)


class IgnoresLayer(Good):
    """Always moves layer 0."""

    name = "kit.ignores_layer"
    io_backend = "kit_ignores_layer"

    def load_to_device_per_layer(self, h, d, layer):
        super().load_to_device_per_layer(h, d, 0)

    def backup_from_device_per_layer(self, h, d, layer):
        super().backup_from_device_per_layer(h, d, 0)


class CopiesEveryLayer(Good):
    """A per-layer call that moves every layer."""

    name = "kit.copies_every_layer"
    io_backend = "kit_copies_every_layer"

    def load_to_device_per_layer(self, h, d, layer):
        self.check(h, d)
        hc.reference_copy(self.plan, h, d, range(self.plan.num_layers), to_device=True)

    def backup_from_device_per_layer(self, h, d, layer):
        self.check(h, d)
        hc.reference_copy(self.plan, h, d, range(self.plan.num_layers), to_device=False)


class OnePastTheEnd(Good):
    """Moves one item more than it was given: the one after the last pair."""

    name = "kit.one_past_the_end"
    io_backend = "kit_one_past_the_end"

    def _extend(self, h, d):
        return torch.cat([h, h[-1:] + 1]) % self.plan.num_items, torch.cat([d, d[-1:] + 1]) % self.plan.device_rows

    def load_to_device_per_layer(self, h, d, layer):
        super().load_to_device_per_layer(*self._extend(h, d), layer)

    def backup_from_device_per_layer(self, h, d, layer):
        super().backup_from_device_per_layer(*self._extend(h, d), layer)

    def backup_from_device_all_layer(self, h, d):
        super().backup_from_device_all_layer(*self._extend(h, d))


class HalfWrites(Good):
    """No bounds check up front: item by item, it writes the good items before it meets the bad one."""

    name = "kit.half_writes"
    io_backend = "kit_half_writes"

    def _items(self, h, d, layers, to_device):
        for i in range(h.numel()):
            if not (0 <= int(h[i]) < self.plan.num_items and 0 <= int(d[i]) < self.plan.device_rows):
                raise IndexError(f"index out of range at item {i}")
            hc.reference_copy(self.plan, h[i : i + 1], d[i : i + 1], layers, to_device=to_device)

    def load_to_device_per_layer(self, h, d, layer):
        self._items(h, d, [layer], True)

    def backup_from_device_per_layer(self, h, d, layer):
        self._items(h, d, [layer], False)

    def backup_from_device_all_layer(self, h, d):
        self._items(h, d, range(self.plan.num_layers), False)


class PrivateStream(Good):
    """Runs on a stream of its own instead of the caller's (CUDA only)."""

    name = "kit.private_stream"
    io_backend = "kit_private_stream"
    device_types = frozenset({"cuda"})
    index_device = "device"

    def __init__(self, plan):
        super().__init__(plan)
        self.stream = torch.cuda.Stream(plan.device)

    def _on_own_stream(self, op, *args):
        with torch.cuda.stream(self.stream):
            getattr(Good, op)(self, *args)

    def load_to_device_per_layer(self, h, d, layer):
        self._on_own_stream("load_to_device_per_layer", h, d, layer)

    def backup_from_device_per_layer(self, h, d, layer):
        self._on_own_stream("backup_from_device_per_layer", h, d, layer)

    def backup_from_device_all_layer(self, h, d):
        self._on_own_stream("backup_from_device_all_layer", h, d)


def _blob_oracle(host, part, layer, item):
    """What the author of blob_wrong meant: SGLang's page_blob_direct, (P, 2, L, p, H, D)."""
    p = host.page_size
    return host.kv_buffer[item // p, {"k": 0, "v": 1}[part], layer, item % p]


#: Its axes say (P, 2, p, L, H, D): token and layer swapped against what the oracle states.
BLOB_WRONG = hc.Layout("blob_wrong", ("page", "component", "token", "layer", "head", "dim"), oracle=_blob_oracle,
                       pool_kinds=frozenset({"mha"}))
BLOB_RIGHT = hc.Layout("blob_right", ("page", "component", "layer", "token", "head", "dim"), oracle=_blob_oracle,
                       pool_kinds=frozenset({"mha"}))


class KitPlugin:
    @hookimpl
    def hicache_register_layouts(self, register):
        register(BLOB_WRONG)
        register(BLOB_RIGHT)

    @hookimpl
    def hicache_register_backends(self, register):
        for impl in (Good, OffByOne, WritesOutside, ThroughFloat, NoBoundsCheck, SortsHostOnly, NoDrafts, LoadOnly,
                     NoOp, SwapsKV, IgnoresLayer, CopiesEveryLayer, OnePastTheEnd, HalfWrites, PrivateStream):
            register(impl)
'''


def kit_file(impl: str, **narrow) -> str:
    """A test module running the kit on one of :data:`IMPLS`, narrowed to keep the run short."""
    narrow = {"only_pool_kinds": ("mla",), "page_sizes": (64,), "index_dtypes": ("int64",), **narrow}
    lines = [f"    {key} = {value!r}" for key, value in narrow.items() if value is not None]
    return (
        textwrap.dedent(
            """
        from hicache_core.testing import ConformanceTests
        from kitimpls import KitPlugin


        class TestKit(ConformanceTests):
            implementation = {impl!r}
            plugins = {{"kitplugin": KitPlugin()}}
        """
        ).format(impl=impl)
        + "\n".join(lines)
        + "\n"
    )


@pytest.fixture
def kit(pytester):
    pytester.makepyfile(kitimpls=IMPLS)
    pytester.syspathinsert()

    def run(impl: str, *args: str, **narrow):
        pytester.makepyfile(test_kit=kit_file(impl, **narrow))
        return pytester.runpytest("-p", "no:cacheprovider", "-rs", *args)

    return run


def test_a_correct_implementation_passes_everything_it_claims(kit):
    builtin = ("layer_first", "page_first", "page_first_direct", "page_head", "page_first_kv_split", "blob_right")
    result = kit("kit.good", only_pool_kinds=("mla", "page_rows"), only_layouts=builtin)
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0, result.stdout.str()
    assert outcomes["passed"] > 50
    if not torch.cuda.is_available():  # on a CPU machine only the CUDA-only tests skip, and they say why
        result.stdout.fnmatch_lines(["*needs CUDA*"])


def test_ids_are_readable(kit):
    result = kit("kit.good", "--collect-only", "-q", only_pool_kinds=None, page_sizes=(1, 64), index_dtypes=None)
    result.stdout.fnmatch_lines(
        [
            "*test_round_trip[[]mla-page_first-backup_from_device_per_layer-sharded-p64-int32[]]",
            "*test_round_trip[[]page_rows-layer_first-load_to_device_per_layer-draft-p1-int64[]]",
            "*test_indices_in_any_order[[]mha-page_head-backup_from_device_all_layer-plain-p64-int64-shuffled[]]",
            "*test_rejects_bad_input[[]page_rows-*-not_whole_pages[]]",
        ],
        consecutive=False,
    )


@pytest.mark.parametrize(
    "impl, test, message",
    [
        ("kit.off_by_one", "test_round_trip", "is not byte-exact"),
        ("kit.writes_outside", "test_pool_untouched_outside_indices", "outside the indices it was given"),
        ("kit.through_float", "test_round_trip", "is not byte-exact"),
        ("kit.sorts_host_only", "test_indices_in_any_order", "is not byte-exact"),
        ("kit.no_bounds_check", "test_rejects_bad_input", "neither raised nor dropped the bad items cleanly"),
    ],
)
def test_each_kind_of_mistake_fails_with_a_message_that_names_it(kit, impl, test, message):
    result = kit(impl, "-k", test)
    assert result.parseoutcomes().get("failed", 0) > 0, result.stdout.str()
    result.stdout.fnmatch_lines([f"*{impl} (plugin kitplugin) [[]mla-*{message}*"])
    if message == "is not byte-exact":
        result.stdout.fnmatch_lines(["  device kv_buffer[[]*]: * bytes differ from the reference (first at byte *"])


#: The kit's self-test: each deliberately broken implementation, and what the kit says about it.
BROKEN = [
    ("kit.noop", "test_round_trip", "is not byte-exact", {}),
    ("kit.noop", "test_rejects_bad_input", "is not byte-exact", {}),  # the positive control of every bad case
    ("kit.off_by_one", "test_round_trip", "is not byte-exact", {}),
    ("kit.swaps_kv", "test_round_trip", "is not byte-exact", {"only_pool_kinds": ("mha",)}),
    ("kit.ignores_layer", "test_round_trip", "is not byte-exact", {}),
    ("kit.copies_every_layer", "test_pool_untouched_outside_indices", "outside the indices it was given", {}),
    ("kit.one_past_the_end", "test_pool_untouched_outside_indices", "outside the indices it was given", {}),
    ("kit.half_writes", "test_rejects_bad_input", "had already changed", {}),
    ("kit.good", "test_layout_matches_its_oracle", "is not where layout 'blob_wrong'",
     {"only_pool_kinds": ("mha",), "only_layouts": ("blob_wrong",)}),
]  # fmt: skip


@pytest.mark.parametrize("impl, test, message, narrow", BROKEN, ids=[f"{b[0]}-{b[1]}" for b in BROKEN])
def test_the_kit_fails_every_broken_implementation(kit, impl, test, message, narrow):
    result = kit(impl, "-k", test, **narrow)
    assert result.parseoutcomes().get("failed", 0) > 0, result.stdout.str()
    result.stdout.fnmatch_lines([f"*{impl} (plugin kitplugin) [[]*{message}*"])


def test_a_correct_declaration_passes_its_oracle(kit):
    layouts = ("blob_right", "layer_first", "page_first", "page_first_direct", "page_head")
    result = kit("kit.good", "-k", "test_layout_matches_its_oracle", only_pool_kinds=("mha",), only_layouts=layouts)
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes["passed"] >= 15, result.stdout.str()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a private stream only shows beside the caller's")
def test_the_kit_fails_an_implementation_on_a_private_stream(kit):
    result = kit("kit.private_stream", "-k", "test_beside_compute_stream", only_pool_kinds=("mha",))
    assert result.parseoutcomes().get("failed", 0) > 0, result.stdout.str()
    result.stdout.fnmatch_lines(["*kit.private_stream (plugin kitplugin) [[]*"])


def test_refused_combinations_are_skipped_with_the_dispatchers_reasons(kit):
    result = kit("kit.no_drafts", "-k", "test_round_trip", only_pool_kinds=("mla", "mha"))
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes["passed"] > 0, result.stdout.str()
    result.stdout.fnmatch_lines(["SKIPPED *kit.no_drafts refuses: pools with MTP draft layers are not claimed"])
    # only claimed layouts are generated at all
    result.stdout.no_fnmatch_line("*page_first*")


def test_only_claimed_operations_are_generated():
    class Narrow(ConformanceTests):
        implementation = "kit.load_only"
        plugins = {"kitplugin": _load_kit_plugin()}
        only_pool_kinds = ("mha",)

    cases = [case for case, _ in _CASES["round_trip"](Narrow)]
    assert cases and {c.operation for c in cases} == {"load_to_device_per_layer"}
    assert {c.variant for c in cases} == {"plain", "sharded", "draft"}
    assert {c.page_size for c in cases} == {1, 64} and {c.index_dtype for c in cases} == {"int32", "int64"}
    assert Case("mla", "page_first", "backup_from_device_per_layer", "sharded", 64, "int32").id == (
        "mla-page_first-backup_from_device_per_layer-sharded-p64-int32"
    )


def test_the_implementation_may_be_given_as_its_class_and_the_matrix_narrowed(pytester):
    pytester.makepyfile(
        """
        from hicache_core.testing import ConformanceTests
        from hicache_direct import DirectCopy


        class TestDirectByClass(ConformanceTests):
            implementation = DirectCopy
            device = "cpu"
            only_layouts = ("page_first_direct",)
            only_operations = ("backup_from_device_per_layer",)
            variants = ("sharded",)
            page_sizes = (1,)
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-rs", "-v")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes["passed"] > 10, result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*test_round_trip[[]page_rows-page_first_direct-backup_from_device_per_layer-sharded-p1-int32[]] PASSED*",
            "*test_partial_last_page[[]no-cases[]] SKIPPED*",
        ],
        consecutive=False,
    )
    result.stdout.fnmatch_lines(["SKIPPED *no case of this test fits what direct.copy_engine claims*"])
    result.stdout.no_fnmatch_line("*test_round_trip[[]*-layer_first-*")


def test_an_implementation_that_is_not_registered_is_a_clear_collection_error(kit):
    result = kit("kit.missing")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*implementation 'kit.missing' is not registered. Registered: *kit.good*"])


def test_without_the_pytest_plugin_the_kit_says_how_to_load_it(kit):
    result = kit("kit.good", "-p", "no:hicache", "-k", "test_round_trip")
    assert result.parseoutcomes().get("errors", 0) > 0
    result.stdout.fnmatch_lines(["*pytest plugin is not loaded*-p hicache_core.testing.pytest_plugin*"])


def test_the_pytest_plugin_is_harmless_for_ordinary_tests(pytester):
    pytester.makepyfile(
        """
        import pytest

        class TestPlain:
            @pytest.mark.parametrize("x", [1, 2])
            def test_x(self, x):
                assert x

        def test_loaded(pytestconfig):
            assert pytestconfig.pluginmanager.has_plugin("hicache")
        """
    )
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=3)


def _load_kit_plugin():
    namespace: dict = {"__name__": "kitimpls_inline"}
    exec(compile(IMPLS, "kitimpls_inline", "exec"), namespace)
    return namespace["KitPlugin"]()


# ---- fail-closed: a layout without an oracle, a case that loses the CUDA context -----------------


def test_a_layout_without_an_oracle_fails_the_declaration_check_saying_how_to_declare_one(kit, pytester):
    pytester.makepyfile(noracle=textwrap.dedent('''
        import hicache_core as hc
        from hicache_core import hookimpl
        from kitimpls import KitPlugin

        class WithUnchecked(KitPlugin):
            @hookimpl
            def hicache_register_layouts(self, register):
                super().hicache_register_layouts(register)
                register(hc.Layout("unchecked", ("page", "layer", "component", "token", "head", "dim"),
                                   pool_kinds=frozenset({"mha"})))
    '''))
    pytester.makepyfile(test_kit=textwrap.dedent('''
        from hicache_core.testing import ConformanceTests
        from noracle import WithUnchecked

        class TestKit(ConformanceTests):
            implementation = "kit.good"
            plugins = {"kitplugin": WithUnchecked()}
            only_pool_kinds = ("mha",)
            page_sizes = (64,)
            index_dtypes = ("int64",)
    '''))
    result = pytester.runpytest("-p", "no:cacheprovider", "-rs", "-k", "test_declaration or (oracle and unchecked)")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) >= 2 and "skipped" not in outcomes, result.stdout.str()
    result.stdout.fnmatch_lines([
        "*TestKit.test_declaration*",
        "E       AssertionError: layout 'unchecked' (plugin kitplugin) declares no oracle*Since hicache-core 0.2.0 "
        "this fails instead of skipping. Declare one: Layout(..., oracle=fn)*"])  # fmt: skip


def test_a_case_that_loses_the_cuda_context_fails_and_ends_the_run_naming_it(kit, monkeypatch):
    """Without isolation. Injected: on a CPU machine no case can really lose a CUDA context; the GPU gate runs
    the real path, isolated (tests/test_kit_isolation.py)."""
    from hicache_core.testing import conformance

    checks = []

    def lost_on_the_second_case():
        checks.append(1)
        return "CUDA error: an illegal memory access was encountered (injected)" if len(checks) == 2 else None

    monkeypatch.setattr(conformance, "context_lost", lost_on_the_second_case)
    monkeypatch.setattr(conformance, "_cuda_lost", [])
    monkeypatch.setenv("HICACHE_KIT_ISOLATE", "0")  # in this process, where the injection is (CUDA isolates by default)
    result = kit("kit.good", "-k", "test_round_trip")
    outcomes = result.parseoutcomes()
    # The check runs after each case: the second case errors (at its teardown), and no third case runs.
    assert outcomes.get("errors") == 1 and outcomes.get("passed") == 2 and "failed" not in outcomes, result.stdout.str()
    assert result.ret != 0
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of TestKit.test_round_trip[[]*",
        "*this case left the CUDA context broken: CUDA error: an illegal memory access was encountered (injected)",
        "*Interrupted: hicache conformance kit: the CUDA context was lost in test_kit.py::TestKit::test_round_trip[[]*"
        "the run stops here*"])  # fmt: skip
