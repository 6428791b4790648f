"""Rotary position embeddings in Hugging Face's layout (`rotate_half`), with its frequency scalings."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def rotate_half(x: jax.Array) -> jax.Array:
    """HF `rotate_half`: split the last axis in halves (x1, x2) and return concat(-x2, x1)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def rope_inv_freq(head_dim: int, theta: float, scaling=None) -> jax.Array:
    """float32 [head_dim / 2] RoPE frequencies, scaled as HF's `rope_type` says
    (`model.RopeScaling`; None or "default": unscaled) with HF's formulas."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    kind = "default" if scaling is None else scaling.rope_type
    if kind == "linear":
        return inv_freq / scaling.factor
    if kind != "llama3":
        return inv_freq
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope_cos_sin(
    positions_L: jax.Array, head_dim: int, theta: float, scaling=None
) -> tuple[jax.Array, jax.Array]:
    """Rotary tables in the HF layout: float32 [..., L, head_dim] for positions [..., L] ([L], or
    [B, L] per-document positions), frequencies repeated over both halves."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    freqs_LxHalf = positions_L.astype(jnp.float32)[..., None] * inv_freq
    emb_LxD = jnp.concatenate([freqs_LxHalf, freqs_LxHalf], axis=-1)
    return jnp.cos(emb_LxD), jnp.sin(emb_LxD)


def apply_rope(x_BxLxHxD: jax.Array, cos_LxD: jax.Array, sin_LxD: jax.Array) -> jax.Array:
    """Applies rotary embeddings (HF convention) in float32; returns x's dtype. The tables are
    [L, D] (shared by every row) or [B, L, D] (per-row positions)."""
    x32 = x_BxLxHxD.astype(jnp.float32)
    if cos_LxD.ndim == 2:
        cos, sin = cos_LxD[None, :, None, :], sin_LxD[None, :, None, :]
    else:
        cos, sin = cos_LxD[:, :, None, :], sin_LxD[:, :, None, :]
    return (x32 * cos + rotate_half(x32) * sin).astype(x_BxLxHxD.dtype)
