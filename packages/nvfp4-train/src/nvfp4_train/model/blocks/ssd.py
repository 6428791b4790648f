"""The selective state-space scan of the Mamba-2 mixer, chunked (SSD, state-space duality).

The recurrence it computes, per row and head h (state [head_dim P, state N], group g = h // (H / G)):

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T        y_t = h_t C_t

in float32, as the Mamba-2 paper's SSD algorithm (and transformers' `mamba2_chunk_scan`) computes
it: the sequence is cut into chunks of `chunk_size` tokens (the last one padded with dt = 0, which
neither decays nor feeds the state); inside a chunk the output is a masked quadratic form
(`(C B^T) * decay` applied to `dt x`), the decays taken from segment sums of `dt A` (sums of the
terms between two positions, never differences of large cumulative sums); each chunk's state is
passed to the next by a `jax.lax.scan` over chunks. Memory is O(L x chunk_size), never L x L.

Packed documents (`segment_ids`, Mamba-2's `seq_idx`): the state restarts at each document; a
pair of positions of two documents gets no weight, a chunk's state collects only the tokens of the
document its last token is in, and the state carried into a chunk reaches only tokens of the
document the previous chunk ended in.

Example:
    >>> x, dt = jnp.ones((1, 5, 2, 4)), jnp.full((1, 5, 2), 0.5)
    >>> b = c = jnp.ones((1, 5, 1, 3))
    >>> ssd_scan(x, dt, -jnp.ones(2), b, c, chunk_size=2).shape
    (1, 5, 2, 4)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _check(x, dt, a, b, c, chunk_size: int, segment_ids) -> None:
    """Raises ValueError naming the argument whose shape does not fit."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if x.ndim != 4:
        raise ValueError(f"x must be [batch, length, heads, head_dim], got shape {x.shape}")
    bsz, length, heads, _ = x.shape
    if dt.shape != (bsz, length, heads) or a.shape != (heads,):
        raise ValueError(
            f"dt must be {(bsz, length, heads)} and A {(heads,)}, got {dt.shape} and {a.shape}"
        )
    if b.ndim != 4 or b.shape[:2] != (bsz, length) or c.shape != b.shape:
        raise ValueError(
            f"B and C must be [{bsz}, {length}, groups, state], got {b.shape}, {c.shape}"
        )
    if heads % b.shape[2]:
        raise ValueError(f"heads={heads} must be a multiple of the B/C groups={b.shape[2]}")
    if segment_ids is not None and segment_ids.shape != (bsz, length):
        raise ValueError(f"segment_ids must be {(bsz, length)}, got {segment_ids.shape}")


def _chunks(t: jax.Array, length: int, chunk_size: int, edge: bool = False) -> jax.Array:
    """[B, L, ...] -> [B, chunks, chunk_size, ...], the end padded with zeros (or its last
    value with `edge`)."""
    pad = -length % chunk_size
    widths = [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2)
    t = jnp.pad(t, widths, mode="edge" if edge else "constant")
    return t.reshape(t.shape[0], -1, chunk_size, *t.shape[2:])


def _segment_sums(a_BxCxGxRxQ: jax.Array, same_BxCxQxQ: jax.Array) -> jax.Array:
    """sum_{k = s+1}^{l} a_k for every l >= s of a chunk where positions l and s are in one
    document, -inf elsewhere: [B, C, G, R, Q(l), Q(s)]."""
    q = a_BxCxGxRxQ.shape[-1]
    lower = jnp.tril(jnp.ones((q, q), bool), -1)  # l > s
    terms = jnp.where(lower, a_BxCxGxRxQ[..., :, None], 0.0)
    sums = jnp.cumsum(terms, axis=-2)
    causal = jnp.tril(jnp.ones((q, q), bool)) & same_BxCxQxQ[:, :, None, None]
    return jnp.where(causal, sums, -jnp.inf)


