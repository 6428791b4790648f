"""FP8 (E4M3 / E5M2) with per-tensor current scaling: the usual production baseline.

Current scaling: amax of the tensor at hand, encode scale = fp8_max / amax (1 if amax is 0),
data = cast(clip(x * scale, +-fp8_max)) with round-to-nearest-even, decode = data / scale.
A non-finite input gives a NaN decode scale (never a silently finite result).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

FP8_DTYPES = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


class FP8Tensor(NamedTuple):
    """data: float8 array; decode_scale: float32 scalar (value = data * decode_scale)."""

    data: jax.Array
    decode_scale: jax.Array


def quantize_fp8(x: jax.Array, fmt: str = "fp8_e4m3", amax: jax.Array | None = None) -> FP8Tensor:
    """Quantize `x` to FP8 with a per-tensor current scale (see module docstring).

    `amax`: the amax that sets the scale, default max|x| (a caller quantizing one tensor in
    parts passes the whole tensor's, as the grouped GEMMs do per group).

    Example:
      >>> t = quantize_fp8(jnp.array([1.0, -448.0, 3.0]))
      >>> dequantize_fp8(t).tolist()
      [1.0, -448.0, 3.0]
    """
    if fmt not in FP8_DTYPES:
        raise ValueError(f"fmt must be one of {tuple(FP8_DTYPES)}, got {fmt!r}")
    fmax = FP8_MAX[fmt]
    with jax.named_scope(f"nvfp4/quantize_{fmt}"):
        x32 = x.astype(jnp.float32)
        if amax is None:
            amax = fp8_amax(x32)
        safe = (amax > 0) & jnp.isfinite(amax)
        encode = jnp.where(safe, jnp.float32(fmax) / jnp.where(safe, amax, 1.0), 1.0)
        encode = jnp.minimum(encode, jnp.finfo(jnp.float32).max)
        data = jnp.clip(x32 * encode, -fmax, fmax).astype(FP8_DTYPES[fmt])
        decode = jnp.where(jnp.isfinite(amax), 1.0 / encode, jnp.nan).astype(jnp.float32)
        return FP8Tensor(data, decode)


def fp8_amax(x: jax.Array) -> jax.Array:
    """max|x| in float32 (0 for an empty x): the amax of the per-tensor scale."""
    return abs_max(x) if x.size else jnp.float32(0)


def abs_max(x: jax.Array, axis: int | None = None, keepdims: bool = False) -> jax.Array:
    """max|x| in float32 over `axis` (default all), NaN wherever a reduced x is NaN.

    Not `jnp.max(jnp.abs(x))`: XLA:CPU (jax 0.10) runs a max reduction over rows of about 64
    elements or more (a batch of tiles' amaxes under `jax.vmap`, a 1x32 block) as a vector max
    that drops NaN, so a NaN token gave a finite amax. The reducer max(|a|, |b|) is not matched
    as a plain max and keeps NaN (as `nvfp4_format`'s per-block amax); it is as exact.
    """
    x32 = x.astype(jnp.float32)
    axes = tuple(range(x.ndim)) if axis is None else (axis % x.ndim,)
    out = jax.lax.reduce(
        x32, jnp.float32(0), lambda u, v: jnp.maximum(jnp.abs(u), jnp.abs(v)), axes
    )
    return jnp.expand_dims(out, axes) if keepdims else out


def dequantize_fp8(t: FP8Tensor, dtype=jnp.float32) -> jax.Array:
    """data * decode_scale, computed in float32 and cast to `dtype`."""
    return (t.data.astype(jnp.float32) * t.decode_scale).astype(dtype)
