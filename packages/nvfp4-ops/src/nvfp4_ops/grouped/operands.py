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
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from nvfp4_ops.formats import FORMAT_OPS
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
