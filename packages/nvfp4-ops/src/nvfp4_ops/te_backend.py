"""TransformerEngine backend: TE's JAX `dense` with its `NVFP4BlockScaling` recipe.

UNTESTED ON HARDWARE: written against TransformerEngine's public JAX API (TE >= 2.9:
`transformer_engine.jax.dense.dense`, `transformer_engine.jax.quantize.QuantizerFactory`,
`transformer_engine.common.recipe.NVFP4BlockScaling`) and selected only where
`backend_capabilities()["te"]` reports an sm_100+ GPU with TE importable. It has never run in this
project (no Blackwell GPU was available); the emulated backend is the verified reference.
Only the NVFP4 presets map onto TE (its recipe fixes X/W/dY to NVFP4 with 1x16 / 16x16 blocks).
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_ops.canonical import Layout, from_canonical, to_canonical
from nvfp4_ops.recipe import Recipe


def te_recipe(recipe: Recipe):
    """The `NVFP4BlockScaling` equivalent of `recipe`, or ValueError if TE cannot express it."""
    roles = (recipe.fprop_input, recipe.fprop_weight, recipe.grad)
    if any(t.fmt != "nvfp4" for t in roles) or recipe.fprop_input.rounding != "rne":
        raise ValueError(
            f"backend='te' runs NVFP4 recipes only (NVFP4BlockScaling), got recipe {recipe.name!r}"
        )
    if recipe.hadamard_size != 16:
        raise ValueError(f"TE's RHT is 16-point, got hadamard_size={recipe.hadamard_size}")
    if recipe.bf16_fprop:
        raise ValueError(
            f"TE's dense quantizes the Fprop GEMM; recipe {recipe.name!r} has bf16_fprop=True "
            "(use backend='emulated' or 'xla')"
        )
    te_common = importlib.import_module("transformer_engine.common.recipe")
    return te_common.NVFP4BlockScaling(
        disable_rht=not recipe.wgrad_hadamard,
        disable_stochastic_rounding=recipe.grad.rounding != "stochastic",
        disable_2d_quantization=not recipe.fprop_weight.is_2d,
    )


def te_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    layout: Layout,
    recipe: Recipe,
    key: jax.Array | None,
    out_dtype: np.dtype,
) -> jax.Array:
    """y = lhs . rhs through TE's quantized dense (its own custom_vjp: Fprop, Dgrad, Wgrad)."""
    b, m, k, n = layout.bmkn
    if b != 1:
        raise ValueError(f"backend='te' supports dot_generals without batch dimensions, got B={b}")
    dense = importlib.import_module("transformer_engine.jax.dense").dense
    factory = importlib.import_module("transformer_engine.jax.quantize").QuantizerFactory
    quantizers = factory.create_set(fp8_recipe=te_recipe(recipe))
    if recipe.grad.rounding == "stochastic":
        # TE draws its SR bits from a uint32[4] state on the gradient quantizer.
        quantizers.dgrad.stochastic_rounding_rng_state = jax.random.bits(key, (4,), jnp.uint32)
    x, w = to_canonical(lhs, rhs, layout)
    with jax.named_scope("nvfp4/te_dense"):
        y = dense(
            x[0].astype(jnp.bfloat16),
            w[0].astype(jnp.bfloat16),
            contracting_dims=((1,), (0,)),
            quantizer_set=quantizers,
        )
    return from_canonical(y[None].astype(out_dtype), layout)
