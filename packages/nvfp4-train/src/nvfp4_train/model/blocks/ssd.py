"""The selective state-space scan of the Mamba-2 mixer, token by token (`jax.lax.scan` over L):
h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t, y_t = h_t C_t, in float32, the state restarting at each
document. Exact but sequential; the chunked SSD replaces it."""

import jax
import jax.numpy as jnp


def ssd_scan(
    x_BxLxHxP,
    dt_BxLxH,
    A_H,
    B_BxLxGxN,
    C_BxLxGxN,
    *,
    chunk_size=128,
    segment_ids_BxL=None,
    return_final_state=False,
):
    b, l, h, p = x_BxLxHxP.shape
    g = B_BxLxGxN.shape[2]
    rep = h // g
    Bh = jnp.repeat(B_BxLxGxN.astype(jnp.float32), rep, axis=2)
    Ch = jnp.repeat(C_BxLxGxN.astype(jnp.float32), rep, axis=2)
    seg = jnp.zeros((b, l), jnp.int32) if segment_ids_BxL is None else segment_ids_BxL
    prev = jnp.concatenate([seg[:, :1], seg[:, :-1]], axis=1)
    keep = (seg == prev).astype(jnp.float32)

    def step(state, xs):
        x, dt, bb, cc, k = xs
        decay = jnp.exp(dt * A_H) * k[:, None]
        state = (
            state * decay[:, :, None, None] + (dt[:, :, None] * x)[..., None] * bb[:, :, None, :]
        )
        y = jnp.einsum("bhpn,bhn->bhp", state, cc)
        return state, y

    xs = (
        x_BxLxHxP.astype(jnp.float32).swapaxes(0, 1),
        dt_BxLxH.astype(jnp.float32).swapaxes(0, 1),
        Bh.swapaxes(0, 1),
        Ch.swapaxes(0, 1),
        keep.swapaxes(0, 1),
    )
    state, ys = jax.lax.scan(step, jnp.zeros((b, h, p, B_BxLxGxN.shape[-1]), jnp.float32), xs)
    y = ys.swapaxes(0, 1)
    return (y, state) if return_final_state else y
