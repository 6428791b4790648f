"""Running one quantized product on a backend already selected (`run_backend`).

`nvfp4_ops.dot` selects the backend of a call (`backends.select_backend`) and hands the product
here; `nvfp4_ops.probe` runs a backend's real path through here without any selection, which is
what `backends` asks to decide whether a backend is available. (This module therefore imports
neither `dot` nor `backends`: the import graph of nvfp4_ops has no cycle,
`tests/test_import_graph.py`.) Per backend and platform it chooses how far M, K and N are
zero-padded (`padding_multiple`), then runs the canonical custom_vjp (`qdot.quantized_dot`) or,
for "te", TransformerEngine's path (`te_backend.te_dot`, imported lazily: TE is optional).
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np

from nvfp4_ops.canonical import from_canonical, pad_to, to_canonical
from nvfp4_ops.qdot import GemmConfig, quantized_dot
from nvfp4_ops.recipe import Recipe

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
      >>> from nvfp4_ops.recipe import get_recipe
      >>> padding_multiple(get_recipe("nvfp4"), "xla", "gpu")
      32
    """
    if backend == "xla" and platform == "gpu":
        return math.lcm(recipe.alignment, XLA_GPU_CONTRACTION_MULTIPLE)
    return recipe.alignment


def _platform() -> str:
    """The platform the padding is chosen for: JAX's default backend ("cpu", "gpu", "tpu")."""
    return jax.default_backend()


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
