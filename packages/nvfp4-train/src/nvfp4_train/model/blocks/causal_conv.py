"""The Mamba-2 mixer's causal depthwise convolution along the sequence, float32.

`causal_conv1d(x, kernel, bias)` computes, per channel c and token t (K = kernel length):

    out[t, c] = bias[c] + sum_{k=0}^{K-1} kernel[k, c] * x[t - (K-1) + k, c]

with x = 0 at negative times and, with `segment_ids_BxL`, x = 0 for every token of an earlier
document (the window restarts where the segment id changes). That is PyTorch's
`nn.Conv1d(C, C, K, groups=C, padding=K-1)(x.transpose(1, 2))[..., :L]` with
`conv.weight[c, 0, k] == kernel_KxC[k, c]` (the layout of Mamba-2's `conv1d.weight` is [C, 1, K]).
Computed as one contraction of the K shifted (and masked) copies of x with the kernel (K is
small, 4 in Mamba-2; a dot, so that the kernel's gradient is one too). No activation: the caller
applies SiLU.

Example:
    >>> x = jnp.ones((1, 5, 3)); kernel = jnp.ones((4, 3))
    >>> causal_conv1d(x, kernel)[0, :, 0].tolist()
    [1.0, 2.0, 3.0, 4.0, 4.0]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def _check(x_BxLxC, kernel_KxC, bias_C, segment_ids_BxL) -> None:
    if x_BxLxC.ndim != 3:
        raise ValueError(f"x_BxLxC must be [B, L, C], got shape {x_BxLxC.shape}")
    b, l, c = x_BxLxC.shape
    if kernel_KxC.ndim != 2 or kernel_KxC.shape[1] != c:
        raise ValueError(f"kernel_KxC must be [K, C={c}], got shape {kernel_KxC.shape}")
    if kernel_KxC.shape[0] < 1:
        raise ValueError(f"kernel_KxC needs K >= 1 taps, got K={kernel_KxC.shape[0]}")
    if bias_C is not None and bias_C.shape != (c,):
        raise ValueError(f"bias_C must have shape {(c,)}, got {bias_C.shape}")
    if segment_ids_BxL is not None and segment_ids_BxL.shape != (b, l):
        raise ValueError(f"segment_ids_BxL must have shape {(b, l)}, got {segment_ids_BxL.shape}")


def _shifted(x_BxLxC: jax.Array, segment_ids_BxL: jax.Array | None, k: int) -> list[jax.Array]:
    """[x[t], x[t-1], ..., x[t-(k-1)]] as [B, L, C] each: 0 before the start and, with segment
    ids, 0 where an id changed between t - shift and t (an earlier document)."""
    b, l, _ = x_BxLxC.shape
    shifted, same_BxLx1 = [x_BxLxC], jnp.ones((b, l, 1), bool)
    for shift in range(1, k):
        x = jnp.pad(x_BxLxC[:, : max(l - shift, 0)], ((0, 0), (min(shift, l), 0), (0, 0)))
        if segment_ids_BxL is not None and shift < l:
            seg = segment_ids_BxL
            unchanged = seg[:, 1 : l - shift + 1] == seg[:, : l - shift]  # at t - shift
            same_BxLx1 = same_BxLx1 & jnp.pad(unchanged, ((0, 0), (shift, 0)))[..., None]
            x = jnp.where(same_BxLx1, x, 0.0)
        shifted.append(x)
    return shifted


def causal_conv1d(
    x_BxLxC: jax.Array,
    kernel_KxC: jax.Array,
    bias_C: jax.Array | None = None,
    *,
    segment_ids_BxL: jax.Array | None = None,
) -> jax.Array:
    """Depthwise causal convolution, restarting at each document (module doc).

    Args:
        x_BxLxC: the input (any float dtype; cast to float32).
        kernel_KxC: tap k of channel c at [k, c]; tap K-1 multiplies the current token.
        bias_C: added to every output, or None.
        segment_ids_BxL: int document ids (a change of id starts a new document), or None.

    Returns:
        float32 [B, L, C].
    """
    _check(x_BxLxC, kernel_KxC, bias_C, segment_ids_BxL)
    k = kernel_KxC.shape[0]
    windows_KxBxLxC = jnp.stack(_shifted(x_BxLxC.astype(_F32), segment_ids_BxL, k)[::-1])
    out = jnp.einsum("kblc,kc->blc", windows_KxBxLxC, kernel_KxC.astype(_F32),
                     precision=jax.lax.Precision.HIGHEST)  # fmt: skip
    if bias_C is not None:
        out = out + bias_C.astype(_F32)
    return out
