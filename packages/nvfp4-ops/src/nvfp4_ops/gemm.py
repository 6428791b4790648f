"""One quantized GEMM per backend: contract the LAST axis of two quantized operands.

Operands are [B, P, C] and [B, Q, C] (C contracted), giving float32 [B, P, Q] (FP32 accumulation).
`b_transposed=True` means the second operand is stored [B, C, Q] (a 16x16-tiled, per-tensor or
unquantized weight reused in Dgrad); its values are used transposed. An NVFP4 operand with one
outer scale per row (outer_scale="row") has global decode scales [B, P, 1] (lhs) or [B, Q, 1]
(rhs), applied to the output rows or columns; it is never reused transposed.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from nvfp4_ops.formats import FORMAT_OPS
from nvfp4_ops.quantizers import dequantize_operand
from nvfp4_ops.recipe import TensorQuant

_LAST = (((2,), (2,)), ((0,), (0,)))


def emulated_gemm(
    qa: Any, ta: TensorQuant, qb: Any, tb: TensorQuant, *, b_transposed: bool = False
) -> jax.Array:
    """Reference: dequantize both operands to float32, then one FP32 `dot_general`.

    Bit-exact with `dequantize(a) @ dequantize(b)` computed the same way.
    """
    with jax.named_scope("nvfp4/gemm_emulated"):
        a = dequantize_operand(qa, ta, jnp.float32)
        b = dequantize_operand(qb, tb, jnp.float32)
        if b_transposed:
            b = jnp.swapaxes(b, -1, -2)
        return jax.lax.dot_general(
            a, b, _LAST, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
        )


def _block_scaled(q: Any, t: TensorQuant, transposed: bool):
    """(element array, block scales or None, global decode scale) in the layout [B, P, C]."""
    q = jax.lax.optimization_barrier(q)  # materialise codes and scales (see formats.materialised)
    return FORMAT_OPS[t.fmt].gemm_operand(q, transposed)


def xla_gemm(
    qa: Any, ta: TensorQuant, qb: Any, tb: TensorQuant, *, b_transposed: bool = False
) -> jax.Array:
    """Real FP4/FP8 operands through a block-scaled dot, global scales applied to the output.

    Computes sum_blocks(qA * qB * sbA * sbB) * s_dec_A * s_dec_B (spec section 3) with
    `_block_scaled_dot` where both operands are block-scaled alike, else as FP32 dot of the
    scaled elements. s_dec_A, s_dec_B are scalars or per row (`_outer_scales`).
    Equal to `emulated_gemm` up to FP32 summation order and the rounding of the global scales.
    """
    with jax.named_scope("nvfp4/gemm_xla"):
        a, sa, ga = _block_scaled(qa, ta, False)
        b, sb, gb = _block_scaled(qb, tb, b_transposed)
        if sa is not None and sb is not None and sa.dtype == sb.dtype:
            out = _block_scaled_dot(a, b, sa, sb)
        else:
            out = jax.lax.dot_general(
                unit_values(a, sa),
                unit_values(b, sb),
                _LAST,
                precision=jax.lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32,
            )
        return out * _outer_scales(ga, gb)


def _outer_scales(ga: jax.Array, gb: jax.Array) -> jax.Array:
    """s_dec_A * s_dec_B against the output [B, P, Q].

    Scalars multiply as scalars (so per-tensor results are unchanged). A per-row lhs scale is
    [B, P, 1] (one per output row); a per-row rhs scale [B, Q, 1] becomes [B, 1, Q] (one per
    output column).
    """
    if jnp.ndim(gb) > 0:
        gb = jnp.swapaxes(gb, -1, -2)
    return ga * gb


def _block_scaled_dot(a, b, sa, sb) -> jax.Array:
    """float32 [B, P, Q] = sum_blocks(a * sa) (b * sb) over the last axis, scales per block.

    On GPUs through `jax.nn.scaled_matmul`: its `__op$block_scaled_dot` custom call is what XLA's
    block-scaling rewriter can turn into a cuDNN FP4 GEMM (the scales are parameters of the
    custom call's computation, as the rewriter requires); elsewhere `jax.lax.scaled_dot`, which
    lowers where `scaled_matmul` has no lowering (CPU).
    """
    if jax.default_backend() == "gpu":
        return jax.nn.scaled_matmul(a, b, sa, sb, preferred_element_type=jnp.float32)
    return jax.lax.scaled_dot(
        a, b, lhs_scale=sa, rhs_scale=sb, dimension_numbers=_LAST,
        preferred_element_type=jnp.float32,
    )  # fmt: skip


def unit_values(vals: jax.Array, scales: jax.Array | None) -> jax.Array:
    """Element values times their block scales (no global scale), float32."""
    v = vals.astype(jnp.float32)
    if scales is None:
        return v
    block = v.shape[-1] // scales.shape[-1]
    return v * jnp.repeat(scales.astype(jnp.float32), block, axis=-1)


GEMMS = {"emulated": emulated_gemm, "xla": xla_gemm}
