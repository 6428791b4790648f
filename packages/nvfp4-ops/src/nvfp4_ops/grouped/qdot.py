"""The recipe's three quantized GEMMs for grouped experts, as one `jax.custom_vjp`.

x [T, K] (rows sorted by group), w [E, K, N], group_sizes int32 [E]; K and N multiples of the
recipe's alignment. For each group g (rows x_g, weight W_e), exactly the dense recipe
(`nvfp4_ops.qdot`), operand by operand as `nvfp4_ops.gemm_table` describes it:

Fprop  y_g  = Q(x_g; along K)            . Q(W_e^T; 16x16 tiles, W_e's own tensor scale)
Dgrad  dx_g = Q(dY_g; along N, SR)       . the Fprop Q(W_e), reused transposed (2D / per tensor)
Wgrad  dW_e = Q(H x_g^T; along tokens)   . Q(H dY_g^T; along tokens, SR), over the group's tokens

Every outer (tensor) scale is per group: each expert's weight, and each group's activations and
gradients, from that group's amax. Each group is padded with zero rows to the alignment inside a
static buffer of ~T + E (a - 1) rows (`layout`), which is exactly the dense call's zero padding of
that group, so no block or RHT tile takes rows of two groups. Keys: group e uses
`fold_in(key, group_offset + e)`, split per operand as the dense call splits its key
(`random_bits`).

Residuals for the backward pass: the quantized x^T tiles for Wgrad, each expert's quantized Dgrad
weight, group_sizes, the key and the group offset; never a BF16/FP32 copy of x.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_ops.gemm_table import gemm_quantized, operand_quants, quantizations, rotated
from nvfp4_ops.grouped.gemm import GROUPED_GEMMS, rows_by_group
from nvfp4_ops.grouped.layout import GroupShape, from_tiles, group_layout, to_tiles
from nvfp4_ops.grouped.operands import quantize_tokens, quantize_weights
from nvfp4_ops.grouped.random_bits import expert_keys
from nvfp4_ops.qdot import named_residuals
from nvfp4_ops.recipe import Recipe


@dataclasses.dataclass(frozen=True)
class GroupedConfig:
    """Static settings of one grouped call (hashable, a `nondiff_argnums` value).

    `grad_dtype` is the dtype dY enters both backward GEMMs in: x's (as in `qdot.GemmConfig`).
    """

    recipe: Recipe
    backend: str
    out_dtype: np.dtype
    lhs_dtype: np.dtype
    rhs_dtype: np.dtype
    shape: GroupShape

    @property
    def grad_dtype(self) -> np.dtype:
        return self.lhs_dtype


def _unquantized_fprop(x_tiles, w, layout):
    """y_g = x_g . W_e in the operands' dtype, FP32 accumulation (`Recipe.bf16_fprop`), as the
    dense `qdot._unquantized_fprop` contracts [1, M, K] . [1, K, N]."""
    dims = (((2,), (1,)), ((0,), (0,)))

    def product(rows, e):
        w_e = jax.lax.dynamic_index_in_dim(w, e, keepdims=True)
        out = jax.lax.dot_general(rows[None], w_e, dims, preferred_element_type=jnp.float32)
        return out[0]

    tile = ((layout.shape.tile_rows, w.shape[2]), jnp.float32)
    with jax.named_scope("nvfp4/fprop_bf16"):
        return rows_by_group(x_tiles, layout, product, tile)


def _fwd(x, w, group_sizes, key, group_offset, cfg: GroupedConfig):
    recipe, gemms = cfg.recipe, GROUPED_GEMMS[cfg.backend]
    layout = group_layout(group_sizes, cfg.shape)
    ops, keys = operand_quants(recipe), expert_keys(key, cfg.shape.groups, group_offset)
    computed = {op.name for op in quantizations(recipe).values()}
    fprop_x, fprop_w, dgrad_w = ops["fprop_x"], ops["fprop_w"], ops["dgrad_w"]
    x_tiles = to_tiles(x, layout)
    qw = quantize_weights(fprop_w, w, keys) if fprop_w.name in computed else None
    if not gemm_quantized(recipe, "fprop"):
        y_tiles = _unquantized_fprop(x_tiles, w, layout)
    else:
        with jax.named_scope("nvfp4/fprop"):
            qx = quantize_tokens(fprop_x, x_tiles, layout, keys)
            y_tiles = gemms.rows(gemms.tokens(qx, fprop_x), gemms.weights(qw, fprop_w), layout)
    y = from_tiles(y_tiles, layout).astype(cfg.out_dtype)
    with jax.named_scope("nvfp4/save_residuals"):
        qw_dgrad = qw if dgrad_w.reuses else quantize_weights(dgrad_w, w, keys)
        qxt = _wgrad_input(ops["wgrad_x"], x_tiles, layout, keys)
    return y, (*named_residuals((qxt, qw_dgrad)), group_sizes, key, group_offset)


def _wgrad_input(op, x_tiles, layout, keys) -> Any:
    """x^T tiles [tiles, K, a], rotated along the tokens and quantized (a "bf16" role: x^T
    unrotated, rotated in the backward pass as the dense custom_vjp does)."""
    if not op.tq.quantized:
        return jnp.swapaxes(x_tiles, -1, -2)
    return quantize_tokens(op, x_tiles, layout, keys)


def _bwd(cfg: GroupedConfig, residuals, dy):
    recipe, gemms = cfg.recipe, GROUPED_GEMMS[cfg.backend]
    qxt, qw_dgrad, group_sizes, key, group_offset = residuals
    layout = group_layout(group_sizes, cfg.shape)
    ops, keys = operand_quants(recipe), expert_keys(key, cfg.shape.groups, group_offset)
    dgrad_dy, dgrad_w = ops["dgrad_dy"], ops["dgrad_w"]
    wgrad_x, wgrad_dy = ops["wgrad_x"], ops["wgrad_dy"]
    dy_tiles = to_tiles(dy.astype(cfg.grad_dtype), layout)
    with jax.named_scope("nvfp4/dgrad"):
        qdy = quantize_tokens(dgrad_dy, dy_tiles, layout, keys)
        reused = dgrad_w.reuses is not None
        w_dgrad = gemms.weights(qw_dgrad, ops[dgrad_w.reuses or "dgrad_w"], reused)
        dx_tiles = gemms.rows(gemms.tokens(qdy, dgrad_dy), w_dgrad, layout)
    with jax.named_scope("nvfp4/wgrad"):
        qdyt = quantize_tokens(wgrad_dy, dy_tiles, layout, keys)
        xt = qxt if wgrad_x.tq.quantized else rotated(wgrad_x, qxt)
        dw = gemms.wgrad(gemms.tokens(xt, wgrad_x), gemms.tokens(qdyt, wgrad_dy), layout)
    dx = from_tiles(dx_tiles, layout)
    return dx.astype(cfg.lhs_dtype), dw.astype(cfg.rhs_dtype), None, None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def grouped_quantized_dot(x, w, group_sizes, key, group_offset, cfg: GroupedConfig) -> jax.Array:
    """y [T, N] = x [T, K] . w[group] through the recipe's quantized GEMMs, group by group;
    `group_offset` (int32 scalar): the global index of group 0, for the keys."""
    return _fwd(x, w, group_sizes, key, group_offset, cfg)[0]


grouped_quantized_dot.defvjp(_fwd, _bwd)
