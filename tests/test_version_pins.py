"""Releases a user can install: every version pin the docs and READMEs show admits the version of the
distribution it names, the adapters depend on the copy paths their servers use, and the wheel check
installs with the pins CI's environment uses.

A pin is written as pip reads it, with no space between the name and the operator
(``hicache-core>=0.3,<0.4``); an error message quoting a range (``requires hicache-core >=0.1,<0.2``)
has one and is not a pin. CHANGELOG.md is history and keeps the pins of its time.
"""

from __future__ import annotations

import re
from pathlib import Path

import tomllib
from source_tree import tree_files

from hicache_core.plugins.versions import admits

ROOT = Path(__file__).resolve().parents[1]
CLAUSE = r"(?:==|>=|<=|~=|!=|<|>)[0-9][0-9a-z.*]*"
PIN = re.compile(rf"(?<![\w.-])(hicache-[a-z0-9-]+)(?:\[[a-z0-9,-]+\])?({CLAUSE}(?:,\s*{CLAUSE})*)")


def _distributions() -> dict[str, str]:
    """Every distribution in the tree: name -> version (its pyproject.toml)."""
    found = {}
    for manifest in [
        ROOT / "pyproject.toml",
        *ROOT.glob("plugins/*/pyproject.toml"),
        *ROOT.glob("integrations/*/pyproject.toml"),
    ]:
        project = tomllib.loads(manifest.read_text())["project"]
        found[project["name"]] = project["version"]
    return found


def _pages() -> list[Path]:
    pages = []
    for rel in tree_files(ROOT):
        if not rel.endswith(".md"):
            continue
        path = ROOT / rel
        if rel.startswith("tests/") or path.is_symlink() or path.name == "CHANGELOG.md":
            continue
        if rel.startswith("docs/") or path.name == "README.md":
            pages.append(path)
    return pages


def pins_in(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2).replace(" ", "")) for m in PIN.finditer(text)]


def test_the_pin_reader_reads_pins_and_not_quoted_ranges():
    text = (
        'dependencies = ["hicache-core>=0.3,<0.4", "torch>=2.1"]\n'
        "pip install 'hicache-vllm[file]==0.1.0'\n"
        "requires hicache-core >=0.1,<0.2, but 0.2.0 is running\n"
        "`hicache-core<0.3`, and hicache-core~=0.3.0\n"
    )
    assert pins_in(text) == [
        ("hicache-core", ">=0.3,<0.4"),
        ("hicache-vllm", "==0.1.0"),
        ("hicache-core", "<0.3"),
        ("hicache-core", "~=0.3.0"),
    ]


def test_every_pin_in_the_docs_and_readmes_admits_the_current_version():
    versions = _distributions()
    assert {"hicache-core", "hicache-sglang", "hicache-vllm", "hicache-kernel"} <= set(versions)
    pages = _pages()
    assert ROOT / "docs" / "plugins.md" in pages and ROOT / "README.md" in pages
    seen, wrong = [], []
    for page in pages:
        for name, spec in pins_in(page.read_text()):
            rel = page.relative_to(ROOT)
            if name not in versions:
                wrong.append(f"{rel}: {name}{spec} names no distribution of this tree")
                continue
            seen.append((rel, name))
            if admits(spec, versions[name]) is not True:
                wrong.append(f"{rel}: {name}{spec} does not admit {name} {versions[name]}")
    assert not wrong, "\n".join(wrong)
    assert (Path("docs/plugins.md"), "hicache-core") in seen  # the plugin author's pin is read


def test_every_manifest_pins_the_tree_distributions_at_their_current_versions():
    """A first-party dependency (hicache-sglang on hicache-kernel, ...) admits the version in the tree."""
    versions = _distributions()
    wrong = []
    for manifest in [*ROOT.glob("plugins/*/pyproject.toml"), *ROOT.glob("integrations/*/pyproject.toml"),
                     ROOT / "examples" / "thirdparty-plugin" / "pyproject.toml"]:  # fmt: skip
        project = tomllib.loads(manifest.read_text())["project"]
        requirements = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            requirements += extra
        for requirement in requirements:
            for name, spec in pins_in(requirement):
                if name in versions and admits(spec, versions[name]) is not True:
                    wrong.append(f"{manifest.relative_to(ROOT)}: {requirement} (the tree has {versions[name]})")
    assert not wrong, "\n".join(wrong)


def _requires(manifest: str) -> set[str]:
    project = tomllib.loads((ROOT / manifest).read_text())["project"]
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0] for r in project["dependencies"]}


def test_one_install_of_an_adapter_brings_the_copy_paths_its_server_uses():
    """SGLang's io backends are "kernel" (hicache-kernel, hicache-jit) and "direct"; vLLM's auto picks
    from the copy engine (CUDA) and torch copies (CPU)."""
    assert {"hicache-core", "hicache-direct", "hicache-kernel", "hicache-jit"} <= _requires(
        "integrations/sglang/pyproject.toml"
    )
    assert {"hicache-core", "hicache-direct", "hicache-portable"} <= _requires("integrations/vllm/pyproject.toml")


def _pins_of(line: str) -> dict[str, str]:
    return dict(re.findall(r"\b([a-z][a-z0-9_-]*)==([0-9][0-9a-z.]*)", line))


def test_the_wheel_check_installs_with_the_pins_of_ci_environment():
    """scripts/wheels' clean environment pins what scripts/dev pins (torch CPU, triton, the clients)."""
    wheels = (ROOT / "scripts" / "wheels").read_text()
    dev = (ROOT / "scripts" / "dev").read_text()
    user_line = wheels[wheels.index('"$user/pip" install -q torch') :]
    user_line = user_line[: user_line.index("\nnames=")]
    theirs = _pins_of(user_line)
    ours = _pins_of(dev)
    assert {"torch", "triton", "xxhash", "redis", "hiredis", "obstore", "nixl-cu13"} <= set(theirs)
    assert {name: ours.get(name) for name in theirs} == theirs
