"""Quantize one GEMM operand per a `TensorQuant`, blocks along its LAST axis, and decode it back.

The NVFP4 and MXFP4 numerics live in `nvfp4_format` (one implementation for the whole project);
this module only picks the function per role and supplies the random numbers for stochastic
rounding. A quantized operand is the format's own pytree: `NVFP4Array`, `MXFP4Array`,
`FP8Tensor`, or for "bf16" the array itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

import nvfp4_format
from nvfp4_ops.fp8 import FP8Tensor, dequantize_fp8, quantize_fp8
from nvfp4_ops.recipe import TensorQuant

MXFP4_SCALE_RULE = "ocp"
"""MXFP4 scale rule used by the recipes: the OCP rule X = 2^(floor(log2(amax_block)) - 2)."""


def sr_uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniform numbers for stochastic rounding from 8 random bits per element.

    u = (b + 0.5) / 256 with b a uniform byte, as TE's kernels draw 8 bits per element (the +0.5
    centres each bin, so the rounding bias is at most 1/512 of a grid step and zero at the 256
    representable fractions). The bytes come from `jax.random.bits(key, n/4, uint32)` bitcast to
    uint8: a quarter of the PRNG work of one draw per element.

    Args:
      key: a JAX PRNG key (typed or raw uint32); its implementation (threefry, rbg, ...) is used.
      shape: the shape of the operand.
    """
    n = 1
    for s in shape:
        n *= s
    with jax.named_scope("nvfp4/sr_random_bits"):
        if n % 4 == 0:
            words = jax.random.bits(key, (n // 4,), jnp.uint32)
            b = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(shape)
        else:
            b = jax.random.bits(key, shape, jnp.uint8)
        return (b.astype(jnp.float32) + 0.5) * jnp.float32(1.0 / 256.0)


def quantize_operand(x: jax.Array, tq: TensorQuant, key: jax.Array | None = None) -> Any:
    """Quantize `x` per `tq`, blocks along the last axis (16x16: tiles over the last two axes).

    Args:
      x: the operand, contraction axis last.
      tq: the role's settings.
      key: PRNG key, required when `tq.rounding == "stochastic"`.
    """
    if tq.rounding == "stochastic" and key is None:
        raise ValueError(f"rounding='stochastic' for {tq} needs a PRNG key, got key=None")
    uniform = sr_uniform(key, x.shape) if tq.rounding == "stochastic" else None
    with jax.named_scope(f"nvfp4/quantize_{tq.fmt}"):
        if tq.fmt == "nvfp4":
            return nvfp4_format.quantize(x, tq.block_shape, rounding=tq.rounding, uniform=uniform)
        if tq.fmt == "mxfp4":
            return nvfp4_format.quantize_mxfp4(
                x, MXFP4_SCALE_RULE, rounding=tq.rounding, uniform=uniform
            )
        if tq.fmt in ("fp8_e4m3", "fp8_e5m2"):
            return quantize_fp8(x, tq.fmt)
        return x


def materialised(x: jax.Array) -> jax.Array:
    """`x` itself (bit for bit), written to memory once and read back by every consumer.

    XLA:CPU drops `optimization_barrier`s before fusion and duplicates cheap elementwise
    producers into each consumer. A reduction is never fused into its consumer, so the max of
    x's bits (as unsigned integers) and 0 over a size-2 axis - x exactly, NaN payloads and -0
    included - makes XLA compute x once where the consumer reads each element several times
    (XLA does fuse it into a one-to-one consumer such as a transpose). Used for block scales: a
    decode fused after the quantization re-ran clamp + float32 -> E4M3 for each of a block's 16
    elements.
    """
    uint = jnp.dtype(f"uint{jnp.dtype(x.dtype).itemsize * 8}")
    u = jax.lax.bitcast_convert_type(x, uint)
    u = jnp.max(jnp.stack([u, jnp.zeros_like(u)], axis=-1), axis=-1)
    return jax.lax.bitcast_convert_type(u, x.dtype)


def _dequantize_nvfp4(q: Any, dtype) -> jax.Array:
    """`nvfp4_format.dequantize` reading block scales materialised in memory.

    The per-element E4M3 -> float32 widening left in the decode is cheap, and it also keeps
    XLA:CPU from pulling the decode into the GEMM (which made the GEMM ~3x slower). Measured at
    1024^2 inside a full-recipe step: 0.8-1.7 ms per decode instead of 4-7 ms (docs/ops.md).
    """
    q = dataclasses.replace(q, block_scales=materialised(q.block_scales))
    return nvfp4_format.dequantize(q, dtype)


def _dequantize_mxfp4(q: Any, dtype) -> jax.Array:
    """`nvfp4_format.dequantize_mxfp4` behind an optimization barrier (as for NVFP4)."""
    return nvfp4_format.dequantize_mxfp4(jax.lax.optimization_barrier(q), dtype)


def dequantize_operand(q: Any, tq: TensorQuant, dtype=jnp.float32) -> jax.Array:
    """Decode a quantized operand (or pass a "bf16" operand through) as `dtype`."""
    with jax.named_scope(f"nvfp4/dequantize_{tq.fmt}"):
        if tq.fmt == "nvfp4":
            return _dequantize_nvfp4(q, dtype)
        if tq.fmt == "mxfp4":
            return _dequantize_mxfp4(q, dtype)
        if tq.fmt in ("fp8_e4m3", "fp8_e5m2"):
            return dequantize_fp8(q, dtype)
        return q.astype(dtype)


def is_fp8(q: Any) -> bool:
    return isinstance(q, FP8Tensor)
