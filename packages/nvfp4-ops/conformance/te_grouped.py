"""Whether a TransformerEngine release's JAX grouped GEMM handles NVFP4 (parsed, not imported).

`nvfp4_ops.ragged_dot` refuses `backend="te"` (`te_backend.TE_GROUPED_UNSUPPORTED`) because TE's
JAX grouped path - `grouped_dense`, its quantizer `GroupedQuantizer`, `grouped_quantize`, the
grouped tensor `GroupedScaledTensor1x` and `grouped_gemm` - has no NVFP4 path. In the released
sources that shows as: none of those definitions names an NVFP4 scaling mode or anything of the
RHT (identifiers `NVFP4_1D_SCALING`, `is_nvfp4_scaling`, `*rht*`, ...), and the grouped tensor
passes `has_rht_applied=False` as a literal. `grouped_nvfp4_signs(root)` lists every place
where that no longer holds; a definition that is gone is listed too (renamed code must be read
again, not silently pass). An empty list: TE's grouped GEMM still takes no NVFP4.
"""

from __future__ import annotations

import ast
from pathlib import Path

GROUPED_DEFINITIONS = {
    "transformer_engine/jax/dense.py": (
        "grouped_dense",
        "_grouped_dense_fwd_rule",
        "_grouped_dense_bwd_rule",
    ),
    "transformer_engine/jax/cpp_extensions/gemm.py": ("GroupedGemmPrimitive", "grouped_gemm"),
    "transformer_engine/jax/cpp_extensions/quantization.py": (
        "GroupedQuantizePrimitive",
        "grouped_quantize",
    ),
    "transformer_engine/jax/quantize/quantizer.py": ("GroupedQuantizer",),
    "transformer_engine/jax/quantize/tensor.py": ("GroupedScaledTensor1x",),
}
"""{file in the wheel: the top-level definitions of TE's JAX grouped path read there}."""

RHT_LITERAL = ("transformer_engine/jax/quantize/tensor.py", "GroupedScaledTensor1x")
"""Where `has_rht_applied=False` must be passed as a literal (TE's TODO: "Handle RHT for grouped
quantization once grouped quantization supports NVFP4")."""


def _nvfp4_identifier(name: str) -> bool:
    lowered = name.lower()
    return "nvfp4" in lowered or "rht" in lowered


def _identifiers(node: ast.AST) -> set[str]:
    """Names and attribute names read anywhere in `node` (not keywords, not strings)."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
    return out


def _rht_literal_false(node: ast.AST) -> bool:
    """Whether every call in `node` passing has_rht_applied passes the constant False (and one
    does)."""
    values = [
        kw.value
        for n in ast.walk(node)
        if isinstance(n, ast.Call)
        for kw in n.keywords
        if kw.arg == "has_rht_applied"
    ]
    return bool(values) and all(isinstance(v, ast.Constant) and v.value is False for v in values)


def grouped_nvfp4_signs(root: Path) -> list[str]:
    """Every sign that the release unpacked at `root` lets its JAX grouped GEMM take NVFP4
    (module docstring); [] when there is none."""
    signs = []
    for relative, names in GROUPED_DEFINITIONS.items():
        path = Path(root) / relative
        if not path.is_file():
            signs.append(f"{relative} is gone: read TE's grouped path again")
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        for name in names:
            if name not in defs:
                signs.append(f"{relative}: {name} is gone: read TE's grouped path again")
                continue
            found = sorted(i for i in _identifiers(defs[name]) if _nvfp4_identifier(i))
            if found:
                signs.append(f"{relative}: {name} now names {', '.join(found)}")
            if (relative, name) == RHT_LITERAL and not _rht_literal_false(defs[name]):
                signs.append(f"{relative}: {name} no longer passes has_rht_applied=False")
    return signs
