"""Quantize one GEMM operand per a `TensorQuant`, blocks along its LAST axis, and decode it back.

The NVFP4 and MXFP4 numerics live in `nvfp4_format` (one implementation for the whole project);
this module only looks the format up in `nvfp4_ops.formats.FORMAT_OPS` and supplies the random
numbers for stochastic rounding. A quantized operand is the format's own pytree: `NVFP4Array`,
`MXFP4Array`, `FP8Tensor`, or for "bf16" the array itself.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from nvfp4_ops.formats import FORMAT_OPS, MXFP4_SCALE_RULE, materialised
from nvfp4_ops.fp8 import FP8Tensor
from nvfp4_ops.gemm_table import require_key
from nvfp4_ops.recipe import TensorQuant

__all__ = [
    "MXFP4_SCALE_RULE",
    "dequantize_operand",
    "is_fp8",
    "materialised",
    "bytes_as_uniform",
    "quantize_operand",
    "quantize_with",
    "sr_uniform",
    "words_as_uniform",
]


def sr_uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniform numbers for stochastic rounding from 8 random bits per element.

    u = (b + 0.5) / 256 with b a uniform byte, as TE's kernels draw 8 bits per element (the +0.5
    centres each bin, so the rounding bias is at most 1/512 of a grid step and zero at the 256
    representable fractions). The bytes come from `jax.random.bits(key, n/4, uint32)` bitcast to
    uint8: a quarter of the PRNG work of one draw per element. (`nvfp4_ops.grouped` draws the
    same words from threefry counters, `words_as_uniform` turning them into these numbers.)

    Args:
      key: a JAX PRNG key (typed or raw uint32); its implementation (threefry, rbg, ...) is used.
      shape: the shape of the operand.
    """
    n = 1
    for s in shape:
        n *= s
    with jax.named_scope("nvfp4/sr_random_bits"):
        if n % 4 == 0:
            return words_as_uniform(jax.random.bits(key, (n // 4,), jnp.uint32), shape)
        return bytes_as_uniform(jax.random.bits(key, shape, jnp.uint8))


def words_as_uniform(words: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """`sr_uniform`'s numbers from its uint32 words: each word bit-cast to 4 bytes (in XLA's
    byte order), the bytes laid out in `shape` in order."""
    return bytes_as_uniform(jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(shape))


def bytes_as_uniform(b: jax.Array) -> jax.Array:
    """u = (b + 0.5) / 256 in float32 for uint8 b (see `sr_uniform`)."""
    return (b.astype(jnp.float32) + 0.5) * jnp.float32(1.0 / 256.0)


def quantize_operand(x: jax.Array, tq: TensorQuant, key: jax.Array | None = None) -> Any:
    """Quantize `x` per `tq`, blocks along the last axis (16x16: tiles over the last two axes).

    Args:
      x: the operand, contraction axis last.
      tq: the role's settings.
      key: PRNG key, required when `tq.rounding == "stochastic"`.
    """
    require_key(key, tq)
    uniform = sr_uniform(key, x.shape) if tq.rounding == "stochastic" else None
    return quantize_with(x, tq, uniform)


def quantize_with(
    x: jax.Array, tq: TensorQuant, uniform: jax.Array | None, amax: jax.Array | None = None
) -> Any:
    """`quantize_operand` with the random numbers given (`sr_uniform`'s, for stochastic
    rounding; None for round to nearest) and, optionally, the amax that sets the outer scale
    (`FormatOps.outer_amax`; default x's own)."""
    with jax.named_scope(f"nvfp4/quantize_{tq.fmt}"):
        return FORMAT_OPS[tq.fmt].quantize(x, tq, uniform, amax)


def dequantize_operand(q: Any, tq: TensorQuant, dtype=jnp.float32) -> jax.Array:
    """Decode a quantized operand (or pass a "bf16" operand through) as `dtype`."""
    with jax.named_scope(f"nvfp4/dequantize_{tq.fmt}"):
        return FORMAT_OPS[tq.fmt].dequantize(q, dtype)


def is_fp8(q: Any) -> bool:
    return isinstance(q, FP8Tensor)
