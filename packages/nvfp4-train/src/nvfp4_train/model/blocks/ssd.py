"""The Mamba-2 selective state-space scan, computed chunkwise (SSD, state-space duality), exact.

`ssd_scan` computes, per batch row and head h (state h_t float32 [P, N], h_0 = 0):

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t (outer) B_t        y_t = h_t @ C_t   (contract N)

with B_t, C_t of group g = h // (H / G) (heads share their group's B and C, as `repeat_interleave`).
It is the recurrence, not an approximation of it: the sequence is cut into chunks of Q tokens and

1. inside a chunk, y_t += sum_{s <= t} (C_t . B_s) exp(a_{s+1} + ... + a_t) dt_s x_s with
   a = dt * A: a [Q x Q] causal "attention" per head whose decay is exp of a cumsum difference,
   masked to -inf before the exp (`jnp.where`), and exactly 1 on the diagonal;
2. each chunk's end state collects its tokens: sum_s exp(a_{s+1} + ... + a_last) dt_s x_s B_s
   (that sum taken directly, not as a difference);
3. a `jax.lax.scan` over chunks carries the state: h_end(k) = exp(sum of a over k) h_end(k-1) +
   end state of k, and token t of chunk k reads exp(a_first + ... + a_t) C_t . h_end(k-1).

Memory is O(L x Q) per head (the [Q x Q] decay of every chunk) plus O(L / Q) states: never
O(L^2). `C . B` is formed once per group, not per head. Everything is float32 (inputs are cast;
contractions at `Precision.HIGHEST`, so no TF32 on GPUs); it works under `jit`, `grad` and
`checkpoint` (reverse mode: step 1 is a `jax.custom_vjp` whose backward recomputes the [Q x Q]
scores). Rounding: the exponent of a decay is a difference of float32 cumsums, off by about
1e-7 x |a_1 + ... + a_Q| of the chunk; the diagonal, being the constant 1, gives acs no gradient
(a +g and -g there would cancel only up to rounding, which the cumsum's transpose spreads over
every earlier token's dA).

Products whose gradient sums over a broadcast axis are written as einsums (also in the custom
backward): XLA:CPU runs a fused multiply + reduce 10-70x slower than the same sum as a dot.

Documents (packed rows, Mamba-2's `seq_idx`): with `segment_ids_BxL`, a token whose id differs
from the previous token's starts a new document, and the state restarts there (h = 0 before its
first token): no token sees an earlier document. By masking: intra-chunk pairs of different
documents give 0; a chunk's end state collects only the document of its last token; the carried
state reaches token t only if t is in the document of the previous chunk's last token; and the
carried state's decay into the next end state is zeroed when that chunk ends in a new document.
Padding (L up to a multiple of Q) has x = 0 and dt = 0: it adds nothing and decays nothing.

The D skip, the gate and the norm of the Mamba-2 mixer are not part of this; the caller adds D x.

Example:
    >>> x = jnp.ones((1, 5, 4, 8)); dt = jnp.full((1, 5, 4), 0.1); A = -jnp.ones(4)
    >>> bc = jnp.ones((1, 5, 2, 16))
    >>> ssd_scan(x, dt, A, bc, bc, chunk_size=2).shape
    (1, 5, 4, 8)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_F32 = jnp.float32
_einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


def _chunks(x_BxLx_: jax.Array, q: int) -> jax.Array:
    """[B, Lp, ...] -> [B, Lp / q, q, ...]."""
    b, lp = x_BxLx_.shape[:2]
    return x_BxLx_.reshape(b, lp // q, q, *x_BxLx_.shape[2:])


def _group_chunks(m_BxLxGxN: jax.Array, pad: int, q: int) -> jax.Array:
    """B or C as float32 [B, K, G, Q, N], padded with zeros to K chunks of q."""
    m = jnp.pad(m_BxLxGxN.astype(_F32), ((0, 0), (0, pad), (0, 0), (0, 0)))
    return jnp.moveaxis(_chunks(m, q), 2, 3)


def _documents(segment_ids_BxL: jax.Array | None, b: int, l: int) -> jax.Array:
    """int32 [B, L]: document index, +1 wherever the segment id differs from the previous token's."""
    if segment_ids_BxL is None:
        return jnp.zeros((b, l), jnp.int32)
    seg = jnp.asarray(segment_ids_BxL)
    change_Bx_ = (seg[:, 1:] != seg[:, :-1]).astype(jnp.int32)
    return jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.cumsum(change_Bx_, axis=1)], axis=1)


