"""The recipe's three quantized GEMMs as one `jax.custom_vjp` on canonical operands.

x: [B, M, K] activations, w: [B, K, N] weight, M, K, N multiples of `recipe.alignment`.
Fprop  y  = Q(x; fprop_input, along K)  . Q(w^T; fprop_weight, along K)
Dgrad  dx = Q(dy; grad, along N)        . W as quantized for Dgrad (the Fprop W if 2D/per-tensor)
Wgrad  dw = Q(H x^T; fprop_input, along M) . Q(H dy^T; grad, along M)   (H: RHT along M, optional;
       H x^T is rounded to x's dtype when that is BF16/FP16, as TransformerEngine does)
dY enters both backward GEMMs in x's dtype (`GemmConfig.grad_dtype`), as with TransformerEngine,
whose dense layer returns and receives its input's dtype: for BF16 activations both rotated Wgrad
operands are rounded to BF16, whatever the weight's dtype, `preferred_element_type` or the dtype
of the arriving cotangent. The residuals saved for
the backward pass are the quantized W for Dgrad and the rotated,
quantized x^T for Wgrad (packed FP4 codes + scales), never a BF16/FP32 copy of x.
With `recipe.bf16_fprop` the Fprop GEMM is y = x . w on the unquantized operands (FP32
accumulation) and everything saved for the backward pass is computed exactly as without the flag.

Which tensor is quantized how, in which orientation, with which key, and which quantization is
reused, is read from `nvfp4_ops.gemm_table` (the same table `nvfp4_ops.telemetry` reads).
Stochastic-rounding keys: `jax.random.split(key, 6)` gives, in order, the keys for
[fprop x, fprop w, dgrad dy, dgrad w (re-quantized 1D weights), wgrad x, wgrad dy] (`KEY_SLOTS`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from nvfp4_ops.gemm import GEMMS
from nvfp4_ops.gemm_table import (
    KEY_SLOTS,
    OperandQuant,
    gemm_quantized,
    operand_quants,
    operand_view,
    oriented,
    quantizations,
    rotated,
    split_keys,
    wgrad_rotation,
)
from nvfp4_ops.quantizers import quantize_operand
from nvfp4_ops.recipe import Recipe, TensorQuant

__all__ = [
    "KEY_SLOTS",
    "RESIDUAL_NAME",
    "GemmConfig",
    "computed_once",
    "dgrad_weight_quant",
    "named_residuals",
    "prequantized_dot",
    "quantized_dot",
    "split_keys",
    "wgrad_rotation",
]

RESIDUAL_NAME = "nvfp4_residual"
"""`jax.ad_checkpoint.checkpoint_name` of every array saved for the backward pass (the quantized
Wgrad input and Dgrad weight: packed codes, block scales, global scale), so that a remat policy
can keep exactly these, e.g. `jax.checkpoint_policies.save_only_these_names(RESIDUAL_NAME)`."""


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Static settings of one quantized dot_general (hashable, a `nondiff_argnums` value)."""

    recipe: Recipe
    backend: str
    out_dtype: np.dtype
    lhs_dtype: np.dtype
    rhs_dtype: np.dtype

    @property
    def grad_dtype(self) -> np.dtype:
        """The dtype dY enters both backward GEMMs in: the activation's (lhs), as TE's dense layer
        receives its gradient in its input's dtype. The cotangent is rounded to it first, and the
        rotated dY^T of Wgrad is rounded to it as the rotated x^T is (`wgrad_rotation`)."""
        return self.lhs_dtype


def dgrad_weight_quant(recipe: Recipe) -> tuple[TensorQuant, bool]:
    """(settings of W in Dgrad, whether the Fprop quantization is reused transposed)."""
    w = operand_quants(recipe)["dgrad_w"]
    return w.tq, w.reuses is not None


def computed_once(x: jax.Array) -> jax.Array:
    """`x` unchanged, but on CPU computed into memory before its consumers read it.

    The incoming gradient feeds the Dgrad quantization and, through a transpose, the Wgrad one.
    XLA:CPU drops `optimization_barrier`s and fuses a cheap producer chain into every consumer:
    in an MLP the whole gelu backward ran inside the transposing copy for Wgrad (reading five
    arrays transposed, ~150 of 520 ms at 2048 tokens). XLA cannot fuse across a while loop whose
    trip count it cannot see, so `x` goes through one that runs zero times (once if x's first
    element is NaN) and whose body cannot change it (the select never picks -x). On other
    platforms `x` is returned as is.
    """
    if jax.default_backend() != "cpu":
        return x
    trips = jnp.isnan(x.reshape(-1)[0]).astype(jnp.int32)

    def body(carry):
        v, i = carry
        return jnp.where(i > trips, -v, v), i + 1

    return jax.lax.while_loop(lambda c: c[1] < trips, body, (x, jnp.int32(0)))[0]


def _quantized(op: OperandQuant, tensor: jax.Array, keys: dict[str, Any]) -> Any:
    """`tensor` (x, w or dY) oriented, rotated and quantized as the table says for `op`."""
    return quantize_operand(operand_view(op, tensor), op.tq, keys[op.key_slot])


