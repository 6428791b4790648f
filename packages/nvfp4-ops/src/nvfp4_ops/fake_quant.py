"""`fake_quantize`: quantize-dequantize any tensor, for experiments (no custom gradient)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from nvfp4_ops.canonical import pad_to
from nvfp4_ops.gemm_table import require_key
from nvfp4_ops.quantizers import dequantize_operand, quantize_operand
from nvfp4_ops.recipe import TensorQuant


def fake_quantize(
    x: jax.Array,
    fmt: str = "nvfp4",
    block_shape: tuple[int, int] | None = (1, 16),
    rounding: str = "rne",
    key: jax.Array | None = None,
    *,
    block_scale_rule: str = "max",
    outer_scale: str = "tensor",
) -> jax.Array:
    """Return dequantize(quantize(x)) in x's dtype, blocks along the last axis.

    The last axis (and for 16x16 tiles the second to last) is zero-padded to whole blocks and the
    padding dropped afterwards, so any shape works. Gradients flow as through the plain ops
    (mostly zero: use `dot_general` for training).

    Args:
      x: floating array, at least 1-D (2-D for 16x16 tiles).
      fmt: "nvfp4", "mxfp4", "mxfp8", "fp8_e4m3", "fp8_e5m2" or "bf16" (identity).
      block_shape: as `TensorQuant.block_shape` ((1, 16) or (16, 16) for nvfp4, (1, 32) for
        mxfp4 and mxfp8, None for FP8).
      rounding: "rne" or "stochastic" (FP4 formats; needs `key`).
      key: PRNG key for stochastic rounding.
      block_scale_rule, outer_scale: as `TensorQuant` ("4over6" and "row" for nvfp4).

    Example:
      >>> y = fake_quantize(jnp.linspace(-1.0, 1.0, 20))
      >>> y.shape, float(jnp.abs(y - jnp.linspace(-1.0, 1.0, 20)).max()) < 0.2
      ((20,), True)
    """
    tq = TensorQuant(fmt, block_shape, rounding, block_scale_rule, outer_scale)
    x = jnp.asarray(x)
    if x.ndim < (2 if tq.is_2d else 1):
        raise ValueError(f"x needs at least {2 if tq.is_2d else 1} dimensions, got shape {x.shape}")
    require_key(key, tq)
    return _fake_quantize(x, tq, key)


@functools.partial(jax.jit, static_argnums=(1,))
def _fake_quantize(x: jax.Array, tq: TensorQuant, key: jax.Array | None) -> jax.Array:
    with jax.named_scope(f"nvfp4/fake_quantize_{tq.fmt}"):
        multiples = [1] * x.ndim
        multiples[-1] = tq.block_size
        if tq.is_2d:
            multiples[-2] = 16
        padded = pad_to(x, tuple(multiples))
        q = quantize_operand(padded, tq, key)
        out = dequantize_operand(q, tq, jnp.float32)
        return out[tuple(slice(0, s) for s in x.shape)].astype(x.dtype)