def _sums_over(a_BxKxGxRxQ: jax.Array, include_QxQ: jax.Array) -> jax.Array:
    """[..., Q]: out[t] = sum of a[k] over k with include[k, t], as one dot (XLA:CPU fuses a
    cumsum's pieces into every consumer of it; a dot's result is materialised once)."""
    return _einsum("bkgrq,qt->bkgrt", a_BxKxGxRxQ, include_QxQ.astype(_F32))


def _decay(acs_BxKxGxRxQ, doc_BxKxQ):
    """(decay [B, K, G, R, Q(t), Q(s)], strictly-before mask [Q, Q]) of one chunk's tokens.

    decay = exp(a_{s+1} + ... + a_t) for s <= t in t's document (a cumsum difference, masked to
    -inf before the exp; exactly exp(0) = 1 for s = t), 0 otherwise.
    """
    q = acs_BxKxGxRxQ.shape[-1]
    causal_QxQ = jnp.tril(jnp.ones((q, q), bool))
    same_BxKxQxQ = doc_BxKxQ[..., :, None] == doc_BxKxQ[..., None, :]
    mask = (causal_QxQ & same_BxKxQxQ)[:, :, None, None]
    diff = acs_BxKxGxRxQ[..., :, None] - acs_BxKxGxRxQ[..., None, :]
    return jnp.exp(jnp.where(mask, diff, -jnp.inf)), jnp.tril(causal_QxQ, -1)


def _intra_scores(acs, c_, b_, doc):
    """(scores (C_t . B_s) decay [B, K, G, R, Q, Q], decay, C.B [B, K, G, Q, Q], mask [Q, Q])."""
    decay, before_QxQ = _decay(acs, doc)
    cb = _einsum("bkgtn,bkgsn->bkgts", c_, b_)
    return cb[:, :, :, None] * decay, decay, cb, before_QxQ


def _intra_output(xdt, acs, c_, b_, doc):
    """float32 [B, K, G, R, Q, P]: the output of each chunk's own tokens (step 1).

    xdt [B, K, G, R, Q, P] = dt x; acs [B, K, G, R, Q] = cumsum of dt A in the chunk;
    c_, b_ [B, K, G, Q, N]; doc [B, K, Q] document index.
    """
    scores = _intra_scores(acs, c_, b_, doc)[0]
    return _einsum("bkgrts,bkgrsp->bkgrtp", scores, xdt)


def _intra_chunk_fwd(xdt, acs, c_, b_, doc):
    return _intra_output(xdt, acs, c_, b_, doc), (xdt, acs, c_, b_, doc)


def _intra_chunk_bwd(res, dy_BxKxGxRxQxP):
    """Cotangents of (xdt, acs, c_, b_, doc) from the recomputed scores; every sum a dot."""
    xdt, acs, c_, b_, doc = res
    scores, decay, _, before_QxQ = _intra_scores(acs, c_, b_, doc)
    dscores = _einsum("bkgrtp,bkgrsp->bkgrts", dy_BxKxGxRxQxP, xdt)
    dxdt = _einsum("bkgrts,bkgrtp->bkgrsp", scores, dy_BxKxGxRxQxP)
    dcb = _einsum("bkgrts,bkgrts->bkgts", dscores, decay)
    dc = _einsum("bkgts,bkgsn->bkgtn", dcb, b_)
    db = _einsum("bkgts,bkgtn->bkgsn", dcb, c_)
    # d decay / d diff = decay, off the diagonal only (there decay is the constant 1)
    off_diagonal = jnp.where(before_QxQ, scores, 0.0)
    dacs = _einsum("bkgrts,bkgrts->bkgrt", dscores, off_diagonal) - _einsum(
        "bkgrts,bkgrts->bkgrs", dscores, off_diagonal
    )
    return dxdt, dacs, dc, db, None


