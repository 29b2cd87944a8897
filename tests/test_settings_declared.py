"""Every HICACHE_* variable is declared once and read only through hicache_core.settings.

The tree is read as text: every ``HICACHE_*`` name in a string, comment or shell line of a file that
is not a test or a doc must be a declared setting (or the prefix of declared knobs); every read of
the environment with such a name (``os.environ.get``, ``os.getenv``, ``os.environ[...]``, ``in
os.environ``, a shell ``$HICACHE_...``) outside ``hicache_core/settings/__init__.py`` fails; and a setting is
constructed only in a declaring module (the core's ``variables``, or a module a ``hicache.settings``
entry point names).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import io
import json
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
import tomllib
from source_tree import tree_files

from hicache_core import settings
from hicache_core.settings import registry as settings_registry
from hicache_core.settings import variables

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"(?<![A-Za-z0-9_.])HICACHE_[A-Z0-9_]*[A-Z0-9]")
SHELL_READ = re.compile(r"\$\{?HICACHE_[A-Z0-9_]+")
#: Names that are not variables of their own (each with why).
NOT_VARIABLES = {
    "HICACHE_TRITON": "the env_prefix of the Triton base class; every plugin's subclass sets its own",
}
#: Scripts that build the environment hicache is installed in: they read their variables in the shell,
#: before hicache_core can (each is declared all the same, in hicache_core.settings.variables).
BOOTSTRAP = {"scripts/dev", "scripts/docs", "integrations/sglang/dev", "integrations/vllm/dev"}
CONSTRUCTORS = {"Setting", "flag", "integer", "number", "choice", "text", "knob"}
SHELL_SUFFIXES = (".sh",)
SHELL_FILES = {".ci/run", ".ci/checks", ".ci/stage", "scripts/dev", "scripts/docs"}


def _tracked() -> list[Path]:
    return [ROOT / rel for rel in tree_files(ROOT)]


def _is_test_or_doc(rel: str) -> bool:
    parts = rel.split("/")
    return (
        "tests" in parts
        or "e2e" in parts
        or parts[0] == "docs"
        or rel.endswith((".md", ".json", ".txt", ".yml", ".yaml"))
        or Path(rel).name.startswith("test_")
        or Path(rel).name == "conftest.py"
    )


def _sources() -> list[tuple[str, Path]]:
    files = []
    for path in _tracked():
        rel = path.relative_to(ROOT).as_posix()
        if _is_test_or_doc(rel) or not path.is_file():
            continue
        if path.suffix in (".py", ".toml") or path.suffix in SHELL_SUFFIXES or rel in SHELL_FILES:
            files.append((rel, path))
        elif rel.startswith("integrations/") and path.name == "dev":
            files.append((rel, path))
    return files


def _settings_entry_points() -> dict[str, tuple[Path, str]]:
    """Every ``hicache.settings`` entry point of the tree's pyprojects: name -> (project folder, "module:attr")."""
    found = {}
    for pyproject in sorted(ROOT.glob("**/pyproject.toml")):
        if ".venv" in pyproject.parts or "tests" in pyproject.parts:
            continue
        data = tomllib.loads(pyproject.read_text())
        points = data.get("project", {}).get("entry-points", {}).get(settings_registry.ENTRY_POINT_GROUP, {})
        for name, target in points.items():
            found[f"{data['project']['name']}:{name}"] = (pyproject.parent, target)
    return found


def _declared_in_tree() -> dict[str, tuple[str, settings.Setting]]:
    """The core's settings and every tree pyproject's, loaded from the source folders (installed or not)."""
    out = {s.name: ("hicache-core", s) for s in variables.SETTINGS}
    for owner, (folder, target) in _settings_entry_points().items():
        module, _, attr = target.partition(":")
        # By its file, not by sys.path: an adapter not installed here must not become installed for
        # the tests after this one (its egg-info would be found on the path).
        path = folder / (module.replace(".", "/") + ".py")
        spec = importlib.util.spec_from_file_location(f"_declared_{owner.replace(':', '_').replace('-', '_')}", path)
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        for setting in getattr(loaded, attr):
            assert setting.name not in out, f"{setting.name} is declared by {out[setting.name][0]} and by {owner}"
            out[setting.name] = (owner, setting)
    return out


def _declaring_files() -> set[str]:
    files = {"hicache_core/settings/variables.py"}
    for folder, target in _settings_entry_points().values():
        module = target.partition(":")[0]
        files.add((folder / (module.replace(".", "/") + ".py")).relative_to(ROOT).as_posix())
    return files


