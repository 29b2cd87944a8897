"""Meta-tests: every hook spec is typed, documented in its docstring and in docs/plugin-hooks.md, and tested.

The same goes for the implementation base class's declared attributes and for the kit's tests and options.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

import hicache_core.plugins.hookspecs as hookspecs
from hicache_core import Implementation
from hicache_core.testing import ConformanceTests

ROOT = Path(__file__).resolve().parents[1]
DOCS = "".join(p.read_text() for p in sorted((ROOT / "docs").glob("plugin*.md")))  # plugins.md and its pages
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
    assert f"### `{hook}({params})`" in DOCS, f"docs/plugin-hooks.md has no section for {hook}"
    doc = inspect.getdoc(spec)
    assert doc in DOCS, (
        f"docs/plugin-hooks.md does not carry {hook}'s docstring word for word; paste this under its heading:\n\n{doc}"
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
    assert f"| `{test}` |" in DOCS, f"docs/plugin-kit.md's kit table lacks {test}"


@pytest.mark.parametrize(
    "option",
    ["implementation", "plugins", "device", "isolate", "only_pool_kinds", "only_layouts", "only_operations", "variants",
     "page_sizes", "index_dtypes", "make_registry", "hicache_registry"],
)  # fmt: skip
def test_every_kit_option_is_documented(option):
    assert hasattr(ConformanceTests, option)
    assert f"`{option}" in DOCS, f"docs/plugin-kit.md does not document the kit option {option}"


# The README and the docs site: every relative link resolves, every page is in the site's navigation,
# and the README's example runs as printed.

MARKDOWN = sorted({ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")})
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^(```|~~~)[^\n]*$", re.MULTILINE | re.DOTALL)


def _slug(heading: str) -> str:
    """The anchor MkDocs gives a heading (Python-Markdown's toc slugify)."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def _anchors(page: Path) -> set[str]:
    prose = FENCE.sub("", page.read_text())
    return {_slug(re.sub(r"`", "", m.group(1))) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", prose, re.MULTILINE)}


def _relative_links(page: Path) -> list[str]:
    prose = FENCE.sub("", page.read_text())
    return [t for t in LINK.findall(prose) if not re.match(r"^[a-z][a-z0-9+.-]*:|^/", t)]


def _broken_links(page: Path) -> list[str]:
    broken = []
    for target in _relative_links(page):
        path, _, anchor = target.partition("#")
        # a link's base is the page's own folder (docs/changelog.md is a link to CHANGELOG.md: its real one)
        resolved = (page.resolve().parent / path) if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: {resolved.name} has no heading with the anchor #{anchor}")
    return broken


def test_the_link_checker_finds_broken_links_and_anchors(tmp_path):
    (tmp_path / "a.md").write_text("# A page\n\n## Its `second` part\n\n```\n[in code](nowhere.md)\n```\n")
    (tmp_path / "b.md").write_text(
        "[ok](a.md) [ok](a.md#its-second-part) [ok](#b) [web](https://example.org/x.md) ![img](a.md)\n"
        "[gone](c.md) [bad anchor](a.md#third) ![no image](plot.png)\n\n# B\n"
    )
    assert _broken_links(tmp_path / "a.md") == []
    assert [b.split(":")[0] for b in _broken_links(tmp_path / "b.md")] == ["c.md", "a.md#third", "plot.png"]
    assert _slug("Triton kernels against SGLang's kernel") == "triton-kernels-against-sglangs-kernel"


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    broken = _broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)} has broken links:\n" + "\n".join(broken)


def test_every_docs_page_is_in_the_sites_navigation():
    nav = set(re.findall(r"^\s+- [^:\n]+: (\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages - nav == set(), f"pages not in mkdocs.yml's nav: {sorted(pages - nav)}"
    assert nav - pages == set(), f"mkdocs.yml's nav names pages that do not exist: {sorted(nav - pages)}"


def _readme_python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.MULTILINE | re.DOTALL)


def test_the_readme_example_runs_as_printed(tmp_path):
    """The README's first example (pools, backup, load) and its storage lines, in a fresh interpreter.

    The storage example's directory is the one thing changed: a temporary one instead of /var/cache.
    """
    example, storage, plugin = _readme_python_blocks()[:3]
    assert "make_host_pool" in example and "make_storage" in storage and "hookimpl" in plugin
    url = re.search(r'"(file://[^"]+)"', storage).group(1)
    checks = ["assert issubclass(MyCopy, Implementation)", "print('storage', type(storage).__name__)"]
    script = "\n".join([example, storage.replace(url, (tmp_path / "l3").as_uri()), plugin, *checks])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "4 layers backed up and loaded back, byte for byte, with " in done.stdout
    assert "storage " in done.stdout