_intra_chunk = jax.custom_vjp(_intra_output)
_intra_chunk.defvjp(_intra_chunk_fwd, _intra_chunk_bwd)


def _chunk_states(xdt, a, b_, doc):
    """float32 [B, K, G, R, P, N]: each chunk's end state from its own tokens (step 2).

    a [B, K, G, R, Q] = dt A of each token; the decay to the chunk's end, a_{s+1} + ... +
    a_last, is summed directly (no difference of large sums).
    """
    q = a.shape[-1]
    to_end = jnp.exp(_sums_over(a, jnp.tril(jnp.ones((q, q), bool), -1)))  # k > s
    ends = doc == doc[..., -1:]  # [B, K, Q]: tokens of the chunk's last document
    weight = jnp.where(ends[:, :, None, None, :], to_end, 0.0)
    xw = _einsum("bkgrs,bkgrsp->bkgrsp", weight, xdt)
    return _einsum("bkgrsp,bkgsn->bkgrpn", xw, b_)


def _carry_states(states, acs, doc):
    """(start states float32 [B, K, G, R, P, N], final state [B, G, R, P, N]) by a scan (step 3).

    start[k] is the state after chunk k-1's last token (zeros for k = 0).
    """
    end_doc = doc[..., -1]  # [B, K]
    kept = jnp.concatenate([jnp.ones_like(end_doc[:, :1], bool),
                            end_doc[:, 1:] == end_doc[:, :-1]], axis=1)  # fmt: skip
    decay = jnp.where(kept[:, :, None, None], jnp.exp(acs[..., -1]), 0.0)  # [B, K, G, R]

    def step(h, inputs):
        decay_BxGxR, state = inputs
        return _einsum("bgr,bgrpn->bgrpn", decay_BxGxR, h) + state, h

    h0 = jnp.zeros_like(states[:, 0])
    final, starts = jax.lax.scan(step, h0, (jnp.moveaxis(decay, 1, 0), jnp.moveaxis(states, 1, 0)))
    return jnp.moveaxis(starts, 0, 1), final


def _inter_chunk(starts, acs, c_, doc):
    """float32 [B, K, G, R, Q, P]: what each token reads of its chunk's start state (step 3)."""
    end_doc = doc[..., -1]
    prev_end = jnp.concatenate([end_doc[:, :1], end_doc[:, :-1]], axis=1)  # chunk 0: zero state
    reads = doc == prev_end[..., None]  # [B, K, Q]
    decay = jnp.where(reads[:, :, None, None, :], jnp.exp(acs), 0.0)  # [B, K, G, R, Q]
    y = _einsum("bkgtn,bkgrpn->bkgrtp", c_, starts)
    return _einsum("bkgrtp,bkgrt->bkgrtp", y, decay)


