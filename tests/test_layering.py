"""Layering of the project's modules: no import circles, and the client never loads the broker.

The import graph is built statically (ast), from every ``import`` in ``twophase/``,
``coordinator/`` and ``sinks/``, including imports inside functions (a lazy import hides a
circle, it does not remove it); only imports under ``if TYPE_CHECKING:`` are left out, as they
never run.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("twophase", "coordinator", "sinks")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _runtime_imports(tree: ast.AST):
    """Import nodes that run, skipping ``if TYPE_CHECKING:`` bodies."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in _runtime_imports_of(child))
            continue
        yield from _runtime_imports_of(node)


def _runtime_imports_of(node: ast.AST):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _runtime_imports(node)


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                # "from p import x" imports the module p.x if there is one, else a name of p.
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                while target and target not in modules:  # "import a.b.c" of a non-module: its package
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a list of modules, the first repeated at the end) per strongly connected component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan; the graph is small enough for recursion
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_circle_in(graph, component) for component in components]


def _circle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest circle through the component's first module (breadth-first)."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph[node] & component):
            if nxt == start:
                return paths[node] + [start]
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                queue.append(nxt)
    raise AssertionError("a strongly connected component without a circle")


def test_no_import_circles():
    found = cycles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_cycle_finder_finds_a_lazy_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    tree = ast.parse("def f():\n    from . import b\nif TYPE_CHECKING:\n    import c\n")
    assert [type(n).__name__ for n in _runtime_imports(tree)] == ["ImportFrom"]


def test_client_and_broker_share_only_the_wire_package():
    graph = import_graph()
    for side, other in (("twophase.client", "twophase.broker"), ("twophase.broker", "twophase.client")):
        for module, targets in graph.items():
            if module == side or module.startswith(side + "."):
                crossing = {t for t in targets if t == other or t.startswith(other + ".")}
                assert not crossing, f"{module} imports {sorted(crossing)}"
    wire = {m: t for m, t in graph.items() if m.startswith("twophase.wire")}
    assert all(t.startswith("twophase.wire") for targets in wire.values() for t in targets), wire


def test_loading_the_log_sink_loads_no_broker_module():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    code = "import sinks.log, sys; print([m for m in sys.modules if m.startswith('twophase.broker')])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
