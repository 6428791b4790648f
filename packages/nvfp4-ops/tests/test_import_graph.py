"""No two nvfp4_ops modules import each other, directly or through a chain.

Every module of the package is parsed with `ast` (nothing is imported) and every import statement
counts, those inside functions (deferred imports) included: a cycle hidden behind a deferred
import is still a cycle. An edge goes to the module that is imported: `from nvfp4_ops.x import y`
and `import nvfp4_ops.x` -> `nvfp4_ops.x`; `from nvfp4_ops import y` -> `nvfp4_ops.y` when y is a
module, else the package `nvfp4_ops` (its `__init__`). Relative imports are resolved the same way.
"""

from __future__ import annotations

import ast
from pathlib import Path

import nvfp4_ops

PACKAGE = "nvfp4_ops"
ROOT = Path(nvfp4_ops.__file__).parent


def module_names(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """{dotted module name: file} of every module under `root` (`__init__` as the package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([package, *parts])] = path
    return out


def _imported(node: ast.AST, here: str, is_package: bool, modules: dict) -> list[str]:
    """The package's modules that one import statement imports (see the module docstring)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        anchor = here.split(".") if is_package else here.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    out = []
    for alias in node.names:
        candidate = f"{base}.{alias.name}"
        if candidate in modules:
            out.append(candidate)
        elif base in modules:
            out.append(base)
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """{module: the package modules it imports anywhere in its source}."""
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(tree):
            edges.update(_imported(node, name, is_package, modules))
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle [a, b, ..., a] of `graph`, or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_the_nvfp4_ops_import_graph_has_no_cycle():
    modules = module_names()
    graph = import_graph(modules)
    assert {"nvfp4_ops.dot", "nvfp4_ops.backends", "nvfp4_ops.probe"} <= set(graph)
    assert "nvfp4_ops.probe" in graph["nvfp4_ops.backends"]  # the edges are really read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in nvfp4_ops: " + " -> ".join(cycle)


def test_a_deferred_import_closing_a_circle_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import c\n    return c\n")
    (pkg / "c.py").write_text("import math\nfrom . import a\n")
    graph = import_graph(module_names(pkg, "pkg"))
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
