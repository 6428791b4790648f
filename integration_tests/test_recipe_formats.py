"""Export's recipe table (`nvfp4_export.policy.RECIPE_WEIGHT_FORMATS`) against the training recipes.

nvfp4-export never imports nvfp4-ops (it reads recipe names from checkpoints), so its table of
what each recipe preset does to the forward weight is a copy; this test is what keeps the two in
step: every preset of `nvfp4_ops.RECIPES` is either listed with the same weight format, block
shape, block scale rule and input quantization (and its outer scale), or refused by name (FP8),
and export lists no recipe ops lacks. MXFP8 (Nemotron 3 Super's Mamba out_proj) is exported as
trained: export's quantization of a weight equals the training ops' bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

import nvfp4_ops
from nvfp4_export import ExportError
from nvfp4_export.formats import BF16, FORMATS
from nvfp4_export.linears import dequantize_linear, export_linear
from nvfp4_export.model_spec import LlamaSpec
from nvfp4_export.policy import RECIPE_WEIGHT_FORMATS, weight_format

NOT_EXPORTED = {"fp8"}
"""Training presets with no export (refused with a message naming them): FP8 per-tensor current
scaling. (The per-tensor FP8 export writes is a stand-in for MXFP8, not this recipe.)"""


def test_export_lists_exactly_the_training_presets_it_can_export():
    assert set(RECIPE_WEIGHT_FORMATS) == set(nvfp4_ops.RECIPES) - NOT_EXPORTED


@pytest.mark.parametrize("name", sorted(set(nvfp4_ops.RECIPES) - NOT_EXPORTED))
def test_each_recipe_weight_format_matches_the_training_recipe(name):
    recipe, wf = nvfp4_ops.RECIPES[name], RECIPE_WEIGHT_FORMATS[name]
    weight = recipe.fprop_weight
    assert wf.fmt == weight.fmt, name
    assert wf.fmt == BF16 or wf.fmt in FORMATS, name
    if wf.fmt == "nvfp4":  # the block shape decides the codes (MXFP4 has one: 1x32)
        assert wf.block_shape == weight.block_shape, name
    else:
        assert wf.block_shape is None, name
    if wf.fmt != BF16:
        assert FORMATS[wf.fmt].block_size == weight.block_size, name
    assert wf.quantized_input == recipe.fprop_input.quantized, name
    assert wf.block_scale_rule == weight.block_scale_rule, name  # 4over6 weights: own scales
    assert wf.input_outer_scale == recipe.fprop_input.outer_scale, name  # per token: weight-only
    assert not recipe.bf16_fprop, name  # presets quantize the forward GEMM as listed


@pytest.mark.parametrize("name", sorted(NOT_EXPORTED))
def test_a_recipe_without_an_fp4_export_is_refused_by_name(name):
    assert name in nvfp4_ops.RECIPES
    with pytest.raises(ExportError, match=name):
        weight_format(name, "layers.1.attn.qkv")


def test_export_quantizes_an_mxfp8_weight_as_the_training_ops_do():
    import jax.numpy as jnp

    spec = LlamaSpec(257, 32, 1, 2, 1, 16, 32)
    kernel_IxO = (np.random.default_rng(0).standard_normal((32, 64)) * 0.05).astype(np.float32)
    kernel_IxO[3, 5] = 7.0  # one block far above the others
    ours = np.concatenate(
        [dequantize_linear(m) for m in export_linear(spec, "layers.0.attn.qkv", kernel_IxO,
                                                    "mxfp8", None)]
    )  # fmt: skip
    w_t = jnp.asarray(kernel_IxO).astype(jnp.bfloat16).T  # the forward's W^T, compute dtype
    theirs = np.asarray(nvfp4_ops.fake_quantize(w_t, "mxfp8", (1, 32)), np.float32)
    assert ours.tobytes() == theirs.tobytes()
