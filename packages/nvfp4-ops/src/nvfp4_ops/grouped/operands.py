"""The GEMM operands of a grouped call, each group quantized exactly as its dense call does.

Which tensor is quantized how, in which orientation, rotated or not, with which key slot, and
which quantization Dgrad reuses, is read from `nvfp4_ops.gemm_table` as the dense custom_vjp
reads it; the quantizers are `nvfp4_ops.quantizers`'. Two kinds of operands:

- Weights (`quantize_weights`): w [E, K, N], one group per expert: the dense operand view of
  w[e] ([1, N, K] for Fprop, [1, K, N] for a re-quantized Dgrad W), quantized under `jax.vmap`
  with group e's key. Each expert has its own outer (tensor) scale, as each dense call has.
- Token operands (`quantize_tokens`): x or dY in the padded buffer's tiles [tiles, a, C]
  (`layout.to_tiles`), viewed as the table says: [tiles, a, C] (blocks along C) or transposed and
  rotated [tiles, C, a] (Wgrad: blocks and the RHT along the tokens, inside one tile, so inside
  one group). Every tile is quantized on its own under `jax.vmap` with its GROUP's outer amax
  (`layout.group_max` of the tiles' amaxes; a per-token scale needs none) and its group's random
  numbers (`random_bits.token_uniform`): a block never leaves its tile, so each element gets the
  codes and scales of its group's dense quantization.

The "emulated" GEMMs take them decoded to float32 (`decode_tokens`, `decode_weights`); the "xla"
ones as `ScaledOperand`s (`scaled_tokens`, `scaled_weights`): each element times its block scale,
which is a BF16 number for every format but MXFP8 (`BF16_EXACT`), and the FP32 outer scale of its
row, which the GEMM applies to its FP32 output.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from nvfp4_ops.formats import FORMAT_OPS
from nvfp4_ops.gemm import unit_values
from nvfp4_ops.gemm_table import OperandQuant, operand_view
from nvfp4_ops.grouped.layout import GroupLayout, group_max
from nvfp4_ops.grouped.random_bits import token_uniform
from nvfp4_ops.quantizers import dequantize_operand, quantize_operand, quantize_with


def quantize_weights(op: OperandQuant, w: jax.Array, keys: dict[str, Any]) -> Any:
    """w [E, K, N] viewed, and quantized per expert, as op's dense operand [1, ., .] is."""
    key = keys[op.key_slot]

    def one(w_kn: jax.Array, k: jax.Array | None) -> Any:
        return quantize_operand(operand_view(op, w_kn[None]), op.tq, k)

    if key is None:
        return jax.vmap(functools.partial(one, k=None))(w)
    return jax.vmap(one)(w, key)


def decode_weights(q: Any, op: OperandQuant, transposed: bool = False) -> jax.Array:
    """The float32 [E, P, C] values of `quantize_weights`'s result (swapped to [E, C, P] when
    `transposed`: the Fprop W reused in Dgrad)."""
    values = jax.vmap(lambda v: dequantize_operand(v, op.tq, jnp.float32))(q)[:, 0]
    return jnp.swapaxes(values, -1, -2) if transposed else values


def _tokens_last(op: OperandQuant) -> bool:
    """Whether op's view puts the tokens last (the Wgrad transposes x^T, dY^T)."""
    return op.spec.transposed


def quantize_tokens(
    op: OperandQuant, tiles: jax.Array, layout: GroupLayout, keys: dict[str, Any]
) -> Any:
    """x or dY as tiles [tiles, a, C] viewed (oriented, rotated) and quantized per tile with
    each group's outer amax and random numbers (module docstring). "bf16" roles: the view."""
    view = operand_view(op, tiles)
    tq = op.tq
    if not tq.quantized:
        return view
    amax = _group_amax(op, view, layout)
    uniform = None
    if tq.rounding == "stochastic":
        uniform = token_uniform(keys[op.key_slot], layout, view.shape, _tokens_last(op))
    quantize = functools.partial(quantize_with, tq=tq)
    args = {"x": view, "uniform": uniform, "amax": amax}
    batched = {name: v for name, v in args.items() if v is not None}
    fixed = {name: v for name, v in args.items() if v is None}
    return jax.vmap(lambda kw: quantize(**kw, **fixed))(batched)


