"""The core's import graph: no cycle (function-local imports included), and wings that stay apart.

Read from the source with ``ast``, so that a late import inside a function counts as much as one at
the top of a file; ``if TYPE_CHECKING:`` blocks are left out (they never run).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import hicache_core

PACKAGE = Path(hicache_core.__file__).parent
ROOT = "hicache_core"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool, modules: set[str]) -> set[str]:
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
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
            found.add(target)
            for alias in node.names:  # ``from . import uva`` imports the submodule
                if f"{target}.{alias.name}" in modules:
                    found.add(f"{target}.{alias.name}")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        name = _module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        targets = _imports(tree, name, path.name == "__init__.py", modules)
        edges = set()
        for target in targets:
            # importing a.b.c runs a, a.b and a.b.c: each is an edge
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in modules and prefix != name:
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
    assert found == [], f"import cycles in hicache_core (function-local imports count): {found}"


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


#: The one way from the host-pool path into the gpu wing: a pool made with ``verify=True`` on CUDA runs the
#: page checksum kernel (imported when such a pool is made; plain pools never reach it).
OPT_IN_GPU_EDGES = {f"{ROOT}.verify": {f"{ROOT}.gpu", f"{ROOT}.gpu.device", f"{ROOT}.gpu.page_checksum_kernel"}}


def test_host_pool_path_imports_neither_gpu_nor_tools():
    graph = import_graph()
    for module, edges in OPT_IN_GPU_EDGES.items():
        assert edges & graph[module], f"{module} no longer imports the gpu wing: drop it from OPT_IN_GPU_EDGES"
        graph[module] = graph[module] - edges
    path = reachable(graph, f"{ROOT}.host_pool") | reachable(graph, f"{ROOT}.registry")
    wrong = sorted(m for m in path if m.startswith((f"{ROOT}.gpu", f"{ROOT}.tools")))
    assert wrong == [], f"the host-pool path imports {wrong}"
    assert f"{ROOT}.builtin" in path and f"{ROOT}.dispatch" in path  # the graph is read, not empty


def test_no_runtime_module_imports_tools():
    graph = import_graph()
    for module, edges in graph.items():
        if module.startswith((f"{ROOT}.tools", f"{ROOT}.cli")):
            continue
        wrong = sorted(e for e in edges if e.startswith(f"{ROOT}.tools"))
        assert wrong == [], f"{module} imports {wrong}; only the hicache command (cli) may"
