"""Blockwise random Hadamard transform (RHT) used on the Wgrad operands (spec section 4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

TE_SIGNS: tuple[int, ...] = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
"""The fixed 16-entry sign vector of TransformerEngine's NVFP4 recipe, shared by all layers."""


def hadamard_matrix(size: int = 16, signs: tuple[int, ...] | None = TE_SIGNS) -> np.ndarray:
    """float32 [size, size] H = diag(signs) @ H_sylvester / sqrt(size); orthonormal (H @ H.T = I).

    Args:
      size: a power of two.
      signs: +-1 entries, `size` of them (None: all +1). For sizes other than 16 with the
        default TE signs the vector is tiled.
    """
    if size < 2 or size & (size - 1):
        raise ValueError(f"size must be a power of two >= 2, got {size}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < size:
        h = np.block([[h, h], [h, -h]])
    if signs is None:
        s = np.ones(size, np.float32)
    else:
        s = np.resize(np.asarray(signs, np.float32), size)
        if signs is not TE_SIGNS and len(signs) != size:
            raise ValueError(f"signs must have {size} entries, got {len(signs)}")
        if not np.all(np.abs(s) == 1):
            raise ValueError(f"signs must be +1 or -1, got {tuple(signs)}")
    return (s[:, None] * h / np.sqrt(np.float32(size))).astype(np.float32)


def hadamard_transform(
    x: jax.Array,
    axis: int = -1,
    size: int = 16,
    signs: tuple[int, ...] | None = TE_SIGNS,
    *,
    inverse: bool = False,
) -> jax.Array:
    """Apply H tile-wise along `axis`: each run of `size` elements v becomes v @ H.

    Computed in float32 and returned in float32. The transform is orthonormal, so
    `hadamard_transform(hadamard_transform(x), inverse=True)` gives `x` back (up to float32
    rounding), and a contraction over `axis` of two operands rotated alike is unchanged.

    Args:
      x: array whose `axis` length is a multiple of `size`.
      axis: the axis to rotate along (the Wgrad contraction, i.e. tokens).
      size: tile size, a power of two (16 in the paper).
      signs: the random sign vector (default `TE_SIGNS`, a documented constant).
      inverse: apply H^T instead of H.

    Example:
      >>> x = jnp.arange(32.0).reshape(2, 16)
      >>> y = hadamard_transform(x)
      >>> bool(jnp.allclose(hadamard_transform(y, inverse=True), x, atol=1e-5))
      True
    """
    n = x.shape[axis]
    if n % size:
        raise ValueError(f"x.shape[{axis}] must be a multiple of size={size}, got {n}")
    h = jnp.asarray(hadamard_matrix(size, signs))
    if inverse:
        h = h.T
    with jax.named_scope("nvfp4/hadamard"):
        moved = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
        tiles = moved.reshape(*moved.shape[:-1], n // size, size)
        rotated = jnp.matmul(tiles, h, precision=jax.lax.Precision.HIGHEST)
        return jnp.moveaxis(rotated.reshape(moved.shape), -1, axis)
