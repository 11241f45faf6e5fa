"""The house stays as drawn (STYLE.md 17, "layers only point down"): no module of qag/ or shm/ imports one that
imports it back, and only the process side (qag/server/) and the demo reach into the HTTP layer (qag/http/).

Imports are read from the source with ast, not by importing: every `import` and `from ... import` counts,
at the top of a module, inside a function, or under `if TYPE_CHECKING:` (a type-only import back is still a
circle in the drawing). `from pkg import name` is an edge to pkg.name when that is a module, else to pkg.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("qag", "shm")
# Who may import qag.http: the process side that serves it, and the demo that runs it.
HTTP_IMPORTERS = ("qag.server", "qag.demo")


def module_files() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _target(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours that `name` (a dotted module path) loads, if any: the longest known prefix."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """{imported module of ours: first line} for one module, relative imports resolved."""
    is_package = path.name == "__init__.py"
    found: dict[str, int] = {}

    def add(name: str | None, line: int) -> None:
        if name is not None and name != module:
            found.setdefault(name, line)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_target(alias.name, modules), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                add(sub if sub in modules else _target(source, modules), node.lineno)
    return found


@functools.cache
def import_graph() -> dict[str, dict[str, int]]:
    modules = module_files()
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One concrete circle per knot (strongly connected component of more than one module)."""
    return [_circle_in(set(c), graph) for c in knots(graph)]


def knots(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return components


def _circle_in(component: set[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """The shortest circle through the component's first module (breadth first inside the component)."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for child in sorted(graph[node]):
            if child == start:
                return paths[node] + [start]
            if child in component and child not in paths:
                paths[child] = paths[node] + [child]
                queue.append(child)
    raise AssertionError(f"no circle in {sorted(component)}")  # pragma: no cover - Tarjan found one


def _describe(circle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(circle, circle[1:])) + f" -> {circle[-1]}"


def test_the_graph_sees_every_kind_of_import():
    """The reader itself: relative, function-level and TYPE_CHECKING imports all make edges (else the
    circle test below would pass by not looking)."""
    graph = import_graph()
    assert "qag.http.app" in graph and "shm.segment" in graph and "qag" in graph
    assert "shm.layout" in graph["shm.segment"]  # from . import layout as L
    assert "shm.ring" in graph["shm.segment"]  # from .ring import Ring
    assert "qag.runstore" in graph["qag.server.arbiter"]  # inside a method: from qag.runstore import open_store
    assert "qag.governance.errors" in graph["qag.governance.analysis"]  # from .errors import GovernanceError
    assert "shm" in graph["qag.server.changes"]  # import shm, inside main()
    assert cycles({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    found = knots(graph)
    assert not found, "import circles (move the shared name to the module lower in the layering):\n" + "\n".join(
        f"{_describe(_circle_in(set(k), graph), graph)}   [the knot: {', '.join(k)}]" for k in found)


def test_only_the_process_side_and_the_demo_import_the_http_layer():
    graph = import_graph()
    bad = sorted(f"{m} imports {t} (line {line})" for m, targets in graph.items()
                 if not (m == "qag.http" or m.startswith("qag.http.") or m.startswith(HTTP_IMPORTERS))
                 for t, line in targets.items() if t == "qag.http" or t.startswith("qag.http."))
    assert not bad, "below qag/http, nothing imports it:\n" + "\n".join(bad)


def test_http_never_imports_the_process_side():
    """qag/server serves qag/http (the worker builds the app): the arrow runs one way."""
    bad = [(src, dst) for src, dsts in import_graph().items() for dst in dsts
           if src.startswith("qag.http") and dst.startswith("qag.server")]
    assert not bad, bad
