"""Root-mean-square norms: `RMSNorm` (pre-norms, q/k norms, the final norm)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    """Root-mean-square norm computed in float32, with a float32 learnable scale (init 1)."""

    def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * inv_rms * self.scale[...]).astype(self.dtype)
