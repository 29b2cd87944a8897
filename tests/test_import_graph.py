"""The house's import graph: no cycle (function-local and typing-only imports included), and wings that stay apart.

Read from the source with ``ast``, so that a late import inside a function counts as much as one at
the top of a file, and so does one under ``if TYPE_CHECKING:`` (a type checker follows it: a circle
there is a circle in what the modules mean). The layering checks read only what runs. The core is
read alone and then with every package of ``plugins/``, ``integrations/`` and ``examples/``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import hicache_core

PACKAGE = Path(hicache_core.__file__).parent
ROOT = "hicache_core"
TREE = Path(__file__).resolve().parents[1]
#: Every package of the house: the core, each plugin's and each integration's (read from the source tree).
HOUSE = [PACKAGE] + sorted(
    p.parent
    for wing in ("plugins", "integrations", "examples")
    for pattern in ("*/*/__init__.py", "*/src/*/__init__.py")
    for p in TREE.glob(f"{wing}/{pattern}")
    if p.parent.name != "tests"
)


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool, modules: set[str], typing: bool = True) -> set[str]:
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if not typing and isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
            found.update(submodules)  # ``from . import uva`` imports the submodule ...
            if len(submodules) < len(node.names):
                found.add(target)  # ... and a name from the module itself needs it run
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(packages: list[Path] | None = None, typing: bool = True) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` (default: the core) it imports (``typing``: ``if TYPE_CHECKING:`` too)."""
    files = [(path, package) for package in packages or [PACKAGE] for path in sorted(package.rglob("*.py"))]
    modules = {_module_name(p, package) for p, package in files}
    graph: dict[str, set[str]] = {}
    for path, package in files:
        name = _module_name(path, package)
        tree = ast.parse(path.read_text(), str(path))
        targets = _imports(tree, name, path.name == "__init__.py", modules, typing)
        edges = set()
        for target in targets:
            # importing a.b.c runs a, a.b and a.b.c: each is an edge, except the importer's own packages,
            # which have started running before it (a name imported from one of them is an edge: the target)
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                own = name.startswith(prefix + ".") and prefix != target
                if prefix in modules and prefix != name and not own:
                    edges.add(prefix)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        todo.extend(graph.get(v, ()))
    return seen


def test_no_import_cycle():
    found = cycles(import_graph())
    assert found == [], f"import cycles in hicache_core (function-local and typing-only imports count): {found}"


def test_no_import_cycle_in_the_house():
    names = {p.name for p in HOUSE}
    wanted = {"hicache_core", "hicache_sglang", "hicache_vllm", "hicache_direct", "hicache_storage_file",
              "hicache_storage_peer", "hicache_pageblob"}  # fmt: skip
    assert wanted <= names and len(HOUSE) >= 12, f"the house's packages were not all found under {TREE}: {HOUSE}"
    graph = import_graph(HOUSE)
    found = cycles(graph)
    assert found == [], f"import cycles in the house (function-local and typing-only imports count): {found}"


def test_typing_only_imports_are_edges():
    graph = import_graph()
    assert f"{ROOT}.storage.backend" in graph[f"{ROOT}.plugins.hookspecs"]  # only under TYPE_CHECKING there
    assert f"{ROOT}.storage.backend" not in import_graph(typing=False)[f"{ROOT}.plugins.hookspecs"]


def test_the_core_imports_no_plugin_or_integration():
    graph = import_graph(HOUSE)  # typing-only imports included: a type checker must not need a plugin either
    for module, edges in graph.items():
        if module.startswith(ROOT):
            wrong = sorted(e for e in edges if not e.startswith(ROOT))
            assert wrong == [], f"{module} imports {wrong}; the core never imports a plugin"


def test_a_module_depends_on_its_own_package_only_for_a_name_from_it(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import run\nVALUE = 1\n")
    (pkg / "a.py").write_text("def run():\n    from . import b\n")  # a sibling: pkg has started running
    (pkg / "b.py").write_text("from .c import x\n")
    (pkg / "c.py").write_text("x = 1\n")
    (pkg / "d.py").write_text("from . import VALUE\n")  # a name of pkg itself: pkg must have run
    graph = import_graph([pkg])
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": set(), "pkg.d": {"pkg"}}
    (pkg / "a.py").write_text("from . import VALUE\n")
    assert cycles(import_graph([pkg])) == [["pkg", "pkg.a"]]


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


#: The one way from the host-pool path into the gpu wing: a pool made with ``verify=True`` on CUDA runs the
#: page checksum kernel (imported when such a pool is made; plain pools never reach it).
OPT_IN_GPU_EDGES = {
    f"{ROOT}.verification.verify": {f"{ROOT}.gpu", f"{ROOT}.gpu.device", f"{ROOT}.gpu.page_checksum_kernel"}
}


def test_host_pool_path_imports_neither_gpu_nor_tools():
    graph = import_graph(typing=False)  # what runs
    for module, edges in OPT_IN_GPU_EDGES.items():
        assert edges & graph[module], f"{module} no longer imports the gpu wing: drop it from OPT_IN_GPU_EDGES"
        graph[module] = graph[module] - edges
    path = reachable(graph, f"{ROOT}.pool.host_pool") | reachable(graph, f"{ROOT}.plugins.registry")
    wrong = sorted(m for m in path if m.startswith((f"{ROOT}.gpu", f"{ROOT}.tools")))
    assert wrong == [], f"the host-pool path imports {wrong}"
    assert f"{ROOT}.plugins.builtin" in path and f"{ROOT}.plugins.dispatch" in path  # the graph is read, not empty


def test_no_runtime_module_imports_tools():
    graph = import_graph(typing=False)
    for module, edges in graph.items():
        if module.startswith((f"{ROOT}.tools", f"{ROOT}.cli")):
            continue
        wrong = sorted(e for e in edges if e.startswith(f"{ROOT}.tools"))
        assert wrong == [], f"{module} imports {wrong}; only the hicache command (cli) may"
