"""The recipe's three quantized GEMMs as one `jax.custom_vjp` on canonical operands.

x: [B, M, K] activations, w: [B, K, N] weight, M, K, N multiples of `recipe.alignment`.
Fprop  y  = Q(x; fprop_input, along K)  . Q(w^T; fprop_weight, along K)
Dgrad  dx = Q(dy; grad, along N)        . W as quantized for Dgrad (the Fprop W if 2D/per-tensor)
Wgrad  dw = Q(H x^T; fprop_input, along M) . Q(H dy^T; grad, along M)   (H: RHT along M, optional;
       H x^T is rounded to x's dtype when that is BF16/FP16, as TransformerEngine does)
dY enters both backward GEMMs in the compute dtype (the promoted dtype of x and w), as with
TransformerEngine, whose dense layer returns and receives the input dtype. The residuals saved for
the backward pass are the quantized W for Dgrad and the rotated,
quantized x^T for Wgrad (packed FP4 codes + scales), never a BF16/FP32 copy of x.
With `recipe.bf16_fprop` the Fprop GEMM is y = x . w on the unquantized operands (FP32
accumulation) and everything saved for the backward pass is computed exactly as without the flag.

Stochastic-rounding keys: `jax.random.split(key, 6)` gives, in order, the keys for
[fprop x, fprop w, dgrad dy, dgrad w (re-quantized 1D weights), wgrad x, wgrad dy].
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
from nvfp4_ops.hadamard import hadamard_transform
from nvfp4_ops.quantizers import quantize_operand
from nvfp4_ops.recipe import Recipe, TensorQuant

KEY_SLOTS = ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_x", "wgrad_dy")
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
    def compute_dtype(self) -> np.dtype:
        """The promoted dtype of lhs and rhs: the dtype dY enters the backward GEMMs in."""
        return np.dtype(jnp.result_type(self.lhs_dtype, self.rhs_dtype))


def split_keys(key: jax.Array | None) -> dict[str, jax.Array | None]:
    """The per-GEMM stochastic-rounding keys (see the module docstring for the order)."""
    if key is None:
        return dict.fromkeys(KEY_SLOTS)
    return dict(zip(KEY_SLOTS, jax.random.split(key, len(KEY_SLOTS)), strict=True))


def dgrad_weight_quant(recipe: Recipe) -> tuple[TensorQuant, bool]:
    """(settings of W in Dgrad, whether the Fprop quantization is reused transposed)."""
    w = recipe.fprop_weight
    if w.is_2d or w.block_shape is None:
        return w, True
    return w, False


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


def wgrad_rotation(x: jax.Array, recipe: Recipe) -> jax.Array:
    """A Wgrad operand [..., tokens] rotated by the recipe's RHT along the tokens (or unchanged).

    The rotation is computed in float32 and then rounded to `x`'s dtype when that is narrower
    (BF16, FP16), before any amax is taken: TransformerEngine's reference quantizer rotates in
    the operand's dtype and its fused kernel (BF16 input only) rounds the same way, so the Wgrad
    codes and scales are TE's bit for bit. A float32 operand stays float32 (TE's kernels have no
    FP32 RHT; its reference then rotates in FP32 too, up to summation order).
    """
    if not recipe.wgrad_hadamard:
        return x
    rotated = hadamard_transform(x, axis=-1, size=recipe.hadamard_size)
    if jnp.finfo(x.dtype).bits < 32:
        return rotated.astype(x.dtype)
    return rotated


def _wgrad_input(x_bmk: jax.Array, recipe: Recipe, key: jax.Array | None) -> Any:
    """x^T [B, K, M], rotated along M and quantized along M (a "bf16" role keeps x unrotated)."""
    xt = jnp.swapaxes(x_bmk, -1, -2)
    if not recipe.fprop_input.quantized:
        return xt
    return quantize_operand(wgrad_rotation(xt, recipe), recipe.fprop_input, key)


def _unquantized_fprop(x_bmk: jax.Array, w_bkn: jax.Array) -> jax.Array:
    """y = x . w in the operands' dtype with FP32 accumulation (the `bf16_fprop` forward)."""
    with jax.named_scope("nvfp4/fprop_bf16"):
        dims = (((2,), (1,)), ((0,), (0,)))
        return jax.lax.dot_general(x_bmk, w_bkn, dims, preferred_element_type=jnp.float32)


def _fwd(x, w, key, cfg: GemmConfig):
    recipe, gemm = cfg.recipe, GEMMS[cfg.backend]
    keys = split_keys(key)
    wq, reuse = dgrad_weight_quant(recipe)
    qw = None
    if reuse or not recipe.bf16_fprop:
        qw = quantize_operand(jnp.swapaxes(w, -1, -2), recipe.fprop_weight, keys["fprop_w"])
    if recipe.bf16_fprop:
        y = _unquantized_fprop(x, w).astype(cfg.out_dtype)
    else:
        with jax.named_scope("nvfp4/fprop"):
            qx = quantize_operand(x, recipe.fprop_input, keys["fprop_x"])
            y = gemm(qx, recipe.fprop_input, qw, recipe.fprop_weight).astype(cfg.out_dtype)
    with jax.named_scope("nvfp4/save_residuals"):
        qw_dgrad = qw if reuse else quantize_operand(w, wq, keys["dgrad_w"])
        qxt = _wgrad_input(x, recipe, keys["wgrad_x"])
    return y, (*named_residuals((qxt, qw_dgrad)), key)


def named_residuals(tree: Any) -> Any:
    """`tree` with every array leaf named `RESIDUAL_NAME` for remat policies (values unchanged)."""
    return jax.tree.map(lambda a: checkpoint_name(a, RESIDUAL_NAME), tree)


def _bwd(cfg: GemmConfig, residuals, dy):
    recipe, gemm = cfg.recipe, GEMMS[cfg.backend]
    qxt, qw_dgrad, key = residuals
    keys = split_keys(key)
    wq, reuse = dgrad_weight_quant(recipe)
    dy = computed_once(dy.astype(cfg.compute_dtype))
    with jax.named_scope("nvfp4/dgrad"):
        qdy = quantize_operand(dy, recipe.grad, keys["dgrad_dy"])
        dx = gemm(qdy, recipe.grad, qw_dgrad, wq, b_transposed=reuse)
    with jax.named_scope("nvfp4/wgrad"):
        dyt = wgrad_rotation(jnp.swapaxes(dy, -1, -2), recipe)
        if recipe.grad.quantized:
            dyt = quantize_operand(dyt, recipe.grad, keys["wgrad_dy"])
        xt = qxt
        if not recipe.fprop_input.quantized:
            xt = wgrad_rotation(qxt, recipe)
        dw = gemm(xt, recipe.fprop_input, dyt, recipe.grad)
    return dx.astype(cfg.lhs_dtype), dw.astype(cfg.rhs_dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def quantized_dot(x: jax.Array, w: jax.Array, key: jax.Array | None, cfg: GemmConfig) -> jax.Array:
    """y[B, M, N] = x[B, M, K] . w[B, K, N] through the recipe's quantized GEMMs."""
    return _fwd(x, w, key, cfg)[0]


quantized_dot.defvjp(_fwd, _bwd)
