"""The depthwise causal conv1d of the Mamba-2 mixer, restarting at each document."""

import jax.numpy as jnp


def causal_conv1d(x_BxLxC, kernel_KxC, bias_C=None, *, segment_ids_BxL=None):
    k = kernel_KxC.shape[0]
    x = x_BxLxC.astype(jnp.float32)
    l = x.shape[1]
    out = jnp.zeros_like(x)
    seg = None if segment_ids_BxL is None else segment_ids_BxL
    for j in range(k):
        shift = k - 1 - j
        xs = jnp.pad(x, ((0, 0), (shift, 0), (0, 0)))[:, :l]
        if seg is not None:
            ss = jnp.pad(seg, ((0, 0), (shift, 0)), constant_values=-1)[:, :l]
            xs = xs * (ss == seg)[..., None]
        out = out + xs * kernel_KxC[j]
    return out if bias_C is None else out + bias_C
