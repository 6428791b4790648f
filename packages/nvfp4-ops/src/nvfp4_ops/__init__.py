"""nvfp4_ops: the NVFP4 training recipe as a JAX `dot_general`.

Three quantized GEMMs per linear layer (Fprop, Dgrad, Wgrad) with 16x16 weight tiles, the random
Hadamard transform on the Wgrad operands and stochastic rounding of gradients, behind a drop-in
replacement for `jax.lax.dot_general`, and for grouped experts (Mixture-of-Experts) behind
`ragged_dot`, in the spirit of `jax.lax.ragged_dot`; plus `hadamard_transform`, `fake_quantize` and the backend
capability report, per-call backend selection, the on-machine verification used by
`nvfp4-ops doctor [--verify]` (and required before "auto" uses a native backend), and
`te_sharding` for TransformerEngine calls on a sharded mesh.
"""

import nvfp4_format
from nvfp4_ops.backends import (
    BACKENDS,
    Call,
    auto_backend,
    auto_order,
    backend_capabilities,
    backend_capability,
    select_backend,
    verification,
)
from nvfp4_ops.dot import dot_general
from nvfp4_ops.fake_quant import fake_quantize
from nvfp4_ops.fp8 import FP8Tensor, dequantize_fp8, quantize_fp8
from nvfp4_ops.grouped import ragged_dot, ragged_operand_stats
from nvfp4_ops.hadamard import TE_SIGNS, hadamard_matrix, hadamard_transform
from nvfp4_ops.prequantized import (
    prequantized_dot_general,
    prequantized_unsupported,
    quantize_weight,
    weight_amax,
)
from nvfp4_ops.qdot import RESIDUAL_NAME
from nvfp4_ops.recipe import FORMATS, RECIPES, Recipe, TensorQuant, compose, get_recipe
from nvfp4_ops.te_backend import te_sharding
from nvfp4_ops.telemetry import STATS, gemm_operand_stats, operand_stats
from nvfp4_ops.verify import VerifyReport, verify_backend

# NVFP4Array / MXFP4Array must be JAX pytrees even when nvfp4_format was imported before JAX.
nvfp4_format.register_jax_pytrees()

__all__ = [
    "BACKENDS",
    "FORMATS",
    "Call",
    "FP8Tensor",
    "RECIPES",
    "RESIDUAL_NAME",
    "STATS",
    "TE_SIGNS",
    "Recipe",
    "TensorQuant",
    "VerifyReport",
    "auto_backend",
    "auto_order",
    "backend_capabilities",
    "backend_capability",
    "compose",
    "dequantize_fp8",
    "dot_general",
    "fake_quantize",
    "gemm_operand_stats",
    "get_recipe",
    "hadamard_matrix",
    "hadamard_transform",
    "operand_stats",
    "prequantized_dot_general",
    "prequantized_unsupported",
    "quantize_fp8",
    "quantize_weight",
    "ragged_dot",
    "ragged_operand_stats",
    "select_backend",
    "te_sharding",
    "verification",
    "verify_backend",
    "weight_amax",
]
