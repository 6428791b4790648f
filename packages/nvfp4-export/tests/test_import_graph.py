"""No two nvfp4_export modules import each other, directly or around a longer circle.

Every import statement counts, wherever it is: at the top, inside a function (a deferred import),
under `if TYPE_CHECKING:`. A name two modules both need belongs to the module that owns its
concept (docs/design.md), not to an import hidden inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import nvfp4_export

PACKAGE = "nvfp4_export"
SOURCE = Path(nvfp4_export.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__") or "__init__"


def _imported(node: ast.AST, here: str, modules: set[str]) -> set[str]:
    """The package's modules one import node names ("__init__" for the package itself)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: resolve against this module's package
            package = here.split(".")[: -node.level] if here != "__init__" else []
            base = ".".join([PACKAGE, *package, *([base] if base else [])])
        names = [f"{base}.{a.name}" for a in node.names] + [base]
    else:
        return set()
    found = set()
    for name in names:
        if name != PACKAGE and not name.startswith(PACKAGE + "."):
            continue
        inner = name[len(PACKAGE) + 1 :]
        if inner in modules:
            found.add(inner)
        elif not inner or inner.rsplit(".", 1)[0] not in modules:
            found.add("__init__")  # `from nvfp4_export import name`: runs the package's __init__
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (every import statement, anywhere in the file)."""
    files = {_module_name(p): p for p in SOURCE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges = set()
        for node in ast.walk(tree):
            edges |= _imported(node, name, set(files))
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a -> b -> ... -> a) per strongly connected group of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle(graph, group) for group in groups]


def _circle(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """A path from the group's first module back to itself inside the group (breadth first)."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    return group


def test_the_checker_finds_a_circle_through_a_deferred_import():
    # the checker itself can fail: a function-level import closing a circle is reported
    code = "def f():\n    from nvfp4_export.b import x\n"
    tree = ast.parse(code)
    modules = {"a", "b", "c"}
    edges = set().union(*(_imported(n, "a", modules) for n in ast.walk(tree)))
    assert edges == {"b"}
    graph = {"a": edges, "b": {"c"}, "c": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"b"}}) == []


def test_no_module_of_nvfp4_export_imports_itself_around_a_circle():
    graph = import_graph()
    assert {"checkpoint", "hf_export", "verify"} <= set(graph)  # the walk found the modules
    assert "model_spec" in graph["hf_export"]
    found = cycles(graph)
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)
