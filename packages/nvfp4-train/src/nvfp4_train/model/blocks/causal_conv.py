"""The depthwise causal conv1d of the Mamba-2 mixer (over x, B and C), in float32:

    out[t, c] = bias[c] + sum_{k=0}^{K-1} kernel[k, c] * x[t - (K-1) + k, c]

with x before the row, or (packed documents) before t's document, taken as 0: the conv window
restarts at each document. PyTorch's `nn.Conv1d(C, C, K, groups=C, padding=K-1)` over x^T, cut to
L, computes the same with `weight[c, 0, k] == kernel[k, c]`.

Example:
    >>> causal_conv1d(jnp.ones((1, 3, 1)), jnp.array([[1.0], [2.0]])).ravel().tolist()
    [2.0, 3.0, 3.0]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_conv1d(
    x_BxLxC: jax.Array,
    kernel_KxC: jax.Array,
    bias_C: jax.Array | None = None,
    *,
    segment_ids_BxL: jax.Array | None = None,
) -> jax.Array:
    """The conv above, float32 [B, L, C]: K shifted, masked products (K is small, 4 in Mamba-2).

    Args:
        x_BxLxC: the input.
        kernel_KxC: the taps, oldest first (`kernel[K-1]` weighs the current token).
        bias_C: the bias, or None.
        segment_ids_BxL: int document ids of packed rows; None: one document per row.
    """
    if kernel_KxC.ndim != 2 or kernel_KxC.shape[0] < 1 or kernel_KxC.shape[1] != x_BxLxC.shape[-1]:
        raise ValueError(
            f"kernel_KxC must be [K >= 1, channels={x_BxLxC.shape[-1]}], got {kernel_KxC.shape}"
        )
    width, length = kernel_KxC.shape[0], x_BxLxC.shape[1]
    x = x_BxLxC.astype(jnp.float32)
    out = jnp.zeros_like(x) if bias_C is None else jnp.broadcast_to(bias_C, x.shape)
    for k in range(width):
        shift = width - 1 - k
        shifted = jnp.pad(x, ((0, 0), (shift, 0), (0, 0)))[:, :length]
        if segment_ids_BxL is not None and shift:
            before = jnp.pad(segment_ids_BxL, ((0, 0), (shift, 0)), constant_values=-1)
            shifted = shifted * (before[:, :length] == segment_ids_BxL)[..., None]
        out = out + shifted * kernel_KxC[k].astype(jnp.float32)
    return out