def _python_names(text: str) -> list[tuple[int, str]]:
    """HICACHE_* names in the strings and comments of Python source (identifiers such as HICACHE_KEYS are not)."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT) or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            found += [(tok.start[0], m.group()) for m in NAME.finditer(tok.string)]
    return found


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _key_names(node: ast.AST, constants: dict[str, str]) -> str | None:
    """The HICACHE_* variable an environment key expression names, where it names one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("HICACHE_"):
        return node.value
    if isinstance(node, ast.Name) and node.id in constants:
        return constants[node.id]
    if isinstance(node, ast.JoinedStr) and node.values:
        first = node.values[0]
        if isinstance(first, ast.Constant) and str(first.value).startswith("HICACHE_"):
            return str(first.value) + "..."
    return None


def _environment_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, variable) of every read of a HICACHE_* variable straight from the environment."""
    constants = {
        target.id: node.value.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        and node.value.value.startswith("HICACHE_")
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    reads = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            getenv = isinstance(func, ast.Attribute) and func.attr == "getenv"
            environ_get = isinstance(func, ast.Attribute) and func.attr in ("get", "pop") and _is_environ(func.value)
            if getenv or environ_get:
                key = _key_names(node.args[0], constants)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            key = _key_names(node.slice, constants)
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            key = _key_names(node.left, constants)
        if key is not None:
            reads.append((node.lineno, key))
    return reads


def _constructions(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            first = node.args[0]
            if name in CONSTRUCTORS and isinstance(first, ast.Constant) and str(first.value).startswith("HICACHE_"):
                found.append((node.lineno, first.value))
    return found


def _accepted(name: str, declared: set[str]) -> bool:
    return name in declared or name in NOT_VARIABLES or any(d.startswith(name + "_") for d in declared)


def test_every_hicache_name_outside_tests_and_docs_is_a_declared_setting():
    declared = set(_declared_in_tree())
    unknown = []
    for rel, path in _sources():
        text = path.read_text()
        if path.suffix == ".py":
            names = _python_names(text)
        else:
            names = [(text.count("\n", 0, m.start()) + 1, m.group()) for m in NAME.finditer(text)]
        unknown += [f"{rel}:{line}: {name}" for line, name in names if not _accepted(name, declared)]
    assert not unknown, "HICACHE_* names no setting declares:\n" + "\n".join(unknown)


def test_no_hicache_variable_is_read_outside_settings():
    reads = []
    for rel, path in _sources():
        if rel == "hicache_core/settings/__init__.py" or rel in BOOTSTRAP:
            continue
        text = path.read_text()
        if path.suffix == ".py":
            reads += [f"{rel}:{line}: {name}" for line, name in _environment_reads(ast.parse(text))]
        elif path.suffix != ".toml":
            for m in SHELL_READ.finditer(text):
                reads.append(f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m.group()}")
    assert not reads, (
        "read past hicache_core.settings (use Setting.read, or python -m hicache_core.settings.registry NAME):\n"
        + ("\n".join(reads))
    )


def test_settings_are_constructed_only_where_they_are_declared():
    declaring = _declaring_files()
    stray = []
    for rel, path in _sources():
        if path.suffix != ".py" or rel in declaring:
            continue
        stray += [f"{rel}:{line}: {name}" for line, name in _constructions(ast.parse(path.read_text()))]
    assert not stray, "a setting declared outside its package's variables module:\n" + "\n".join(stray)


def test_the_scan_sees_a_read_a_construction_and_an_undeclared_name():
    """The checks above on a sample, so that they cannot pass by seeing nothing."""
    sample = (
        'import os\nENV = "HICACHE_X"\nA = os.environ.get("HICACHE_Y")\nB = os.getenv(ENV)\n'
        'C = os.environ["HICACHE_Z"]\nD = "HICACHE_W" in os.environ\nE = flag("HICACHE_V")\nHICACHE_KEYS = {}\n'
        'os.environ["HICACHE_SET"] = "1"\n'
    )
    tree = ast.parse(sample)
    assert sorted(_environment_reads(tree)) == [(3, "HICACHE_Y"), (4, "HICACHE_X"), (5, "HICACHE_Z"), (6, "HICACHE_W")]
    assert _constructions(tree) == [(7, "HICACHE_V")]
    names = {name for _, name in _python_names(sample)}
    assert "HICACHE_KEYS" not in names and {"HICACHE_X", "HICACHE_Y", "HICACHE_SET"} <= names
    assert SHELL_READ.findall("x=${HICACHE_A:-3} y=$HICACHE_B env HICACHE_C=1") == ["${HICACHE_A", "$HICACHE_B"]
    assert not _accepted("HICACHE_NOPE", {"HICACHE_VALIDATE"}) and _accepted("HICACHE_HOST", {"HICACHE_HOST_X"})


def test_each_declaration_names_what_it_takes_and_says_what_it_does():
    for name, (owner, setting) in _declared_in_tree().items():
        assert re.fullmatch(r"HICACHE_[A-Z0-9_]+", name), name
        assert setting.takes and setting.doc, f"{name} ({owner}) needs what it takes and a one-line doc"
        assert "\n" not in setting.doc, name


def test_knob_variables_are_exactly_the_declared_ones():
    """A GPU implementation's knobs (Knob(env=...)) and its plugin's declarations cannot drift apart."""
    from hicache_core.gpu.knobs import knobs_of

    declared = _declared_in_tree()
    retired = {"HICACHE_DIRECT_THREAD"}
    for module, cls_name in [
        ("hicache_kernel.triton_uva", "TritonUVA"),
        ("hicache_jit.one_layer", "JitOneLayer"),
        ("hicache_direct.memcpy", "CudaCopier"),
    ]:
        cls = getattr(importlib.import_module(module), cls_name)
        from_knobs = {f"{cls.env_prefix}_{knob.env}" for knob in knobs_of(cls) if knob.env}
        with_prefix = {name for name in declared if name.startswith(cls.env_prefix + "_")} - retired
        assert from_knobs == with_prefix, f"{cls_name}: knobs {sorted(from_knobs)}, declared {sorted(with_prefix)}"


def test_declared_finds_the_installed_plugins_without_importing_torch():
    code = (
        "import sys, json\nfrom hicache_core.settings import registry as settings_registry\n"
        "found = settings_registry.declared()\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'names': sorted(found),"
        " 'owners': sorted({d.declared_by for d in found.values()})}))"
    )
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert out["torch"] is False
    assert {"hicache-core", "hicache-kernel", "hicache-jit", "hicache-direct"} <= set(out["owners"])
    assert {"HICACHE_VALIDATE", "HICACHE_KERNEL_NUM_WARPS", "HICACHE_DIRECT_MAX_BATCH"} <= set(out["names"])


def test_a_variable_declared_twice_is_refused(monkeypatch):
    import importlib.metadata as metadata

    class Again(metadata.EntryPoint):
        def load(self):  # a second declaration of a core variable
            return [settings.flag("HICACHE_VALIDATE", doc="again")]

    real = metadata.entry_points
    again = Again("again", "x:y", settings_registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(
        metadata,
        "entry_points",
        lambda group: [again] if group == settings_registry.ENTRY_POINT_GROUP else real(group=group),
    )
    with pytest.raises(
        settings_registry.DeclarationError, match="^HICACHE_VALIDATE is declared twice: by hicache-core and by again$"
    ):
        settings_registry.declared()


def _run_settings(env_extra: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}
    env.update(env_extra)
    command = [sys.executable, "-m", "hicache_core.cli", "settings", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)


def test_hicache_settings_prints_each_value_and_where_it_came_from():
    done = _run_settings({"HICACHE_VALIDATE": "1", "HICACHE_L3_HASH_THREADS": "3", "HICACHE_PLUGINS": ""}, "--json")
    assert done.returncode == 0, done.stderr
    rows = {row["name"]: row for row in json.loads(done.stdout)}
    assert rows["HICACHE_VALIDATE"] | {"doc": ""} == {
        "name": "HICACHE_VALIDATE", "value": "True", "source": "environment",
        "takes": "1 or 0 (also true/yes/on or false/no/off)", "doc": "", "declared_by": "hicache-core", "error": None,
    }  # fmt: skip
    assert (rows["HICACHE_L3_HASH_THREADS"]["value"], rows["HICACHE_L3_HASH_THREADS"]["source"]) == ("3", "environment")
    assert (rows["HICACHE_PLUGINS"]["value"], rows["HICACHE_PLUGINS"]["source"]) == ("(none)", "environment")
    assert (rows["HICACHE_LOAD_TIMEOUT_S"]["value"], rows["HICACHE_LOAD_TIMEOUT_S"]["source"]) == ("60.0", "default")
    assert rows["HICACHE_KERNEL_NUM_WARPS"]["declared_by"] == "hicache-kernel"
    assert set(rows) == set(settings_registry.declared())

    table = _run_settings({"HICACHE_VALIDATE": "1"})
    assert table.returncode == 0
    line = next(line for line in table.stdout.splitlines() if line.startswith("HICACHE_VALIDATE "))
    assert line.split()[:3] == ["HICACHE_VALIDATE", "True", "environment"]


def test_hicache_settings_reports_a_refused_value_and_exits_1():
    done = _run_settings({"HICACHE_VERIFY": "maybe"})
    assert done.returncode == 1
    assert "refused: HICACHE_VERIFY='maybe' is not 1 or 0 (also true/yes/on or false/no/off)" in done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("HICACHE_VERIFY "))
    assert line.split()[:3] == ["HICACHE_VERIFY", "(refused)", "environment"]


def test_a_shell_script_reads_one_setting_through_settings():
    ok = subprocess.run([sys.executable, "-m", "hicache_core.settings.registry", "HICACHE_HOST_RESERVE_GIB"],
                        capture_output=True, text=True, env={"HICACHE_HOST_RESERVE_GIB": "1.5"})  # fmt: skip
    assert (ok.returncode, ok.stdout) == (0, "1.5\n")
    bad = subprocess.run([sys.executable, "-m", "hicache_core.settings.registry", "HICACHE_HOST_RESERVE_GIB"],
                         capture_output=True, text=True, env={"HICACHE_HOST_RESERVE_GIB": "-1"})  # fmt: skip
    assert (bad.returncode, bad.stdout, bad.stderr) == (
        2,
        "",
        "HICACHE_HOST_RESERVE_GIB='-1' is not a number of GiB >= 0\n",
    )
    nobody = subprocess.run(
        [sys.executable, "-m", "hicache_core.settings.registry", "HICACHE_NOPE"], capture_output=True, text=True
    )
    assert nobody.returncode == 2 and "HICACHE_NOPE is not a declared setting" in nobody.stderr


def test_a_storage_url_never_shows_its_password():
    declared = _declared_in_tree()
    owner, url = declared["HICACHE_SGLANG_STORAGE_URL"]
    assert owner == "hicache-sglang:sglang"
    shown = url.show(url.parse_text("redis://user:hunter2@cache:6379/0"))
    assert "hunter2" not in shown and "cache:6379/0" in shown


@pytest.mark.parametrize(
    "setting, raw, message",
    [
        (variables.L3_HOST_CHECK, "2", r"^HICACHE_L3_HOST_CHECK='2' is not 1 or 0"),
        (variables.L3_HASH_THREADS, "0", r"^HICACHE_L3_HASH_THREADS='0' is not an integer >= 1$"),
        (variables.KIT_ISOLATE, "yes", r"^HICACHE_KIT_ISOLATE='yes' is not 1 \(each case in a child process\) or 0$"),
        (variables.KIT_CASE_TIMEOUT, "0", r"^HICACHE_KIT_CASE_TIMEOUT='0' is not a number of seconds > 0$"),
    ],
)
def test_values_once_coerced_are_refused(setting, raw, message, monkeypatch):
    """HICACHE_L3_HOST_CHECK=2 (or =false) used to mean "on"; the others had hand-written parsers."""
    monkeypatch.setenv(setting.name, raw)
    with pytest.raises(settings.SettingError, match=message):
        setting.read()


def test_plugins_keeps_unset_all_and_empty_none(monkeypatch):
    from hicache_core.plugins.registry import allowed_plugins

    monkeypatch.delenv("HICACHE_PLUGINS", raising=False)
    assert allowed_plugins() is None
    monkeypatch.setenv("HICACHE_PLUGINS", "")
    assert allowed_plugins() == set()
    monkeypatch.setenv("HICACHE_PLUGINS", " kernel, direct ,")
    assert allowed_plugins() == {"kernel", "direct"}
    monkeypatch.setenv("HICACHE_L3_HOST_CHECK", "false")
    assert variables.L3_HOST_CHECK.read() is False


def test_a_plugin_list_that_does_not_load_is_named_and_settings_exits_2(monkeypatch, capsys):
    import importlib.metadata as metadata

    from hicache_core.tools.settings_list import run

    real = metadata.entry_points
    broken = metadata.EntryPoint(
        "broken", "hicache_no_such_module.variables:SETTINGS", settings_registry.ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(
        metadata,
        "entry_points",
        lambda group: [broken] if group == settings_registry.ENTRY_POINT_GROUP else real(group=group),
    )
    assert run() == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "hicache settings: broken: its hicache.settings entry point hicache_no_such_module.variables:SETTINGS "
        "failed to load: ModuleNotFoundError: No module named 'hicache_no_such_module'"
    )