def ssd_scan(
    x_BxLxHxP: jax.Array,
    dt_BxLxH: jax.Array,
    A_H: jax.Array,
    B_BxLxGxN: jax.Array,
    C_BxLxGxN: jax.Array,
    *,
    chunk_size: int = 128,
    segment_ids_BxL: jax.Array | None = None,
    return_final_state: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The Mamba-2 scan (see the module docstring), float32.

    Args:
        x_BxLxHxP: the heads' inputs.
        dt_BxLxH: time steps after softplus (and any clipping), > 0.
        A_H: the decay rates, < 0 (`-exp(A_log)`).
        B_BxLxGxN, C_BxLxGxN: input and output projections of the state, per group; head h reads
            group h // (H / G).
        chunk_size: tokens per chunk (memory O(L x chunk_size)); any length works.
        segment_ids_BxL: int document ids of packed rows, non-decreasing along L; None: one
            document per row.
        return_final_state: also return the state after the last token, [B, H, P, N].

    Returns:
        y float32 [B, L, H, P] (without the D skip), and with `return_final_state` the state.
    """
    _check(x_BxLxHxP, dt_BxLxH, A_H, B_BxLxGxN, C_BxLxGxN, chunk_size, segment_ids_BxL)
    bsz, length, heads, p = x_BxLxHxP.shape
    g, n = B_BxLxGxN.shape[2:]
    r, q = heads // g, chunk_size
    f32 = jnp.float32
    dt = _chunks(dt_BxLxH.astype(f32), length, q).reshape(bsz, -1, q, g, r)
    x = _chunks(x_BxLxHxP.astype(f32), length, q).reshape(bsz, -1, q, g, r, p)
    b_, c_ = (_chunks(t.astype(f32), length, q) for t in (B_BxLxGxN, C_BxLxGxN))
    seg = jnp.zeros((bsz, length), jnp.int32) if segment_ids_BxL is None else segment_ids_BxL
    seg_BxCxQ = _chunks(seg, length, q, edge=True)
    a_BxCxGxRxQ = jnp.moveaxis(dt * A_H.astype(f32).reshape(g, r), 2, -1)
    xdt = x * dt[..., None]
    same = seg_BxCxQ[:, :, :, None] == seg_BxCxQ[:, :, None, :]
    decay = jnp.exp(_segment_sums(a_BxCxGxRxQ, same))  # [B, C, G, R, Q(l), Q(s)]
    scores = jnp.einsum("bclgn,bcsgn->bcgls", c_, b_)
    y_diag = jnp.einsum("bcgls,bcgrls,bcsgrp->bclgrp", scores, decay, xdt)
    # each chunk's own state at its end: tokens of the document its last token is in
    states = jnp.einsum("bcgrs,bcsgrp,bcsgn->bcgrpn", decay[..., -1, :], xdt, b_)
    total = jnp.sum(a_BxCxGxRxQ, axis=-1)  # [B, C, G, R]: the decay through a whole chunk
    last = seg_BxCxQ[:, :, -1]
    previous_last = jnp.concatenate([seg_BxCxQ[:, :1, 0], last[:, :-1]], axis=1)
    carried_in, final = _pass_states(states, total, last == previous_last)
    reaches = (seg_BxCxQ == previous_last[:, :, None]).astype(f32)  # [B, C, Q]
    into = jnp.exp(jnp.cumsum(a_BxCxGxRxQ, axis=-1)) * reaches[:, :, None, None, :]
    y_off = jnp.einsum("bclgn,bcgrpn,bcgrl->bclgrp", c_, carried_in, into)
    y = (y_diag + y_off).reshape(bsz, -1, heads, p)[:, :length]
    if return_final_state:
        return y, final.reshape(bsz, heads, p, n)
    return y


def _pass_states(
    states_BxCxGxRxPxN: jax.Array, total_BxCxGxR: jax.Array, continues_BxC: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(the state carried into each chunk [B, C, G, R, P, N], the state after the last chunk):
    h_c = states_c + exp(total_c) h_{c-1}, the carried term dropped where chunk c's last token
    starts or continues another document than the previous chunk ended in."""
    decay = jnp.exp(total_BxCxGxR) * continues_BxC[:, :, None, None]

    def step(h, inputs):
        own, chunk_decay = inputs
        return own + chunk_decay[..., None, None] * h, h

    h0 = jnp.zeros_like(states_BxCxGxRxPxN[:, 0])
    final, carried = jax.lax.scan(
        step, h0, (jnp.moveaxis(states_BxCxGxRxPxN, 1, 0), jnp.moveaxis(decay, 1, 0))
    )
    return jnp.moveaxis(carried, 0, 1), final
