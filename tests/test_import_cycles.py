"""The library's modules import each other without a cycle: a layered package, not a knot.

Every ``import`` and ``from ... import`` statement of a module counts, at module level or
inside a function (a function-level import is a cycle deferred to run time, not removed),
and under ``if TYPE_CHECKING:`` too: a type named across layers is a dependency as well.
``from a.b import c`` counts as an import of the module ``a.b.c`` when that is a module, else of ``a.b``. A package's
``__init__`` that Python runs on the way to a submodule does not count: it only re-exports,
and every module would otherwise sit in a cycle through ``lightning_muon/__init__.py``.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_muon"


def _module_names() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, ``if TYPE_CHECKING:`` blocks included."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _edges(name: str, source: str, is_package: bool, modules: set[str]) -> set[str]:
    """The library modules that the module ``name`` (its ``source``) imports."""
    package = name if is_package else name.rsplit(".", 1)[0]
    targets: set[str] = set()
    for node in _import_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            base = f"{anchor}.{base}" if base else anchor
        for alias in node.names:
            targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {t for t in targets if t in modules and t != name}


def _graph() -> dict[str, set[str]]:
    names = _module_names()
    return {
        name: _edges(name, path.read_text(), path.name == "__init__.py", set(names)) for name, path in names.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path that returns to its start) per strongly connected component of 2+ modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_path_through(graph, set(c)) for c in components]


def _path_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A cycle inside ``component``, from its first module back to it (breadth-first)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in {sorted(component)}")


def test_every_module_imports():
    names = _module_names()
    assert len(names) > 30  # the walk found the library
    for name in names:
        importlib.import_module(name)


def test_no_import_cycle_among_library_modules():
    cycles = _cycles(_graph())
    assert cycles == [], "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_cycles_and_reads_every_kind_of_import():
    """The check above can fail: a made-up graph with two cycles and a chain gives both cycles."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d", "a"}, "f": {"a"}}
    assert sorted(_cycles(graph)) == [["a", "b", "c", "a"], ["d", "e", "d"]]
    source = (
        "from typing import TYPE_CHECKING\n"
        "import lightning_muon.routing\n"
        "from lightning_muon.distributed import comm\n"
        "from .newton_schulz import orthogonalize\n"
        "if TYPE_CHECKING:\n    from lightning_muon.config import MuonConfig\n"
        "def f():\n    from lightning_muon.schedules import LRSchedule\n"
    )
    assert _edges("lightning_muon.probe", source, False, set(_module_names())) == {
        "lightning_muon.routing",
        "lightning_muon.distributed.comm",
        "lightning_muon.newton_schulz",
        "lightning_muon.config",  # TYPE_CHECKING counts
        "lightning_muon.schedules",  # function level counts
    }
