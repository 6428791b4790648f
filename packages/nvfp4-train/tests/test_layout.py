"""nvfp4_train's layout: subpackages on floors, imports only downwards, no module import circles.

Read from the sources with `ast` (every import: module level, inside functions, and under
`TYPE_CHECKING`), so a deferred import cannot hide an upward dependency. The floors are the
ones docs/design.md shows; a new subpackage or top-level module must be given one here.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import nvfp4_train

PACKAGE = Path(nvfp4_train.__file__).parent

FLOORS = (
    ("errors", "tree_paths", "mesh_axes"),
    ("data", "model", "tasks"),
    ("precision", "mesh", "optim"),
    ("checkpoint", "observe"),
    ("config",),
    ("training",),
    ("prepare_cli", "lm_eval_model"),
    ("cli", "__init__"),
    ("__main__",),
)
"""Units (a subpackage, or a module directly in nvfp4_train) by floor, lowest first. A module may
import its own unit and the units of lower floors; units of one floor never import each other."""

FLOOR = {unit: floor for floor, units in enumerate(FLOORS) for unit in units}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    relative = Path(*name.split(".")[1:])
    return (PACKAGE / relative).with_suffix(".py").is_file() or (PACKAGE / relative).is_dir()


def _imports(path: Path) -> set[str]:
    """The nvfp4_train modules `path` imports (a name imported from a package counts as that
    package's submodule when one of that name exists)."""
    found = set()
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path.parent)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "nvfp4_train"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))  # fmt: skip
            if base.split(".")[0] != "nvfp4_train":
                continue
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}")}
    return found


def _unit(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_unit_has_a_floor():
    units = {_unit(m) for m in _graph()}
    assert units - FLOOR.keys() == set(), "give these units a floor in FLOORS (docs/design.md)"
    assert FLOOR.keys() - units == set(), "FLOORS names units that do not exist"


def test_imports_only_go_down():
    upward = []
    for module, imported in _graph().items():
        mine = _unit(module)
        for other in imported:
            theirs = _unit(other)
            if theirs != mine and FLOOR[theirs] >= FLOOR[mine]:
                upward.append(f"{module} (floor {FLOOR[mine]}) imports {other} "
                              f"(floor {FLOOR[theirs]})")  # fmt: skip
    assert upward == []


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (a list of modules, first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt == node or nxt not in graph:
                continue
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_module_imports_itself_through_others():
    graph = {m: {i for i in imported if i != m} for m, imported in _graph().items()}
    # a package's __init__ importing its own submodules is a re-export, not a circle
    for module, imported in graph.items():
        graph[module] = {i for i in imported if not module.startswith(f"{i}.")}
    assert _cycle(graph) is None


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b"}, "b": {"b", "c"}, "c": {"b"}}, ["b", "c", "b"]),
    ],
)
def test_cycle_finder(graph, expected):
    assert _cycle(graph) == expected


def test_public_names_come_from_their_modules():
    for name in nvfp4_train.__all__:
        value = getattr(nvfp4_train, name)
        assert getattr(importlib.import_module(nvfp4_train._EXPORTS[name]), name) is value
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        nvfp4_train.nope  # noqa: B018


def test_import_loads_no_jax():
    """`import nvfp4_train` is cheap: the public names load their modules when first used."""
    code = "import sys, nvfp4_train; print(sorted(m for m in sys.modules if m.startswith(('jax', 'nvfp4_train.'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
