"""What a GPU would run for a grouped call: its CUDA StableHLO, lowered here on CPU.

`jax.export(..., platforms=["cuda"])` of `ragged_dot`'s forward and both gradients on the backends
a GPU runs ("xla", "emulated"), read as text: no `chlo.ragged_dot` (XLA:GPU rewrites one into a
masked dense dot over every expert unless its output is BF16/F16 and an experimental cuDNN
fusion is on) and no `while` / `case` / `if` (XLA:GPU copies a data-dependent predicate to the
host on every trip). The "xla" GEMMs are batched BF16 dots with FP32 results; an operand that is
not exact in BF16 (MXFP8) sends its GEMM to an FP32 dot, said in one log line. Lowering only:
nothing is compiled.
"""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import pytest

import nvfp4_ops
from nvfp4_ops import backends
from nvfp4_ops.grouped import gemm

T, K, N, E = 48, 32, 32, 4
CONTROL_FLOW = re.compile(r"\b(?:stablehlo|chlo|mhlo)\.(?:while|case|if|ragged_dot)\b")
DOT = re.compile(
    r"stablehlo\.dot_general .*?: \(tensor<([^>]*)>, tensor<([^>]*)>\) -> tensor<([^>]*)>"
)


@pytest.fixture(autouse=True)
def _available(monkeypatch):
    """The backends count as available (this is about lowering, not about this host)."""
    monkeypatch.setattr(backends, "backend_capability", lambda name: (True, "lowering only"))


def _cuda_text(backend: str, recipe: str) -> str:
    def step(x, w, group_sizes, key, dy):
        def f(a, b):
            return nvfp4_ops.ragged_dot(a, b, group_sizes, recipe=recipe, key=key, backend=backend)

        y, pullback = jax.vjp(f, x, w)
        return (y, *pullback(dy))

    args = (
        jax.ShapeDtypeStruct((T, K), jnp.bfloat16),
        jax.ShapeDtypeStruct((E, K, N), jnp.bfloat16),
        jax.ShapeDtypeStruct((E,), jnp.int32),
        jax.random.key(0),
        jax.ShapeDtypeStruct((T, N), jnp.bfloat16),
    )
    return jax.export.export(jax.jit(step), platforms=["cuda"])(*args).mlir_module()


def _dots(text: str) -> list[tuple[str, str, str]]:
    """(lhs, rhs, result) element types of every dot_general, e.g. ("bf16", "bf16", "f32")."""
    return [tuple(t.split("x")[-1] for t in m) for m in DOT.findall(text)]


@pytest.mark.parametrize(
    "backend, recipe", [("xla", "nvfp4"), ("emulated", "nvfp4"), ("xla", "bf16")]
)
def test_the_cuda_lowering_has_no_ragged_dot_and_no_data_dependent_control_flow(backend, recipe):
    text = _cuda_text(backend, recipe)
    assert sorted(set(CONTROL_FLOW.findall(text))) == []
    dots = _dots(text)
    assert dots, "no dot_general found: the pattern no longer matches jax's StableHLO"
    if backend == "xla" and recipe == "nvfp4":
        gemms = [d for d in dots if d != ("f32", "f32", "f32")]  # the RHT's 16x16 products
        assert len(gemms) >= 3 and set(gemms) == {("bf16", "bf16", "f32")}, dots


def test_an_operand_inexact_in_bf16_runs_an_fp32_dot_said_once(caplog):
    gemm._fp32_note.cache_clear()
    with caplog.at_level(logging.INFO, logger="nvfp4_ops"):
        text = _cuda_text("xla", "mxfp8")
        _cuda_text("xla", "mxfp8")  # a second trace says nothing new
    lines = [r.getMessage() for r in caplog.records if "FP32 dot" in r.getMessage()]
    assert len(lines) == 3, lines  # Fprop, Dgrad, Wgrad: once each, naming their operands
    for line, operands in zip(lines, ("fprop_x", "dgrad_dy", "wgrad_x"), strict=True):
        assert f"{operands} holds float8_e4m3fn x float8_e8m0fnu values (mxfp8)" in line
    assert set(_dots(text)) <= {("f32", "f32", "f32")}
    assert sorted(set(CONTROL_FLOW.findall(text))) == []
