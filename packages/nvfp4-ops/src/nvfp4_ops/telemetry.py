"""Quantization statistics per GEMM operand: is the quantization of this tensor healthy?

`operand_stats` quantizes one operand exactly as `quantize_operand` does and reports four float32
scalars (`STATS`); `gemm_operand_stats` does it for every quantized operand of the three GEMMs of
y = x @ w, prepared as `nvfp4_ops.qdot` prepares them (padding, transposes, RHT, SR keys): both
read the operands from `nvfp4_ops.gemm_table`. The per-format counting is in
`nvfp4_ops.formats.FORMAT_OPS` (`FormatOps.counts`).

Denominators count NONZERO things only, so zero padding (and exact zeros in the data, e.g. after a
ReLU) change no statistic:
- underflow: nonzero blocks (blocks, or 16x16 tiles, holding at least one nonzero element) whose
  decoded block scale is 0, over all nonzero blocks. FP8 (per-tensor): nonzero elements that
  decode to 0, over nonzero elements. A zero block is never underflow.
- saturation: nonzero elements whose pre-clip scaled magnitude (the value the quantizer clips to
  +-max) exceeds the format's max, over nonzero elements. "Exceeds" means by more than 2^-20
  relative: the float32 scale arithmetic alone puts a block's (or FP8 tensor's) max up to a few
  ulps above the max even when the scale is exact, and that is not saturation.
- rel_error: ||x - dequantize(quantize(x))||_2 / ||x||_2 in float32, 0 for an all-zero x.
- amax: max|x| of the operand as quantized (after the rotation for the Wgrad roles).
A fraction with an empty denominator is 0. Non-finite input gives non-finite amax/rel_error.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from nvfp4_ops.canonical import pad_to
from nvfp4_ops.formats import E2M1_MAX, FORMAT_OPS, SATURATION_SLACK
from nvfp4_ops.fp8 import fp8_amax
from nvfp4_ops.gemm_table import operand_view, quantizations, require_key, split_keys
from nvfp4_ops.quantizers import dequantize_operand, quantize_operand
from nvfp4_ops.recipe import Recipe, TensorQuant

__all__ = [
    "E2M1_MAX",
    "SATURATION_SLACK",
    "STATS",
    "gemm_operand_stats",
    "gemm_operands",
    "operand_stats",
]

STATS = ("amax", "underflow", "saturation", "rel_error")
"""The statistics `operand_stats` returns, in this order."""


def _fraction(count: jax.Array, total: jax.Array) -> jax.Array:
    """count / total as float32; 0 when total is 0."""
    total = total.astype(jnp.float32)
    return jnp.where(total > 0, count.astype(jnp.float32) / jnp.maximum(total, 1.0), 0.0)


def _rel_error(x32: jax.Array, xq: jax.Array) -> jax.Array:
    norm = jnp.linalg.norm(x32.reshape(-1))
    err = jnp.linalg.norm((x32 - xq).reshape(-1))
    return jnp.where(norm > 0, err / jnp.where(norm > 0, norm, 1.0), 0.0).astype(jnp.float32)


def _aligned(x: jax.Array, tq: TensorQuant) -> jax.Array:
    """`x` zero-padded so that `quantize_operand` accepts it (last axis, and rows for 16x16)."""
    multiples = [1] * x.ndim
    multiples[-1] = tq.block_size
    if tq.is_2d:
        multiples[-2] = 16
    return pad_to(x, tuple(multiples))


@functools.partial(jax.jit, static_argnames=("tq",))
def operand_stats(
    x: jax.Array, tq: TensorQuant, key: jax.Array | None = None
) -> dict[str, jax.Array]:
    """Quantization statistics (`STATS`, float32 scalars) of `x` quantized per `tq`.

    Blocks run along the last axis (16x16 tiles over the last two axes), exactly as
    `quantize_operand(x, tq, key)` quantizes it; an `x` whose last axis (or rows, for 16x16) is
    not a multiple of the block is zero-padded first, which changes no statistic. See the module
    docstring for the definitions and denominators. A "bf16" `tq` gives amax and three zeros.

    Args:
      x: the operand, contraction axis last (at least 2-D for 16x16 tiles).
      tq: the role's settings (static under `jax.jit`).
      key: PRNG key, required for stochastic rounding (the same draw as `quantize_operand`).

    Example:
      >>> s = operand_stats(jnp.ones((2, 16)), TensorQuant("nvfp4", (1, 16)))
      >>> round(float(s["rel_error"]), 6), float(s["saturation"])
      (0.0, 0.0)

    (Ones decode to exactly 1.0, yet `rel_error` can read ~2e-8 here: inside this one compiled
    program XLA:CPU may contract `x - q * scale` into a fused multiply-add, which subtracts the
    unrounded product. The decoded values themselves, `dequantize_operand`, are exact.)
    """
    if not isinstance(tq, TensorQuant):
        raise TypeError(f"tq must be a TensorQuant, got {type(tq).__name__}")
    if tq.is_2d and x.ndim < 2:
        raise ValueError(f"16x16 tiles need x with at least 2 dimensions, got shape {x.shape}")
    with jax.named_scope(f"nvfp4/telemetry_{tq.fmt}"):
        x32 = x.astype(jnp.float32)
        amax = fp8_amax(x32)
        if not tq.quantized:
            zero = jnp.float32(0.0)
            return {"amax": amax, "underflow": zero, "saturation": zero, "rel_error": zero}
        x = _aligned(x, tq)
        x32 = x.astype(jnp.float32)
        q = quantize_operand(x, tq, key)
        xq = dequantize_operand(q, tq, jnp.float32)
        underflow, saturated, blocks, elements = FORMAT_OPS[tq.fmt].counts(x32, q, xq, tq)
        return {
            "amax": amax,
            "underflow": _fraction(underflow, blocks),
            "saturation": _fraction(saturated, elements),
            "rel_error": _rel_error(x32, xq),
        }


def _check_shapes(x: jax.Array, w: jax.Array, dy: jax.Array) -> None:
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D [K, N], got shape {w.shape}")
    if x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"x must be [..., K] with K = w.shape[0] = {w.shape[0]}, got {x.shape}")
    if dy.shape != (*x.shape[:-1], w.shape[1]):
        raise ValueError(
            f"dy must be [..., N] = {(*x.shape[:-1], w.shape[1])} (x's leading dims, "
            f"N = w.shape[1]), got {dy.shape}"
        )


def gemm_operands(
    x: jax.Array, w: jax.Array, dy: jax.Array, recipe: Recipe
) -> dict[str, tuple[jax.Array, TensorQuant, str]]:
    """The quantized operands of y = x @ w's three GEMMs as `qdot` quantizes them, by role.

    Read from `nvfp4_ops.gemm_table.quantizations(recipe)`, the table `qdot` runs.

    Each value is (operand [1, rows, contraction], its TensorQuant, the `qdot.KEY_SLOTS` slot of
    its SR key). Tokens are x's leading dims flattened (M); M, K, N are zero-padded to
    `recipe.alignment` as `dot_general` does. With `recipe.bf16_fprop` there are no Fprop roles;
    a 2D/per-tensor W quantized for Dgrad is then "dgrad_w" (drawn, as in `qdot`, with the
    "fprop_w" key). dy is taken in x's dtype, as `qdot` does (`GemmConfig.grad_dtype`). Roles whose TensorQuant is "bf16" are left out.
    """
    _check_shapes(x, w, dy)
    k, n = w.shape
    m = math.prod(x.shape[:-1])
    a = recipe.alignment
    tensors = {
        "x": pad_to(x.reshape(1, m, k), (1, a, a)),
        "w": pad_to(w.reshape(1, k, n), (1, a, a)),
        "dy": pad_to(dy.reshape(1, m, n).astype(x.dtype), (1, a, a)),
    }
    return {
        role: (operand_view(op, tensors[op.spec.tensor]), op.tq, op.key_slot)
        for role, op in quantizations(recipe).items()
        if op.tq.quantized
    }


@functools.partial(jax.jit, static_argnames=("recipe",))
def gemm_operand_stats(
    x: jax.Array, w: jax.Array, dy: jax.Array, recipe: Recipe, key: jax.Array | None = None
) -> dict[str, dict[str, jax.Array]]:
    """`operand_stats` of every quantized operand of y = x @ w's Fprop, Dgrad and Wgrad GEMMs.

    Roles (named like `qdot.KEY_SLOTS`): "fprop_x" (x along K), "fprop_w" (w^T along K, 16x16
    tiles if the recipe says so), "dgrad_dy" (dy along N), "dgrad_w" (only when W is
    re-quantized for Dgrad, i.e. 1D weights), "wgrad_x" and "wgrad_dy" (x^T and dy^T along the
    tokens, after the random Hadamard transform when `recipe.wgrad_hadamard`), each with its key
    from `qdot.split_keys(key)`. "bf16" roles are omitted (a "bf16" recipe gives {}).

    Args:
      x: activations [..., K] (leading dims are the tokens).
      w: weight [K, N].
      dy: gradient of y, [..., N] with x's leading dims.
      recipe: the `Recipe` (static under `jax.jit`).
      key: the key passed to `dot_general` (required when `recipe.needs_key`).

    Example:
      >>> x, w, dy = jnp.ones((4, 32)), jnp.ones((32, 16)), jnp.ones((4, 16))
      >>> from nvfp4_ops import get_recipe
      >>> sorted(gemm_operand_stats(x, w, dy, get_recipe("nvfp4-no-sr")))
      ['dgrad_dy', 'fprop_w', 'fprop_x', 'wgrad_dy', 'wgrad_x']
    """
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a Recipe, got {type(recipe).__name__}")
    require_key(key, recipe)
    keys = split_keys(key)
    operands = gemm_operands(x, w, dy, recipe)
    return {role: operand_stats(op, tq, keys[slot]) for role, (op, tq, slot) in operands.items()}
