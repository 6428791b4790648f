"""GEMM blocks of several tiles (`grouped.blocks`), which the small shapes of test_grouped.py never
form (there every block is one tile).

T = 320 rows, E = 4, groups of 150, 0, 20 and 97 rows: 23 tiles, blocks of m = 2 tiles, so group 0
spans 5 blocks, group 2 one, group 3 four (its last block half empty), and 3 blocks are past the
groups. The emulated rows are the dense GEMM bit for bit and its Wgrad (one window per group) too;
the "xla" GEMMs (BF16 values, per-row outer scales, Wgrad as per-block partial sums) agree with
them up to FP32 summation order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_ops.grouped.gemm import emulated_rows, emulated_wgrad, xla_rows, xla_wgrad
from nvfp4_ops.grouped.layout import GroupShape, from_tiles, group_layout, to_tiles
from nvfp4_ops.grouped.operands import ScaledOperand

F32 = jnp.float32
SHAPE = GroupShape(320, 4, 16)
SIZES = (150, 0, 20, 97)
C, Q = 48, 32


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint32)


def _operands():
    ka, kb, kc, kd = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(ka, (SHAPE.tokens, C), F32).astype(jnp.bfloat16)
    dy = jax.random.normal(kb, (SHAPE.tokens, Q), F32).astype(jnp.bfloat16)
    w_t = jax.random.normal(kc, (SHAPE.groups, Q, C), F32).astype(jnp.bfloat16)  # [Q, C] each
    row_scale = jnp.exp2(jax.random.randint(kd, (SHAPE.tokens, 1), -3, 4)).astype(F32)
    return x, dy, w_t, row_scale


@jax.jit
def _both(x, dy, w_t, row_scale, sizes):
    """(emulated y, dw), (xla y, dw) on the same values: x's rows scaled by `row_scale` (in the
    decoded values for emulated, as the outer scale for xla)."""
    layout = group_layout(sizes, SHAPE)
    x_tiles, dy_tiles, s_tiles = (to_tiles(v, layout) for v in (x, dy, row_scale))
    decoded = x_tiles.astype(F32) * s_tiles
    xt, dyt = jnp.swapaxes(decoded, 1, 2), jnp.swapaxes(dy_tiles, 1, 2).astype(F32)
    emulated = (
        from_tiles(emulated_rows(decoded, w_t.astype(F32), layout), layout),
        emulated_wgrad(xt, dyt, layout),
    )
    ones = lambda v: jnp.ones((*v.shape[:-1], 1), F32)  # noqa: E731
    lhs = ScaledOperand(x_tiles, s_tiles)
    rhs = ScaledOperand(w_t, ones(w_t))
    tokens = ScaledOperand(xt.astype(jnp.bfloat16), ones(xt))  # exact: powers of two
    grads = ScaledOperand(jnp.swapaxes(dy_tiles, 1, 2), ones(jnp.swapaxes(dy_tiles, 1, 2)))
    xla = (from_tiles(xla_rows(lhs, rhs, layout), layout), xla_wgrad(tokens, grads, layout))
    return emulated, xla


def test_blocks_of_several_tiles_are_the_dense_gemm_bit_for_bit_and_xla_agrees():
    assert (SHAPE.tiles, SHAPE.block_tiles, SHAPE.blocks) == (23, 2, 13)
    x, dy, w_t, row_scale = _operands()
    (y, dw), (y_xla, dw_xla) = _both(x, dy, w_t, row_scale, jnp.array(SIZES, jnp.int32))
    last = (((2,), (2,)), ((0,), (0,)))
    dense = jax.jit(lambda a, b: jax.lax.dot_general(
        a[None], b[None], last, precision=jax.lax.Precision.HIGHEST, preferred_element_type=F32
    )[0])  # fmt: skip
    start = 0
    for e, g in enumerate(SIZES):
        padded = -(-g // 16) * 16
        xg = jnp.pad((x.astype(F32) * row_scale)[start : start + g], ((0, padded - g), (0, 0)))
        dyg = jnp.pad(dy.astype(F32)[start : start + g], ((0, padded - g), (0, 0)))
        want_y, want_dw = dense(xg, w_t[e].astype(F32)), dense(xg.T, dyg.T)
        assert np.array_equal(_bits(y[start : start + g]), _bits(want_y[:g])), e
        assert np.array_equal(_bits(dw[e]), _bits(want_dw)), e
        start += g
    assert np.all(np.asarray(y[start:]) == 0) and np.all(np.asarray(dw[1]) == 0)
    # xla: the same products (exact in BF16, powers of two as outer scales), summed in another
    # order (the Wgrad of groups 0 and 3 as sums of 5 and 4 block products).
    ax = np.abs(np.asarray(x, np.float64)) * np.asarray(row_scale)
    ady, aw = (np.abs(np.asarray(v, np.float64)) for v in (dy, w_t))
    magnitude = {"y": max(np.max(ax @ w.T) for w in aw), "dw": np.max(ax.T @ ady)}
    for got, want, name in ((y_xla, y, "y"), (dw_xla, dw, "dw")):
        err = np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)))
        assert err <= 2 * 160 * 2.0**-24 * magnitude[name], (name, err)  # 2 K u, K <= 160
    assert np.any(_bits(dw_xla[0]) != _bits(dw[0]))  # really summed in another order