def _wgrad_input(x_bmk: jax.Array, op: OperandQuant, keys: dict[str, Any]) -> Any:
    """x^T [B, K, M], rotated along M and quantized along M (a "bf16" role keeps x unrotated)."""
    if not op.tq.quantized:
        return oriented(op, x_bmk)
    return _quantized(op, x_bmk, keys)


def _unquantized_fprop(x_bmk: jax.Array, w_bkn: jax.Array) -> jax.Array:
    """y = x . w in the operands' dtype with FP32 accumulation (the `bf16_fprop` forward)."""
    with jax.named_scope("nvfp4/fprop_bf16"):
        dims = (((2,), (1,)), ((0,), (0,)))
        return jax.lax.dot_general(x_bmk, w_bkn, dims, preferred_element_type=jnp.float32)


def _fwd(x, w, key, cfg: GemmConfig):
    recipe, gemm = cfg.recipe, GEMMS[cfg.backend]
    ops, keys = operand_quants(recipe), split_keys(key)
    computed = {op.name for op in quantizations(recipe).values()}
    fprop_x, fprop_w, dgrad_w = ops["fprop_x"], ops["fprop_w"], ops["dgrad_w"]
    qw = _quantized(fprop_w, w, keys) if fprop_w.name in computed else None
    if not gemm_quantized(recipe, "fprop"):
        y = _unquantized_fprop(x, w).astype(cfg.out_dtype)
    else:
        with jax.named_scope("nvfp4/fprop"):
            qx = _quantized(fprop_x, x, keys)
            y = gemm(qx, fprop_x.tq, qw, fprop_w.tq).astype(cfg.out_dtype)
    with jax.named_scope("nvfp4/save_residuals"):
        qw_dgrad = qw if dgrad_w.reuses else _quantized(dgrad_w, w, keys)
        qxt = _wgrad_input(x, ops["wgrad_x"], keys)
    return y, (*named_residuals((qxt, qw_dgrad)), key)


def named_residuals(tree: Any) -> Any:
    """`tree` with every array leaf named `RESIDUAL_NAME` for remat policies (values unchanged)."""
    return jax.tree.map(lambda a: checkpoint_name(a, RESIDUAL_NAME), tree)


def _bwd(cfg: GemmConfig, residuals, dy):
    recipe, gemm = cfg.recipe, GEMMS[cfg.backend]
    qxt, qw_dgrad, key = residuals
    ops, keys = operand_quants(recipe), split_keys(key)
    dgrad_dy, dgrad_w = ops["dgrad_dy"], ops["dgrad_w"]
    wgrad_x, wgrad_dy = ops["wgrad_x"], ops["wgrad_dy"]
    dy = computed_once(dy.astype(cfg.grad_dtype))
    with jax.named_scope("nvfp4/dgrad"):
        qdy = _quantized(dgrad_dy, dy, keys)
        dx = gemm(qdy, dgrad_dy.tq, qw_dgrad, dgrad_w.tq, b_transposed=dgrad_w.reuses is not None)
    with jax.named_scope("nvfp4/wgrad"):
        dyt = _quantized(wgrad_dy, dy, keys)
        xt = qxt if wgrad_x.tq.quantized else rotated(wgrad_x, qxt)
        dw = gemm(xt, wgrad_x.tq, dyt, wgrad_dy.tq)
    return dx.astype(cfg.lhs_dtype), dw.astype(cfg.rhs_dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def quantized_dot(x: jax.Array, w: jax.Array, key: jax.Array | None, cfg: GemmConfig) -> jax.Array:
    """y[B, M, N] = x[B, M, K] . w[B, K, N] through the recipe's quantized GEMMs."""
    return _fwd(x, w, key, cfg)[0]


quantized_dot.defvjp(_fwd, _bwd)


def _prequantized_fwd(x, w, qw, key, cfg: GemmConfig):
    """`_fwd` with the Fprop weight quantization `qw` given (w itself is not read)."""
    del w
    recipe, gemm = cfg.recipe, GEMMS[cfg.backend]
    ops, keys = operand_quants(recipe), split_keys(key)
    fprop_x, fprop_w = ops["fprop_x"], ops["fprop_w"]
    with jax.named_scope("nvfp4/fprop"):
        qx = _quantized(fprop_x, x, keys)
        y = gemm(qx, fprop_x.tq, qw, fprop_w.tq).astype(cfg.out_dtype)
    with jax.named_scope("nvfp4/save_residuals"):
        qxt = _wgrad_input(x, ops["wgrad_x"], keys)
    return y, (*named_residuals((qxt, qw)), key)


def _prequantized_bwd(cfg: GemmConfig, residuals, dy):
    dx, dw, _ = _bwd(cfg, residuals, dy)
    return dx, dw, None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def prequantized_dot(
    x: jax.Array, w: jax.Array, qw: Any, key: jax.Array | None, cfg: GemmConfig
) -> jax.Array:
    """`quantized_dot` with W's Fprop quantization `qw` (w^T [B, N, K]) computed by the caller.

    Fprop and Dgrad read `qw` (the recipe must reuse the Fprop weight in Dgrad: 16x16 tiles);
    `w` [B, K, N] is never read, it only receives the weight gradient, the recipe's Wgrad (from
    x and dY), exactly `quantized_dot`'s. `qw` gets no gradient.
    """
    return _prequantized_fwd(x, w, qw, key, cfg)[0]


prequantized_dot.defvjp(_prequantized_fwd, _prequantized_bwd)
