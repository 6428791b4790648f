"""Blockwise causal grouped-query attention with an online softmax (flash attention in pure JAX).

`chunked_attention(q, k, v, segment_ids, block)` computes what `attention.naive_attention`
computes, one [block x block] tile of scores at a time: the forward keeps a running row max,
row sum and output per query block (float32), and saves only the output and the float32
log-sum-exp of each row; the backward (`jax.custom_vjp`) recomputes each tile from them, first
dq per query block, then dk/dv per key/value block. Memory is O(L x block), never O(L^2); tiles
above the causal diagonal are skipped (a loop over j <= i). A length that is not a multiple of
`block` is padded: padded keys lie after every real query, so the causal mask hides them, and
padded queries are cut from the result.

Example:
    >>> q = jnp.ones((1, 5, 4, 8)); kv = jnp.ones((1, 5, 2, 8))
    >>> chunked_attention(q, kv, kv, None, 2).shape
    (1, 5, 4, 8)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

_F32 = jnp.float32
_MASKED = float(jnp.finfo(jnp.float32).min)


def _blocks(x_BxLx_: jax.Array, block: int) -> jax.Array:
    """[B, Lp, ...] -> [Lp / block, B, block, ...]."""
    b, lp = x_BxLx_.shape[:2]
    x = x_BxLx_.reshape(b, lp // block, block, *x_BxLx_.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _unblocks(x_NxBxCx_: jax.Array) -> jax.Array:
    """[N, B, block, ...] -> [B, N * block, ...]."""
    n, b, c = x_NxBxCx_.shape[:3]
    return jnp.moveaxis(x_NxBxCx_, 0, 1).reshape(b, n * c, *x_NxBxCx_.shape[3:])


def _tile_mask(i, j, seg_q_BxC, seg_k_BxC, block: int) -> jax.Array:
    """bool [B, 1, 1, Cq, Ck]: key j*block+s visible to query i*block+t (causal, same segment)."""
    rows = i * block + jnp.arange(block)
    cols = j * block + jnp.arange(block)
    causal_CxC = rows[:, None] >= cols[None, :]
    same_BxCxC = seg_q_BxC[:, :, None] == seg_k_BxC[:, None, :]
    return (causal_CxC & same_BxCxC)[:, None, None]


def _scores(q_BxCxGxRxK, k_BxCxGxK, mask, scale) -> jax.Array:
    """float32 [B, G, R, Cq, Ck] scores q.k / sqrt(d), masked entries at float32 min."""
    s = jnp.einsum("btgrk,bsgk->bgrts", q_BxCxGxRxK, k_BxCxGxK, preferred_element_type=_F32)
    return jnp.where(mask, s / scale, _MASKED)


def _forward(q_BxLxGxRxK, k_BxLxGxK, v_BxLxGxK, seg_BxL, block: int):
    """(out [B, Lp, G, R, K] in q's dtype, log-sum-exp float32 [Nq, B, G, R, block])."""
    scale = jnp.sqrt(jnp.float32(q_BxLxGxRxK.shape[-1]))
    qs, ks, vs, segs = (_blocks(a, block) for a in (q_BxLxGxRxK, k_BxLxGxK, v_BxLxGxK, seg_BxL))
    _, b, c, g, r, d = qs.shape

    def query_block(i):
        q, seg_q = qs[i], segs[i]

        def step(j, carry):
            m, l, acc = carry
            mask = _tile_mask(i, j, seg_q, segs[j], block)
            s = _scores(q, ks[j], mask, scale)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum("bgrts,bsgk->bgrtk", p.astype(vs.dtype), vs[j],
                            preferred_element_type=_F32)  # fmt: skip
            return m_new, l * alpha + p.sum(axis=-1), acc * alpha[..., None] + pv

        init = (jnp.full((b, g, r, c), _MASKED, _F32), jnp.zeros((b, g, r, c), _F32),
                jnp.zeros((b, g, r, c, d), _F32))  # fmt: skip
        m, l, acc = jax.lax.fori_loop(0, i + 1, step, init)
        out = (acc / l[..., None]).astype(q_BxLxGxRxK.dtype)
        return jnp.einsum("bgrtk->btgrk", out), m + jnp.log(l)

    outs, lse = jax.lax.map(query_block, jnp.arange(qs.shape[0]))
    return _unblocks(outs), lse


def _backward(block: int, res, dout_BxLxGxRxK):
    q_BxLxGxRxK, k_BxLxGxK, v_BxLxGxK, seg_BxL, out_BxLxGxRxK, lse = res
    scale = jnp.sqrt(jnp.float32(q_BxLxGxRxK.shape[-1]))
    delta = jnp.einsum("blgrk,blgrk->bgrl", dout_BxLxGxRxK.astype(_F32),
                       out_BxLxGxRxK.astype(_F32))  # fmt: skip
    qs, ks, vs, segs, dos = (
        _blocks(a, block) for a in (q_BxLxGxRxK, k_BxLxGxK, v_BxLxGxK, seg_BxL, dout_BxLxGxRxK)
    )
    deltas = jnp.moveaxis(delta.reshape(*delta.shape[:3], -1, block), 3, 0)
    n = qs.shape[0]

    def tile(i, j):
        """(p, ds) float32 [B, G, R, Cq, Ck] of query block i and key/value block j."""
        mask = _tile_mask(i, j, segs[i], segs[j], block)
        s = _scores(qs[i], ks[j], mask, scale)
        p = jnp.where(mask, jnp.exp(s - lse[i][..., None]), 0.0)
        dp = jnp.einsum("btgrk,bsgk->bgrts", dos[i], vs[j], preferred_element_type=_F32)
        return p, p * (dp - deltas[i][..., None])

    def dq_block(i):
        def step(j, dq):
            _, ds = tile(i, j)
            return dq + jnp.einsum("bgrts,bsgk->btgrk", ds, ks[j].astype(_F32)) / scale

        return jax.lax.fori_loop(0, i + 1, step, jnp.zeros(qs.shape[1:], _F32))

    def dkv_block(j):
        def step(i, carry):
            dk, dv = carry
            p, ds = tile(i, j)
            dv = dv + jnp.einsum("bgrts,btgrk->bsgk", p, dos[i].astype(_F32))
            return dk + jnp.einsum("bgrts,btgrk->bsgk", ds, qs[i].astype(_F32)) / scale, dv

        zeros = jnp.zeros(ks.shape[1:], _F32)
        return jax.lax.fori_loop(j, n, step, (zeros, zeros))

    dq = _unblocks(jax.lax.map(dq_block, jnp.arange(n)))
    dk, dv = (_unblocks(x) for x in jax.lax.map(dkv_block, jnp.arange(n)))
    return (dq.astype(qs.dtype), dk.astype(ks.dtype), dv.astype(vs.dtype), None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q_BxLxGxRxK, k_BxLxGxK, v_BxLxGxK, seg_BxL, block: int, name: str | None):
    return _forward(q_BxLxGxRxK, k_BxLxGxK, v_BxLxGxK, seg_BxL, block)[0]


def _flash_fwd(q_BxLxGxRxK, k_BxLxGxK, v_BxLxGxK, seg_BxL, block: int, name: str | None):
    out, lse = _forward(q_BxLxGxRxK, k_BxLxGxK, v_BxLxGxK, seg_BxL, block)
    if name is not None:  # what a jax.checkpoint policy keeping `name` saves instead of recomputing
        out, lse = checkpoint_name(out, name), checkpoint_name(lse, name)
    return out, (q_BxLxGxRxK, k_BxLxGxK, v_BxLxGxK, seg_BxL, out, lse)


def _flash_bwd(block: int, name: str | None, res, dout):
    del name
    return _backward(block, res, dout)


_flash.defvjp(_flash_fwd, _flash_bwd)


def chunked_attention(
    q_BxLxHxK: jax.Array,
    k_BxLxGxK: jax.Array,
    v_BxLxGxK: jax.Array,
    segment_ids_BxL: jax.Array | None,
    block: int,
    residual_name: str | None = None,
) -> jax.Array:
    """Causal attention of `attention.naive_attention`, computed in [block x block] tiles.

    Args:
        q_BxLxHxK: queries; each of the G kv heads serves H/G consecutive query heads.
        k_BxLxGxK, v_BxLxGxK: keys and values (same dtype as q).
        segment_ids_BxL: int document ids (a query sees only keys of its own document), or None.
        block: tile size along the sequence (> 0); L is padded up to a multiple of it.
        residual_name: `checkpoint_name` of the output and log-sum-exp the backward reads (a
            remat policy that keeps the name does not recompute the forward), or None.

    Returns:
        [B, L, H, K] in q's dtype. Scores, softmax statistics and accumulators are float32; the
        probabilities are cast to v's dtype for the PV product, as in `naive_attention`.
    """
    if block < 1:
        raise ValueError(f"model.attention_block must be >= 1, got {block}")
    b, l, h, d = q_BxLxHxK.shape
    g = k_BxLxGxK.shape[2]
    block = min(block, l)
    pad = -l % block
    seg = jnp.zeros((b, l), jnp.int32) if segment_ids_BxL is None else segment_ids_BxL
    widths = ((0, 0), (0, pad), (0, 0), (0, 0))
    q = jnp.pad(q_BxLxHxK, widths).reshape(b, l + pad, g, h // g, d)
    k, v = jnp.pad(k_BxLxGxK, widths), jnp.pad(v_BxLxGxK, widths)
    seg = jnp.pad(seg.astype(jnp.int32), ((0, 0), (0, pad)), constant_values=-1)
    out = _flash(q, k, v, seg, block, residual_name)
    return out.reshape(b, l + pad, h, d)[:, :l]
