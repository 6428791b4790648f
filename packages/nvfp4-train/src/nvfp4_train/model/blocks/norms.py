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


class GatedRMSNorm(nnx.Module):
    """The Mamba-2 mixer's gated norm, as transformers' `NemotronHRMSNormGated`: y * silu(z),
    RMS-normalised over each group of `group_size` channels on its own (the mixer's B/C groups),
    times a float32 learnable scale (init 1); computed in float32, returned in `dtype`."""

    def __init__(self, dim: int, *, group_size: int, eps: float, dtype: jnp.dtype):
        if group_size < 1 or dim % group_size:
            raise ValueError(f"group_size must divide dim={dim}, got {group_size}")
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.group_size = group_size
        self.eps = eps
        self.dtype = dtype

    def __call__(self, y: jax.Array, z: jax.Array) -> jax.Array:
        gated = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
        groups = gated.reshape(*gated.shape[:-1], -1, self.group_size)
        inv_rms = jax.lax.rsqrt(jnp.mean(groups * groups, axis=-1, keepdims=True) + self.eps)
        normed = (groups * inv_rms).reshape(gated.shape)
        return (normed * self.scale[...]).astype(self.dtype)
