"""`dot_general`: a drop-in for `jax.lax.dot_general` running the NVFP4 training recipe.

Layout: `lhs` is the activation X and `rhs` the weight W (as `flax.nnx.Linear` calls it). Any
layout `lax.dot_general` accepts works, batch dimensions included; internally the operands become
[B, M, K] x [B, K, N], zero-padded to multiples of `recipe.alignment` (padding changes no amax and
no sum). Accumulation is FP32; the output has `preferred_element_type` or the promoted input
dtype, and the gradients the dtypes of `lhs` and `rhs`.

Backends (`backend=`): "emulated", "xla" or "te" (see `backend_capabilities()`): a ValueError
saying why if that backend cannot run this call (TE runs NVFP4BlockScaling recipes on BF16
operands without batch dimensions, writing BF16 or FP32); "auto" (default): the first of
`auto_order()` that can, falling back per call and logging each reason once, and taking "xla" or
"te" only after it passed `nvfp4_ops.verify_backend` in this process (until then "emulated":
right everywhere, fast nowhere); or a tuple of names tried in that order. A name or a tuple opts
out of the verification (the caller vouches for it, as `nvfp4-train` does after its own check).
Neither "auto" nor a tuple gives "te" a call whose operands may span several devices
(`backends.TE_SHARDED_CALLS_VERIFIED`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_ops.backends import Call, operand_devices, select_backend
from nvfp4_ops.canonical import make_layout
from nvfp4_ops.dispatch import run_backend
from nvfp4_ops.gemm_table import as_key
from nvfp4_ops.recipe import Recipe, as_recipe


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    *,
    recipe: Recipe | str,
    key: jax.Array | None = None,
    backend: str | tuple[str, ...] = "auto",
    out_sharding=None,
) -> jax.Array:
    """`lax.dot_general(lhs, rhs, ...)` with the recipe's quantized Fprop, Dgrad and Wgrad GEMMs.

    `lhs` is the activation X and `rhs` the weight W, in any layout `lax.dot_general` accepts
    (padding, accumulation and dtypes: the module docstring). Zero-size operands (an empty batch,
    or K = 0) have nothing to quantize: the result is the exact product, `lax.dot_general`'s
    (empty, or zeros), with its gradients.

    Args:
      lhs, rhs, dimension_numbers: as `jax.lax.dot_general`.
      precision: passed to `lax.dot_general` for an unquantized recipe; quantized GEMMs always
        use FP32 products and accumulation.
      preferred_element_type: output dtype.
      recipe: a `Recipe` or a preset name ("nvfp4", ...). A recipe quantizing nothing ("bf16")
        is exactly `lax.dot_general` with JAX's own gradients.
      key: PRNG key for stochastic rounding; required when the recipe uses it (a ValueError
        otherwise). Split per GEMM inside (see `nvfp4_ops.qdot`).
      backend: "emulated", "xla", "te", "auto" (default: the first of `auto_order()` that can
        run the call, a native backend only once verified) or a tuple of names tried in that
        order; a named backend that cannot run the call is a ValueError saying why. In full: the
        module docstring, "Backends".
      out_sharding: as `lax.dot_general` (for a quantized recipe applied as a sharding
        constraint on the output).

    Example:
      >>> x, w = jnp.ones((4, 32)), jnp.ones((32, 16))
      >>> y = dot_general(x, w, (((1,), (0,)), ((), ())), recipe="nvfp4-no-sr")
      >>> y.shape
      (4, 16)
    """
    recipe = as_recipe(recipe)
    if not recipe.quantized:
        return jax.lax.dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type,
            out_sharding=out_sharding,
        )
    return _quantized_dot_general(
        lhs, rhs, dimension_numbers, preferred_element_type, recipe, key, backend, out_sharding
    )


def _quantized_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    preferred_element_type,
    recipe: Recipe,
    key: jax.Array | None,
    backend: str | tuple[str, ...],
    out_sharding,
) -> jax.Array:
    """`dot_general` for a quantizing `recipe`: the exact product of zero-size operands, else the
    three quantized GEMMs on the backend selected for this call."""
    key = as_key(key, recipe)
    layout = make_layout(tuple(lhs.shape), tuple(rhs.shape), dimension_numbers)
    out_dtype = np.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    if 0 in layout.bmkn:  # nothing to quantize: the exact (empty, or all-zero) product
        return jax.lax.dot_general(
            lhs, rhs, dimension_numbers, preferred_element_type=out_dtype,
            out_sharding=out_sharding,
        )  # fmt: skip
    compute_dtype = np.dtype(jnp.result_type(lhs.dtype, rhs.dtype))
    call = Call(recipe, layout.bmkn[0], compute_dtype, out_dtype, operand_devices(lhs, rhs))
    out = run_backend(select_backend(backend, call), lhs, rhs, layout, recipe, key, out_dtype)
    if out_sharding is not None:
        out = jax.lax.with_sharding_constraint(out, out_sharding)
    return out
