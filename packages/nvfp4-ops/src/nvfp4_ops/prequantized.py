"""A weight quantized ahead of its product: `quantize_weight`, then `prequantized_dot_general`.

Under FSDP each device can quantize its own shard of a weight and the devices exchange the packed
FP4 codes and E4M3 scales (0.5625 bytes per element) instead of the weight: this module holds the
two halves of that, independent of any mesh. `quantize_weight(w, recipe, amax=)` is the Fprop
quantization `dot_general` computes of a weight [K, N] (w^T in 16x16 tiles, round to nearest, the
tensor scale from `amax`); a 16x16 tile is transpose-invariant, so Dgrad reuses it as `dot_general`
does. `prequantized_dot_general(x, w, qw, ...)` is `dot_general(x, w, ...)` with that quantization
given: Fprop and Dgrad read `qw`, `w` only receives its gradient (the recipe's Wgrad, which reads x
and dY, not the weight). With `amax` the max over the whole weight, a shard's tiles (shard
boundaries on multiples of 16) are the whole weight's tiles, so the gathered pieces equal
`quantize_weight` of the whole weight and the product is `dot_general`'s bit for bit.

Example:
  >>> recipe = as_recipe("nvfp4")
  >>> x, w = jnp.ones((4, 32), jnp.bfloat16), jnp.ones((32, 16), jnp.bfloat16)
  >>> qw = quantize_weight(w, recipe)
  >>> y = prequantized_dot_general(x, w, qw, recipe=recipe, key=jax.random.key(0))
  >>> y.shape
  (4, 16)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_ops.backends import Call, operand_devices, select_backend
from nvfp4_ops.canonical import from_canonical, make_layout, pad_to, to_canonical
from nvfp4_ops.dispatch import padding_multiple
from nvfp4_ops.fp8 import abs_max
from nvfp4_ops.gemm_table import as_key, gemm_quantized, operand_quants, operand_view
from nvfp4_ops.qdot import GemmConfig, prequantized_dot
from nvfp4_ops.quantizers import quantize_with
from nvfp4_ops.recipe import Recipe, as_recipe

__all__ = [
    "prequantized_dot_general",
    "prequantized_unsupported",
    "quantize_weight",
    "weight_amax",
]

_LINEAR = (((-1,), (0,)), ((), ()))


def prequantized_unsupported(recipe: Recipe | str) -> str | None:
    """Why `recipe`'s weight cannot be quantized ahead of its product, or None when it can.

    It can when the Fprop GEMM is quantized, the Fprop weight is NVFP4 in 16x16 tiles with round
    to nearest and one tensor scale, and Dgrad reuses that quantization (the "nvfp4" preset and
    its variants with 2D weights).

    Example:
      >>> prequantized_unsupported("nvfp4") is None, prequantized_unsupported("bf16")
      (True, 'the recipe quantizes nothing')
    """
    recipe = as_recipe(recipe)
    if not recipe.quantized:
        return "the recipe quantizes nothing"
    if not gemm_quantized(recipe, "fprop"):
        return "its Fprop GEMM runs unquantized (bf16_fprop): it needs the weight itself"
    ops = operand_quants(recipe)
    tq = ops["fprop_w"].tq
    if tq.fmt != "nvfp4" or tq.block_shape != (16, 16):
        return f"its Fprop weight is {tq.fmt} in {tq.block_shape} blocks, not NVFP4 16x16 tiles"
    if tq.rounding != "rne" or tq.outer_scale != "tensor":
        return f"its Fprop weight uses rounding={tq.rounding!r}, outer_scale={tq.outer_scale!r}"
    if ops["dgrad_w"].reuses is None:
        return "its Dgrad quantizes the weight again (its own dgrad_weight settings)"
    return None


def _check(recipe: Recipe, w_shape: tuple[int, ...]) -> None:
    reason = prequantized_unsupported(recipe)
    if reason is not None:
        raise ValueError(f"recipe {recipe.name!r} cannot prequantize its weight: {reason}")
    if len(w_shape) != 2 or any(d % recipe.alignment for d in w_shape):
        raise ValueError(
            f"a prequantized weight must be [K, N] with K and N multiples of "
            f"{recipe.alignment} (16x16 tiles), got shape {w_shape}"
        )


def weight_amax(w: jax.Array) -> jax.Array:
    """max|w| as float32, NaN if w holds one (the amax `quantize_weight` takes; a shard's, to be
    max-reduced)."""
    return abs_max(w)


def quantize_weight(w_KxN: jax.Array, recipe: Recipe | str, *, amax: jax.Array | None = None):
    """The Fprop quantization `dot_general(x, w_KxN, recipe=recipe)` computes of its weight.

    Args:
      w_KxN: the weight [K, N] in the compute dtype (or a shard of it: K and N multiples of 16).
      recipe: a recipe `prequantized_unsupported` accepts.
      amax: the amax that sets the tensor scale (default max|w_KxN|); for a shard, the max over
        the whole weight (`weight_amax` of each shard, max-reduced over the devices).

    Returns:
      The format's quantized tensor of w^T [1, N, K] (`nvfp4_format.NVFP4Array`: packed uint8
      [1, N, K/2], block scales float8_e4m3fn [1, N, K/16], global decode scale float32 ()).

    Raises:
      ValueError: the recipe cannot prequantize, or K or N is not a multiple of 16.
    """
    recipe = as_recipe(recipe)
    _check(recipe, tuple(w_KxN.shape))
    op = operand_quants(recipe)["fprop_w"]
    return quantize_with(operand_view(op, w_KxN[None]), op.tq, None, amax)


def prequantized_dot_general(
    x: jax.Array,
    w_KxN: jax.Array,
    qw: Any,
    *,
    recipe: Recipe | str,
    key: jax.Array | None = None,
    backend: str | tuple[str, ...] = "auto",
    preferred_element_type=None,
) -> jax.Array:
    """`dot_general(x, w_KxN, (((x.ndim - 1,), (0,)), ((), ())), ...)` with `qw` as its weight.

    `qw` must be `quantize_weight(w_KxN, recipe)` (or its shards' pieces gathered): then the
    output and both gradients are `dot_general`'s bit for bit. Fprop and Dgrad read `qw`; `w_KxN`
    is not read, it receives the weight gradient (the recipe's Wgrad of x and dY). `qw` receives
    none.

    Args:
      x: activations [..., K].
      w_KxN: the weight [K, N] (compute dtype) the gradient is for.
      qw: its quantization (`quantize_weight`).
      recipe, key, preferred_element_type: as `dot_general`.
      backend: as `dot_general`, but only "emulated" and "xla" run prequantized weights ("te"
        quantizes its own).

    Raises:
      ValueError: as `quantize_weight`, or a backend that cannot run the call.
    """
    recipe = as_recipe(recipe)
    _check(recipe, tuple(w_KxN.shape))
    key = as_key(key, recipe)
    layout = make_layout(tuple(x.shape), tuple(w_KxN.shape), _LINEAR)
    out_dtype = np.dtype(preferred_element_type or jnp.result_type(x, w_KxN))
    compute_dtype = np.dtype(jnp.result_type(x.dtype, w_KxN.dtype))
    call = Call(recipe, 1, compute_dtype, out_dtype, operand_devices(x, w_KxN))
    chosen = _backend(backend, call)
    cfg = GemmConfig(recipe, chosen, out_dtype, np.dtype(x.dtype), np.dtype(w_KxN.dtype))
    m = layout.bmkn[1]
    with jax.named_scope(f"nvfp4/dot_general[{recipe.name}]"):
        x_c, w_c = to_canonical(x, w_KxN, layout)
        x_c = pad_to(x_c, (1, padding_multiple(recipe, chosen, jax.default_backend()), 1))
        y = prequantized_dot(x_c, w_c, qw, key, cfg)
        return from_canonical(y[:, :m, :], layout)


def _backend(backend: str | tuple[str, ...], call: Call) -> str:
    """`select_backend` without "te" (which quantizes its own weights): "auto" keeps its rules
    for the others (a native backend only once verified); a name or an order as given."""
    if backend == "auto":
        return select_backend("auto", call, exclude=("te",))
    names = (backend,) if isinstance(backend, str) else tuple(backend)
    order = tuple(n for n in names if n != "te")
    if not order:
        raise ValueError(f"a prequantized weight runs on 'emulated' or 'xla', got {backend!r}")
    return select_backend(order[0] if len(order) == 1 else order, call)