def _check(x_BxLxHxP, dt_BxLxH, A_H, B_BxLxGxN, C_BxLxGxN, chunk_size, segment_ids_BxL):
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if x_BxLxHxP.ndim != 4:
        raise ValueError(f"x_BxLxHxP must be [B, L, H, P], got shape {x_BxLxHxP.shape}")
    b, l, h, _ = x_BxLxHxP.shape
    if dt_BxLxH.shape != (b, l, h):
        raise ValueError(f"dt_BxLxH must have shape {(b, l, h)}, got {dt_BxLxH.shape}")
    if A_H.shape != (h,):
        raise ValueError(f"A_H must have shape {(h,)}, got {A_H.shape}")
    for name, m in (("B_BxLxGxN", B_BxLxGxN), ("C_BxLxGxN", C_BxLxGxN)):
        if m.ndim != 4 or m.shape[:2] != (b, l):
            raise ValueError(f"{name} must be [B={b}, L={l}, G, N], got shape {m.shape}")
    if C_BxLxGxN.shape != B_BxLxGxN.shape:
        raise ValueError(f"C_BxLxGxN must match B's shape {B_BxLxGxN.shape}, got {C_BxLxGxN.shape}")
    if h % B_BxLxGxN.shape[2]:
        raise ValueError(f"heads H={h} must be a multiple of groups G={B_BxLxGxN.shape[2]}")
    if segment_ids_BxL is not None and segment_ids_BxL.shape != (b, l):
        raise ValueError(f"segment_ids_BxL must have shape {(b, l)}, got {segment_ids_BxL.shape}")


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
    """The Mamba-2 scan y_t = h_t @ C_t, h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t (module doc).

    Args:
        x_BxLxHxP: head inputs (any float dtype; cast to float32).
        dt_BxLxH: time steps after softplus and clamping (> 0).
        A_H: the per-head decay rate (< 0, i.e. -exp(A_log)).
        B_BxLxGxN, C_BxLxGxN: input and output projections of G groups (H % G == 0; head h
            uses group h // (H / G)).
        chunk_size: tokens per chunk Q (>= 1; min(Q, L) is used; L is padded to a multiple).
        segment_ids_BxL: int document ids (a change of id starts a new document, whose state
            starts at zero), or None for one document per row.
        return_final_state: also return the state after the last token.

    Returns:
        y float32 [B, L, H, P]; with `return_final_state`, (y, state float32 [B, H, P, N]).
    """
    _check(x_BxLxHxP, dt_BxLxH, A_H, B_BxLxGxN, C_BxLxGxN, chunk_size, segment_ids_BxL)
    b, l, h, p = x_BxLxHxP.shape
    g, n = B_BxLxGxN.shape[2:]
    q = min(chunk_size, l)
    pad = -l % q
    k = (l + pad) // q
    doc = jnp.pad(_documents(segment_ids_BxL, b, l), ((0, 0), (0, pad)), mode="edge")
    dt = jnp.pad(dt_BxLxH.astype(_F32), ((0, 0), (0, pad), (0, 0)))
    dt = jnp.moveaxis(dt.reshape(b, k, q, g, h // g), 2, -1)  # [B, K, G, R, Q]
    x = jnp.pad(x_BxLxHxP.astype(_F32), ((0, 0), (0, pad), (0, 0), (0, 0)))
    x = jnp.transpose(x.reshape(b, k, q, g, h // g, p), (0, 1, 3, 4, 2, 5))  # [B, K, G, R, Q, P]
    xdt = _einsum("bkgrqp,bkgrq->bkgrqp", x, dt)
    a = _einsum("bkgrq,gr->bkgrq", dt, A_H.astype(_F32).reshape(g, h // g))
    acs = _sums_over(a, jnp.triu(jnp.ones((q, q), bool)))  # cumsum: k <= t
    b_, c_ = (_group_chunks(m, pad, q) for m in (B_BxLxGxN, C_BxLxGxN))
    doc = _chunks(doc, q)
    starts, final = _carry_states(_chunk_states(xdt, a, b_, doc), acs, doc)
    y = _intra_chunk(xdt, acs, c_, b_, doc) + _inter_chunk(starts, acs, c_, doc)
    y = jnp.transpose(y, (0, 1, 4, 2, 3, 5)).reshape(b, l + pad, h, p)[:, :l]
    if return_final_state:
        return y, final.reshape(b, h, p, n)
    return y
