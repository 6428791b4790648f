"""The size bar on every package's `src/`: no class over 150 lines, no file over 400, no function
over 60.

A definition's size is `end_lineno - lineno + 1` of its ast node: from its `def` or `class` line
to its last line, docstring included (decorator lines above it are not counted). A failure lists
every offender with its size. Read from the sources as text, so it needs no package installed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[1] / "packages"
MAX_FILE_LINES = 400
MAX_CLASS_LINES = 150
MAX_FUNCTION_LINES = 60


def _offenders(src: Path) -> list[str]:
    """'path: kind name (N lines, limit L)' for each file, class and function over the bar."""
    found = []
    for path in sorted(src.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        relative = path.relative_to(src).as_posix()
        lines = len(source.splitlines())
        if lines > MAX_FILE_LINES:
            found.append(f"{relative}: file ({lines} lines, limit {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(source, filename=str(path))):
            if isinstance(node, ast.ClassDef):
                kind, limit = "class", MAX_CLASS_LINES
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                kind, limit = "function", MAX_FUNCTION_LINES
            else:
                continue
            size = node.end_lineno - node.lineno + 1
            if size > limit:
                found.append(f"{relative}: {kind} {node.name} ({size} lines, limit {limit})")
    return found


@pytest.mark.parametrize("package", ["nvfp4-format", "nvfp4-ops", "nvfp4-train", "nvfp4-export"])
def test_no_file_class_or_function_over_the_size_bar(package):
    src = PACKAGES / package / "src"
    assert list(src.rglob("*.py")), f"no Python sources under {src}"
    offenders = _offenders(src)
    assert not offenders, f"{package} over the size bar:\n  " + "\n  ".join(offenders)


def test_an_offender_is_named_with_its_size(tmp_path):
    (tmp_path / "big.py").write_text("def f():\n" + "    x = 1\n" * 61)
    assert _offenders(tmp_path) == ["big.py: function f (62 lines, limit 60)"]
