"""A grouped call of a recipe that quantizes nothing ("bf16").

The dense `dot_general` of such a recipe is `lax.dot_general(x, w)` with JAX's own gradients. Its
grouped counterpart runs, for each group, the very `dot_general`s that the dense call and JAX's
transpose rules of `dot_general` run (same dimension numbers, `preferred_element_type` and output
dtypes), on the group's rows in the padded buffer (`gemm.rows_by_group`, `gemm.by_group`; groups
padded to 16 rows, which changes none of these sums; a one-row group's row is a one-row product,
as in its dense call):

  y_g  = dot_general(x_g, W_e, ((1,), (0,)))                       (then the output dtype)
  dx_g = dot_general(dY_g, W_e, ((1,), (1,))) -> x's dtype
  dW_e = dot_general(dY_g, x_g, ((0,), (0,)))^T -> w's dtype

so that it equals a loop of dense calls bit for bit under the same assumptions as the quantized
GEMMs (`nvfp4_ops.grouped.gemm`), as batched GEMMs with no loop. `backend="xla"`
(`PlainConfig.blocked`) computes dW_e instead as per-block products in float32 summed per group
(`gemm.by_block`: less work than one window per group, < 1.25x one dense call, equal up to the
FP32 summation order and one rounding to w's dtype).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_ops.grouped.gemm import by_block, by_group, rows_by_group
from nvfp4_ops.grouped.layout import GroupShape, from_tiles, group_layout, to_tiles

_FPROP = (((1,), (0,)), ((), ()))
_DGRAD = (((1,), (1,)), ((), ()))
_WGRAD = (((0,), (0,)), ((), ()))


@dataclasses.dataclass(frozen=True)
class PlainConfig:
    """Static settings: `preferred_element_type` as given (None: the operands' promoted dtype),
    the dtypes of x, w and the output, the groups' `GroupShape`, and whether dW is summed over
    blocks (`gemm.by_block`, the "xla" backend) rather than one window per group."""

    preferred: np.dtype | None
    lhs_dtype: np.dtype
    rhs_dtype: np.dtype
    out_dtype: np.dtype
    shape: GroupShape
    blocked: bool = False


def _rows(tiles, w, layout, dims, cfg: PlainConfig, q: int, dtype):
    def product(rows, e):
        w_e = jax.lax.dynamic_index_in_dim(w, e, keepdims=False)
        return jax.lax.dot_general(rows, w_e, dims, preferred_element_type=cfg.preferred)

    tile = ((layout.shape.tile_rows, q), dtype)
    return rows_by_group(tiles, layout, product, tile)


def _fwd(x, w, group_sizes, cfg: PlainConfig):
    layout = group_layout(group_sizes, cfg.shape)
    y_tiles = _rows(to_tiles(x, layout), w, layout, _FPROP, cfg, w.shape[2], cfg.out_dtype)
    return from_tiles(y_tiles, layout), (x, w, group_sizes)


def _bwd(cfg: PlainConfig, residuals, dy):
    x, w, group_sizes = residuals
    layout = group_layout(group_sizes, cfg.shape)
    x_tiles, dy_tiles = to_tiles(x, layout), to_tiles(dy, layout)
    grad_dtype = jax.eval_shape(
        lambda a, b: jax.lax.dot_general(a, b, _DGRAD, preferred_element_type=cfg.preferred),
        dy_tiles[0],
        w[0],
    ).dtype
    dx_tiles = _rows(dy_tiles, w, layout, _DGRAD, cfg, w.shape[1], grad_dtype)

    preferred = jnp.float32 if cfg.blocked else cfg.preferred  # partial sums stay FP32

    def weight_grad(dy_win, x_win):
        rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
        out = jax.lax.dot_general(
            rows(dy_win), rows(x_win), _WGRAD, preferred_element_type=preferred
        )
        return out.T if cfg.blocked else out.T.astype(cfg.rhs_dtype)

    summed = by_block if cfg.blocked else by_group
    dw = summed(dy_tiles, x_tiles, layout, weight_grad, ((w.shape[1], w.shape[2]), w.dtype))
    return from_tiles(dx_tiles, layout).astype(cfg.lhs_dtype), dw, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_plain_dot(x, w, group_sizes, cfg: PlainConfig) -> jax.Array:
    """y [T, N] = x [T, K] . w[group] as `lax.dot_general` per group (module docstring)."""
    return _fwd(x, w, group_sizes, cfg)[0]


grouped_plain_dot.defvjp(_fwd, _bwd)