def _group_amax(op: OperandQuant, view: jax.Array, layout: GroupLayout) -> jax.Array | None:
    """Each tile's outer amax as its group's dense call takes it, or None where the tile's own
    is the dense one (a per-token scale of x or dY; MX formats and "bf16" have none)."""
    tq = op.tq
    if tq.outer_scale == "row" and not _tokens_last(op):
        return None  # one scale per token: reduced over the features only
    outer_amax = FORMAT_OPS[tq.fmt].outer_amax
    per_tile = jax.vmap(lambda t: outer_amax(t, tq))(view)
    return None if per_tile is None else group_max(per_tile, layout)


def decode_tokens(q: Any, op: OperandQuant) -> jax.Array:
    """The float32 tiles of `quantize_tokens`'s result ([tiles, a, C] or [tiles, C, a])."""
    return jax.vmap(lambda v: dequantize_operand(v, op.tq, jnp.float32))(q)


BF16_EXACT = frozenset(
    (jnp.dtype(elements), None if scales is None else jnp.dtype(scales))
    for elements, scales in (
        (jnp.float4_e2m1fn, jnp.float8_e4m3fn),  # NVFP4: 2 + 4 significant bits, >= 2^-10
        (jnp.float4_e2m1fn, jnp.float8_e8m0fnu),  # MXFP4: 2 bits, 2^-128 .. 1.5 2^127
        (jnp.float8_e4m3fn, None),  # FP8 elements, their tensor scale apart
        (jnp.float8_e5m2, None),
        (jnp.bfloat16, None),  # an unquantized BF16 operand
    )
)
"""(element dtype, block-scale dtype) pairs whose products are BF16 numbers, exactly: at most 8
significant bits, within BF16's range (subnormals from 2^-133). Not MXFP8 (E4M3 x E8M0 reaches
2^-136), nor unquantized FP32 / FP16 values."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScaledOperand:
    """A GEMM operand as the "xla" grouped GEMMs take it: `values` times `scale`, row by row.

    Attributes:
      values: [..., P, C], each element times its block scale (no outer scale): bfloat16, which
        holds it exactly (`BF16_EXACT`), or float32 where it might not.
      scale: float32 [..., P, 1], each row's outer (tensor or per-row) decode scale.
      inexact: None, or why `values` are float32 (static).
    """

    values: jax.Array
    scale: jax.Array
    inexact: str | None = dataclasses.field(default=None, metadata={"static": True})


def _scaled(q: Any, op: OperandQuant) -> ScaledOperand:
    """`q` [n, ...] (quantized per tile or per expert under `vmap`) as a `ScaledOperand`."""
    operand = functools.partial(FORMAT_OPS[op.tq.fmt].gemm_operand, transposed=False)
    vals, scales, outer = jax.vmap(operand)(q)
    pair = (jnp.dtype(vals.dtype), None if scales is None else jnp.dtype(scales.dtype))
    unit = unit_values(vals, scales)
    outer = outer.reshape(outer.shape + (1,) * (vals.ndim - outer.ndim))
    scale = jnp.broadcast_to(outer, vals.shape[:-1] + (1,)).astype(jnp.float32)
    if pair in BF16_EXACT:
        return ScaledOperand(unit.astype(jnp.bfloat16), scale)
    kinds = " x ".join(str(d) for d in pair if d is not None)
    role = op.tq.fmt if op.tq.quantized else "unquantized"
    return ScaledOperand(unit, scale, f"{op.name} holds {kinds} values ({role})")


def scaled_tokens(q: Any, op: OperandQuant) -> ScaledOperand:
    """`quantize_tokens`'s result as a `ScaledOperand` ([tiles, a, C] or [tiles, C, a])."""
    return _scaled(q, op)


def scaled_weights(q: Any, op: OperandQuant, transposed: bool = False) -> ScaledOperand:
    """`quantize_weights`'s result as a `ScaledOperand` [E, P, C] ([E, C, P] when `transposed`:
    the Fprop W reused in Dgrad, which has one outer scale per expert)."""
    s = _scaled(q, op)
    values, scale = s.values[:, 0], s.scale[:, 0]
    if transposed:
        if op.tq.outer_scale == "row":
            raise ValueError(
                f"{op.name} has one outer scale per row: it cannot be reused transposed"
            )
        values = jnp.swapaxes(values, -1, -2)
        scale = jnp.broadcast_to(scale[:, :1], values.shape[:-1] + (1,))
    return ScaledOperand(values, scale, s.inexact)
