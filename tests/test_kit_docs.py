"""docs/plugin-kit.md's conformance-kit table says what the kit does, and its worked oracle example runs.

The table is checked against the kit's code: its rows are the kit's tests in order, each row's matrix
is the one the kit generates (``MATRIX_DOCS``), and what a row says about skipping and failing is what
the test's body does (read from its source: its ``pytest.skip`` calls, and whether it fails a layout
without an oracle). The worked example of an oracle is executed as it stands in the docs and run
through the kit with the ``portable`` plugin's ``torch.gather``; the same layout with two axes swapped fails.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path

import pytest

from hicache_core.plugins.registry import Registry
from hicache_core.testing import ConformanceTests
from hicache_core.testing.conformance import _CASES, MATRIX_DOCS

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
DOCS = "".join(p.read_text() for p in sorted((ROOT / "docs").glob("plugin*.md")))  # plugins.md and its pages
KIT_SECTION = DOCS[DOCS.index("## The conformance kit") :]
KIT_SECTION = KIT_SECTION[: KIT_SECTION.index("\n## ", 3)]
ROWS = {
    m.group(1): (m.group(2).strip(), m.group(3).strip())
    for m in re.finditer(r"^\| `(test_\w+)` \| (.*) \| (.*) \|$", KIT_SECTION, re.M)
}
KIT_TESTS = [name for name in vars(ConformanceTests) if name.startswith("test_")]


def _skip_messages(test: str) -> list[str]:
    """The constant text each ``pytest.skip(...)`` in the test's body starts with."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(ConformanceTests, test))))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.skip":
            arg = node.args[0]
            if isinstance(arg, ast.JoinedStr):
                arg = next((v for v in arg.values if isinstance(v, ast.Constant)), ast.Constant(""))
            out.append(str(arg.value) if isinstance(arg, ast.Constant) else "")
    return out


def _fails_without_oracle(test: str) -> bool:
    source = inspect.getsource(getattr(ConformanceTests, test))
    return "_no_oracle(" in source


def test_the_table_lists_the_kits_tests_in_order():
    assert list(ROWS) == KIT_TESTS, (
        f"docs/plugin-kit.md's kit table lists {list(ROWS)}; the kit's tests are {KIT_TESTS}")


@pytest.mark.parametrize("test", KIT_TESTS)
def test_each_rows_matrix_is_the_one_the_kit_generates(test):
    matrix = getattr(getattr(ConformanceTests, test), "_hicache_matrix", None)
    want = "once" if matrix is None else MATRIX_DOCS[matrix]
    assert ROWS[test][1] == want, f"{test}: the docs say its matrix is {ROWS[test][1]!r}; the kit's is {want!r}"


@pytest.mark.parametrize("test", KIT_TESTS)
def test_each_row_says_when_its_test_skips_and_fails_as_the_code_does(test):
    what = ROWS[test][0]
    skips = _skip_messages(test)
    cuda_only = [m for m in skips if m.startswith("needs CUDA")]
    other = [m for m in skips if not m.startswith("needs CUDA")]
    assert bool(cuda_only) == what.startswith("on CUDA"), (
        f"{test}: {'skips' if cuda_only else 'does not skip'} without CUDA; its row should "
        f"{'' if cuda_only else 'not '}start 'on CUDA': {what}")
    assert bool(other) == ("skip" in what.lower()), (
        f"{test}: skips {other or 'only without CUDA'}; its row {'must' if other else 'must not'} say when: {what}")
    if _fails_without_oracle(test):
        assert "fails" in what and "without an oracle" in what, f"{test} fails a layout without an oracle: {what}"
    else:
        assert "oracle" not in what or "without an oracle" not in what, test


def test_each_matrix_in_the_kit_is_described():
    assert set(MATRIX_DOCS) == set(_CASES)


def test_the_docs_no_longer_promise_what_the_kit_stopped_doing():
    assert "skipped, saying so, for a layout without" not in DOCS
    assert "optional: where an item lands" not in DOCS
    assert "later CUDA case is skipped" not in DOCS


# ---- the worked oracle example ------------------------------------------------------------------

MARK = "<!-- worked-oracle-example: tests/test_kit_docs.py runs this block -->"
EXAMPLE = DOCS[DOCS.index(MARK) :].split("```python\n", 1)[1].split("```", 1)[0]


def _example(swap_axes: bool = False) -> dict:
    code = EXAMPLE
    if swap_axes:
        before = '("page", "token", "component", "layer", "head", "dim")'
        assert before in code
        code = code.replace(before, '("page", "token", "layer", "component", "head", "dim")')
    namespace: dict = {"__name__": "docs_example"}
    exec(compile(code, "docs/plugin-layouts.md (worked oracle example)", "exec"), namespace)
    return namespace


def _registry(swap_axes: bool = False) -> Registry:
    registry = Registry.from_entry_points({"portable"})
    registry.add_plugin(_example(swap_axes)["PageTokenFirstPlugin"](), "example")
    return registry


class TestTheDocsWorkedOracle(ConformanceTests):
    """The kit on the docs' layout as the docs declare it: the oracle and the declaration agree."""

    implementation = "torch.gather"
    device = "cpu"
    only_layouts = ("page_token_first",)
    page_sizes = (4,)
    index_dtypes = ("int64",)
    variants = ("plain", "sharded")

    @classmethod
    def make_registry(cls) -> Registry:
        return _registry()


def test_the_worked_example_is_a_layout_with_an_oracle():
    layout = _registry().layouts["page_token_first"]
    assert layout.oracle is not None and layout.pool_kinds == frozenset({"mha"})
    cases = [case for case, _ in _CASES["oracle"](TestTheDocsWorkedOracle)]
    assert cases and {c.layout for c in cases} == {"page_token_first"}


def test_the_worked_example_with_swapped_axes_fails_only_its_oracle_test(pytester):
    pytester.makepyfile(test_swapped=textwrap.dedent(f'''
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_kit_docs import TestTheDocsWorkedOracle, _registry


        class TestSwapped(TestTheDocsWorkedOracle):
            @classmethod
            def make_registry(cls):
                return _registry(swap_axes=True)
    '''))
    result = pytester.runpytest("-p", "no:cacheprovider", "-k", "TestSwapped and (round_trip or oracle)")
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) > 0 and outcomes.get("failed", 0) > 0, result.stdout.str()
    result.stdout.fnmatch_lines(["*part 'v' of item *, host layer *, is not where layout 'page_token_first''s oracle "
                                 "puts it*"])  # fmt: skip
    result.stdout.no_fnmatch_line("FAILED *test_round_trip*")
