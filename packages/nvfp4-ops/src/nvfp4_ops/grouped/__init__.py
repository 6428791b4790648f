"""Grouped (Mixture-of-Experts) GEMMs: the recipe's three GEMMs per group, `ragged_dot`.

Modules, one concept each, imported in this order (the direction is one way: nothing outside
this subpackage but `nvfp4_ops/__init__` and `nvfp4_ops.verify` imports it):
- `layout`: where each group's rows go in the padded, tile-aligned buffer (`GroupShape`, static;
  `GroupLayout`, traced from group_sizes);
- `random_bits`: per-group stochastic-rounding keys, and the random numbers of each group's
  dense call rebuilt from threefry counters;
- `operands`: the GEMM operands, quantized per expert (weights) and per tile with their group's
  scales (tokens), as `nvfp4_ops.gemm_table` describes them, and as each backend's GEMMs take
  them (decoded FP32, or exact BF16 values with FP32 outer scales);
- `blocks`: each group's tiles in static blocks, for batched GEMMs;
- `gemm`: the grouped GEMMs per backend, batched `dot_general`s with static shapes (no
  `lax.ragged_dot`, no data-dependent loop);
- `qdot`: the quantized custom_vjp; `unquantized`: the "bf16" recipe's;
- `dot`: `ragged_dot`, the public entry point;
- `telemetry`: `ragged_operand_stats`, the quantization statistics of those operands per group.
"""

from nvfp4_ops.grouped.dot import ragged_dot
from nvfp4_ops.grouped.telemetry import ragged_operand_stats

__all__ = ["ragged_dot", "ragged_operand_stats"]
