"""The recipe written plainly with nvfp4_format, for the tests (2-D: x[M, K], w[K, N], dy[M, N]).

Independent of nvfp4_ops's code paths: its own Hadamard matrix, its own random bits, its own
canonical layouts. Arrays carry a leading batch axis of 1 where nvfp4_ops's canonical form does,
so both sides run the same XLA dot (bit-exact comparisons).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import nvfp4_format as nf

SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.float32)
LAST = (((2,), (2,)), ((0,), (0,)))


def hadamard16() -> np.ndarray:
    h = np.array([[1.0]], np.float32)
    for _ in range(4):
        h = np.block([[h, h], [h, -h]])
    return (SIGNS[:, None] * h / 4.0).astype(np.float32)


def rotate(x_rows_by_tokens: jax.Array) -> jax.Array:
    """Tile-wise v @ H along the last axis."""
    *lead, m = x_rows_by_tokens.shape
    tiles = x_rows_by_tokens.astype(jnp.float32).reshape(*lead, m // 16, 16)
    out = jnp.matmul(tiles, jnp.asarray(hadamard16()), precision=jax.lax.Precision.HIGHEST)
    return out.reshape(*lead, m)


def uniform8(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    n = int(np.prod(shape))
    words = jax.random.bits(key, (n // 4,), jnp.uint32)
    b = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(shape)
    return (b.astype(jnp.float32) + 0.5) / 256.0


def dq(a) -> jax.Array:
    return nf.dequantize(a, jnp.float32)


def dot_last(a: jax.Array, b: jax.Array) -> jax.Array:
    return jax.lax.dot_general(
        a, b, LAST, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )


def fprop(x, w, w_block=(16, 16)):
    """Y[1, M, N] = deq(Q(x, 1x16)) . deq(Q(w^T, w_block)) and the two quantized operands."""
    qx = nf.quantize(x[None], (1, 16))
    qw = nf.quantize(w.T[None], w_block)
    return dot_last(dq(qx), dq(qw)), qx, qw


def dgrad(dy, w, key, *, stochastic=True):
    """dX[1, M, K] with dY 1x16 (SR) and the 16x16-tiled W of Fprop."""
    ks = jax.random.split(key, 6)
    u = uniform8(ks[2], (1, *dy.shape)) if stochastic else None
    qdy = nf.quantize(dy[None], (1, 16), rounding="stochastic" if stochastic else "rne", uniform=u)
    qw = nf.quantize(w.T[None], (16, 16))
    return dot_last(dq(qdy), jnp.swapaxes(dq(qw), -1, -2)), qdy, qw


def wgrad(x, dy, key, *, rht=True, stochastic=True):
    """dW[1, K, N] from x^T and dy^T rotated along the tokens, quantized 1x16 along them.

    As in TransformerEngine, a BF16/FP16 operand's rotation is rounded back to its dtype before
    it is quantized; FP32 operands rotate in FP32.
    """
    ks = jax.random.split(key, 6)
    xt, dyt = x.T[None], dy.T[None]
    if rht:
        xt, dyt = rotate(xt).astype(_rotated_dtype(x)), rotate(dyt).astype(_rotated_dtype(dy))
    xt, dyt = xt.astype(jnp.float32), dyt.astype(jnp.float32)
    u = uniform8(ks[5], dyt.shape) if stochastic else None
    qxt = nf.quantize(xt, (1, 16))
    qdyt = nf.quantize(dyt, (1, 16), rounding="stochastic" if stochastic else "rne", uniform=u)
    return dot_last(dq(qxt), dq(qdyt)), qxt, qdyt, xt, dyt


def _rotated_dtype(a: jax.Array):
    return a.dtype if a.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32


def element_error_bound(q, *, stochastic: bool = False) -> jax.Array:
    """Per-element bound on |x - deq(q)| (derived in docs/ops.md, "Error bounds").

    With d = sb * s_dec the block's decode scale: RNE errs by at most half the widest grid gap
    (1 * d, the [4, 6] band) and clipping of the block max by at most 0.4 d (E4M3 rounding of sb is
    within 2^-4); stochastic rounding errs by less than a full gap (2 d). A block whose scale is
    E4M3-subnormal or zero can clip by up to 6 * s_dec * 2^-10 (half the subnormal spacing).
    """
    d = q.block_scales.astype(jnp.float32) * q.global_scale
    d = jnp.repeat(d, 16, axis=-1)
    floor = 6.0 * q.global_scale * 2.0**-10
    return jnp.maximum((2.0 if stochastic else 1.0) * d, floor)
