"""What TransformerEngine's NVFP4 path requires of a host, a recipe and a call.

The releases verified, the environment variables that must stay unset, and the recipes, dtypes
and shapes TE runs exactly as `nvfp4_ops.Recipe` says: what backend selection consults before it
picks "te". Nothing here imports TransformerEngine; `nvfp4_ops.te_backend` drives it (and
re-exports these names).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from nvfp4_ops.recipe import OPTIONAL_ROLES, Recipe

TE_MIN_VERSION = (2, 14)
"""The oldest TransformerEngine release whose API and reference numerics the conformance session
verifies (its reference quantizer rounds block scales as the kernels do from 2.14 on)."""

TE_TESTED_VERSIONS = ("2.14.0", "2.20.2")
"""The releases the conformance session checks: the supported floor and the newest."""

RECIPE_ENVIRONMENT = (
    "NVTE_NVFP4_DISABLE_RHT",
    "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING",
    "NVTE_NVFP4_DISABLE_2D_QUANTIZATION",
    "NVTE_NVFP4_ROW_SCALED_ACTIVATION",
    "NVTE_NVFP4_4OVER6",
    "NVTE_NVFP4_4OVER6_E4M3_USE_256",
    "NVTE_NVFP4_4OVER6_ERR_MODE",
    "NVTE_BACKWARD_OVERRIDE",
    "NVTE_JAX_CUSTOM_CALLS",
    "NVTE_JAX_CUSTOM_CALLS_RE",
)
"""Environment variables that change what TE computes behind our back: recipe fields default from
the first eight when `NVFP4BlockScaling` is imported, and the last two swap TE's kernels for its
pure-JAX fallbacks (whose NVFP4 quantizer turns block scales above 240 into NaN: it models the E4M3
cast with `lax.reduce_precision(x, 4, 3)`, IEEE semantics, found by the conformance session)."""

BLOCK = 16
"""TE's NVFP4 block: 1x16 blocks along rows, 16x16 weight tiles, the 16-point RHT."""

TE_OUTPUT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float32))
"""What TE's NVFP4 GEMM is asked to write here: BF16 (TE's layers) and FP32, the outputs TE's own
NVFP4 layers and GEMM tests use. TE's JAX GEMM accepts any output dtype when traced, but an FP16
output of the FP4 GEMM is reported to fail in cuBLASLt when run (issue 27; untested on hardware),
so a call asking for FP16 (or anything else) goes to another backend."""

TE_GROUPED_UNSUPPORTED = (
    "TransformerEngine's JAX grouped GEMM (grouped_dense / grouped_gemm) takes no NVFP4 operands "
    "in the releases checked (up to 2.20.2): its grouped quantization has no NVFP4 path (no "
    "per-group global scales, RHT or stochastic-rounding state; GroupedScaledTensor1x sets "
    "has_rht_applied=False 'until grouped quantization supports NVFP4'), and its grouped GEMM "
    "sizes scales for tensor scaling and MXFP8 only"
)
"""Why a grouped call (`ragged_dot`) never runs on "te". The conformance session reads the
released TE JAX sources for it (conformance/test_te_grouped.py) and fails the day TE's grouped
quantize or GEMM handles an NVFP4 scaling mode, so that this refusal is looked at again."""


def environment_conflicts(environ: Mapping[str, str]) -> list[str]:
    """The `RECIPE_ENVIRONMENT` variables set in `environ`, as "NAME=value" strings."""
    return [f"{name}={environ[name]}" for name in RECIPE_ENVIRONMENT if name in environ]


def te_unsupported(
    recipe: Recipe,
    batch: int = 1,
    dtype: np.dtype | None = None,
    out_dtype: np.dtype | None = None,
) -> str | None:
    """Why TE's NVFP4 recipe cannot run this call exactly as `recipe` says, or None if it can.

    Args:
      recipe: the recipe.
      batch: the product of the dot_general's batch dimensions (TE's dense has none).
      dtype: the compute dtype (the promoted dtype of the operands); TE's RHT kernels take BF16.
      out_dtype: the dtype the result is written in (`TE_OUTPUT_DTYPES`); None: `dtype`.
    """
    roles = {"fprop_input": recipe.fprop_input, "fprop_weight": recipe.fprop_weight}
    roles["grad"] = recipe.grad
    for role, tq in roles.items():
        if tq.fmt != "nvfp4":
            return f"TE's NVFP4BlockScaling quantizes every role to NVFP4, {role} is {tq.fmt!r}"
        if tq.block_scale_rule != "max":
            return (
                f"TE's JAX NVFP4 scales blocks by their amax; {role} uses "
                f"block_scale_rule={tq.block_scale_rule!r} (TE ships Four Over Six for PyTorch only)"
            )
        if tq.outer_scale != "tensor":
            return (
                f"TE's JAX NVFP4BlockScaling has one outer scale per tensor; {role} uses "
                f"outer_scale={tq.outer_scale!r}"
            )
    separate = [r for r in OPTIONAL_ROLES if getattr(recipe, r) is not None]
    if separate:
        return (
            f"TE quantizes each tensor's two orientations alike; this recipe sets "
            f"{', '.join(separate)} apart from the Fprop roles"
        )
    if recipe.fprop_input.rounding != "rne" or recipe.fprop_weight.rounding != "rne":
        return (
            "TE rounds activations and weights to nearest; this recipe rounds them stochastically"
        )
    if recipe.fprop_input.block_shape != (1, BLOCK) or recipe.grad.block_shape != (1, BLOCK):
        return "TE quantizes activations and gradients in 1x16 blocks"
    if recipe.wgrad_hadamard and recipe.hadamard_size != BLOCK:
        return f"TE's RHT is 16-point, this recipe's is {recipe.hadamard_size}-point"
    if recipe.bf16_fprop:
        return "TE quantizes the Fprop GEMM; this recipe runs it in BF16 (bf16_fprop)"
    if batch != 1:
        return f"TE's dense has no batch dimensions, this dot_general has a batch of {batch}"
    if dtype is not None and np.dtype(dtype) != np.dtype(jnp.bfloat16):
        return f"TE's NVFP4 kernels take BF16 operands, these compute in {np.dtype(dtype)}"
    if out_dtype is not None and np.dtype(out_dtype) not in TE_OUTPUT_DTYPES:
        return (
            f"TE's NVFP4 GEMM writes {' or '.join(map(str, TE_OUTPUT_DTYPES))}, this call "
            f"asks for {np.dtype(out_dtype)} (preferred_element_type)"
        )
    return None


def te_alignment(recipe: Recipe) -> tuple[int, int, int]:
    """(M, K, N) multiples TE needs: cuBLAS FP4 GEMMs contract multiples of 32; the fused RHT
    kernels take rows % 64 == 0 and columns % 128 == 0 (x is [M, K], dY is [M, N])."""
    if recipe.wgrad_hadamard:
        return 64, 128, 128
    return 32, 32, 32
