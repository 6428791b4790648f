"""`dot_general`: a drop-in for `jax.lax.dot_general` running the NVFP4 training recipe."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_ops.backends import Call, operand_devices, select_backend
from nvfp4_ops.canonical import from_canonical, make_layout, pad_to, to_canonical
from nvfp4_ops.gemm_table import require_key
from nvfp4_ops.qdot import GemmConfig, quantized_dot
from nvfp4_ops.recipe import Recipe, get_recipe

XLA_GPU_CONTRACTION_MULTIPLE = 32
"""What the xla backend pads every axis to on a GPU (each of M, K and N is the contraction of one
of the three GEMMs). XLA hands `jax.nn.scaled_matmul` to cuDNN's block-scaled GEMM, whose FP4
operands are read with 16-byte-aligned rows (32 E2M1 codes; XLA's rewriter pads the block scales
to its 128x4 tiles but not the data); the recipe's own 16 would leave K = 16 mod 32 (16, 48, 80,
112, ...) to fail there. Read from XLA's block_scaling_rewriter and cuDNN's alignment rules;
untested on hardware (docs/ops.md, GPU-only risks)."""


def padding_multiple(recipe: Recipe, backend: str, platform: str) -> int:
    """The multiple that M, K and N are zero-padded to when `backend` runs `recipe` on `platform`.

    The recipe's alignment (16 for NVFP4 blocks and tiles, 32 for MXFP4), raised to a multiple of
    `XLA_GPU_CONTRACTION_MULTIPLE` for "xla" on a GPU. ("te" pads to `te_alignment` itself.)

    Example:
      >>> padding_multiple(get_recipe("nvfp4"), "xla", "gpu")
      32
    """
    if backend == "xla" and platform == "gpu":
        return math.lcm(recipe.alignment, XLA_GPU_CONTRACTION_MULTIPLE)
    return recipe.alignment


def _platform() -> str:
    """The platform the padding is chosen for: JAX's default backend ("cpu", "gpu", "tpu")."""
    return jax.default_backend()


def _as_recipe(recipe: Recipe | str) -> Recipe:
    if isinstance(recipe, str):
        return get_recipe(recipe)
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a Recipe or a preset name, got {type(recipe).__name__}")
    return recipe


def _as_key(key: Any, recipe: Recipe) -> jax.Array | None:
    require_key(key, recipe)
    if key is None:
        return None
    if not isinstance(key, jax.Array):
        raise TypeError(f"key must be a JAX PRNG key, got {type(key).__name__}")
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    if key.dtype == jnp.uint32 and key.shape == (2,):
        return jax.random.wrap_key_data(key)
    raise TypeError(f"key must be a PRNG key (typed, or raw uint32[2]), got {key.dtype}{key.shape}")


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

    `lhs` is the activation X and `rhs` the weight W (as `flax.nnx.Linear` calls it). Any layout
    `lax.dot_general` accepts works, batch dimensions included; internally the operands become
    [B, M, K] x [B, K, N], zero-padded to multiples of `recipe.alignment` (padding changes no
    amax and no sum). Accumulation is FP32; the output has `preferred_element_type` or the
    promoted input dtype, and the gradients the dtypes of `lhs` and `rhs`.

    Zero-size operands (an empty batch, or K = 0) have nothing to quantize: the result is the
    exact product, `lax.dot_general`'s (empty, or zeros), with its gradients.

    Args:
      lhs, rhs, dimension_numbers: as `jax.lax.dot_general`.
      precision: passed to `lax.dot_general` for an unquantized recipe; quantized GEMMs always
        use FP32 products and accumulation.
      preferred_element_type: output dtype.
      recipe: a `Recipe` or a preset name ("nvfp4", ...). A recipe quantizing nothing ("bf16")
        is exactly `lax.dot_general` with JAX's own gradients.
      key: PRNG key for stochastic rounding; required when the recipe uses it (a ValueError
        otherwise). Split per GEMM inside (see `nvfp4_ops.qdot`).
      backend: "emulated", "xla" or "te" (see `backend_capabilities()`): a ValueError saying
        why if that backend cannot run this call (TE runs NVFP4BlockScaling recipes on BF16
        operands without batch dimensions, writing BF16 or FP32); "auto" (default): the first
        of `auto_order()` that can, falling back per call and logging each reason once, and
        taking "xla" or "te" only after it passed `nvfp4_ops.verify_backend` in this process
        (until then "emulated": right everywhere, fast nowhere); or a tuple of names tried in
        that order. A name or a tuple opts out of the verification (the caller vouches for
        it, as `nvfp4-train` does after its own check). Neither "auto" nor a tuple gives "te"
        a call whose operands may span several devices (`backends.TE_SHARDED_CALLS_VERIFIED`).
      out_sharding: as `lax.dot_general` (for a quantized recipe applied as a sharding
        constraint on the output).

    Example:
      >>> x, w = jnp.ones((4, 32)), jnp.ones((32, 16))
      >>> y = dot_general(x, w, (((1,), (0,)), ((), ())), recipe="nvfp4-no-sr")
      >>> y.shape
      (4, 16)
    """
    recipe = _as_recipe(recipe)
    if not recipe.quantized:
        return jax.lax.dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type,
            out_sharding=out_sharding,
        )
    key = _as_key(key, recipe)
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


def run_backend(backend: str, lhs, rhs, layout, recipe: Recipe, key, out_dtype) -> jax.Array:
    """The quantized product through `backend` (already selected: nothing is checked here)."""
    if backend == "te":
        from nvfp4_ops.te_backend import te_dot  # lazy: TransformerEngine is optional

        return te_dot(lhs, rhs, layout, recipe, key, out_dtype)
    multiple = padding_multiple(recipe, backend, _platform())
    return _canonical_dot(lhs, rhs, layout, recipe, key, backend, out_dtype, multiple)


@functools.partial(jax.jit, static_argnums=(2, 3, 5, 6, 7))
def _canonical_dot(lhs, rhs, layout, recipe, key, backend, out_dtype, multiple) -> jax.Array:
    """Canonicalise, pad M, K, N to `multiple`, run the quantized custom_vjp, restore the layout
    (one jit per shape)."""
    b, m, k, n = layout.bmkn
    a = multiple
    cfg = GemmConfig(recipe, backend, out_dtype, np.dtype(lhs.dtype), np.dtype(rhs.dtype))
    with jax.named_scope(f"nvfp4/dot_general[{recipe.name}]"):
        x, w = to_canonical(lhs, rhs, layout)
        x, w = pad_to(x, (1, a, a)), pad_to(w, (1, a, a))
        y = quantized_dot(x, w, key, cfg)
        return from_canonical(y[:, :m, :n], layout)
