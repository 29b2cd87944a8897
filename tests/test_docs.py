"""Meta-tests: every hook spec is typed, documented in its docstring and in docs/plugins.md, and tested.

The same goes for the implementation base class's declared attributes and for the kit's tests and options.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import hicache_core.hookspecs as hookspecs
from hicache_core import Implementation
from hicache_core.testing import ConformanceTests

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "docs" / "plugins.md").read_text()
TEST_FILES = [
    p
    for pattern in ("tests/**/*.py", "plugins/*/tests/**/*.py", "examples/*/tests/**/*.py")
    for p in ROOT.glob(pattern)
    if p.name != Path(__file__).name
]

HOOKS = sorted(
    name for name, obj in vars(hookspecs).items() if callable(obj) and hasattr(obj, f"{hookspecs.PROJECT}_spec")
)


def test_the_hook_specs_are_found():
    assert HOOKS == [
        "hicache_register_backends",
        "hicache_register_layouts",
        "hicache_register_pool_kinds",
        "hicache_register_storage_backends",
    ]


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_spec_has_a_typed_signature_and_a_docstring(hook):
    spec = getattr(hookspecs, hook)
    doc = inspect.getdoc(spec)
    assert doc, f"hook spec {hook} has no docstring"
    assert "Called " in doc, f"{hook}'s docstring must say when it is called"
    for param in inspect.signature(spec).parameters.values():
        assert param.annotation is not inspect.Parameter.empty, f"{hook}: parameter {param.name} is not annotated"
        assert f":param {param.name}:" in doc, f"{hook}: parameter {param.name} is not documented"


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_spec_is_in_docs_plugins_md_word_for_word(hook):
    spec = getattr(hookspecs, hook)
    params = ", ".join(inspect.signature(spec).parameters)
    assert f"### `{hook}({params})`" in DOCS, f"docs/plugins.md has no section for {hook}"
    doc = inspect.getdoc(spec)
    assert doc in DOCS, (
        f"docs/plugins.md does not carry {hook}'s docstring word for word; paste this under its heading:\n\n{doc}"
    )


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_spec_is_exercised_by_a_test(hook):
    users = [p.relative_to(ROOT).as_posix() for p in TEST_FILES if hook in p.read_text()]
    assert users, f"no test file (besides {Path(__file__).name}) exercises the hook {hook}"


@pytest.mark.parametrize(
    "attribute",
    sorted(name for name in vars(Implementation).get("__annotations__", {}) if not name.startswith("_")),
)
def test_every_declared_attribute_of_implementation_is_documented(attribute):
    assert f"| `{attribute}` |" in DOCS, f"docs/plugins.md's attribute table lacks Implementation.{attribute}"


@pytest.mark.parametrize("test", sorted(n for n in dir(ConformanceTests) if n.startswith("test_")))
def test_every_conformance_test_is_documented(test):
    assert f"| `{test}` |" in DOCS, f"docs/plugins.md's kit table lacks {test}"


@pytest.mark.parametrize(
    "option",
    ["implementation", "plugins", "device", "isolate", "only_pool_kinds", "only_layouts", "only_operations", "variants",
     "page_sizes", "index_dtypes", "make_registry", "hicache_registry"],
)  # fmt: skip
def test_every_kit_option_is_documented(option):
    assert hasattr(ConformanceTests, option)
    assert f"`{option}" in DOCS, f"docs/plugins.md does not document the kit option {option}"
