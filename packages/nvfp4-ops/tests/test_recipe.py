"""Recipe presets and validation."""

from __future__ import annotations

import dataclasses

import pytest

from nvfp4_ops import RECIPES, Recipe, TensorQuant, get_recipe

PRESETS = [
    "nvfp4",
    "nvfp4-no-rht",
    "nvfp4-no-sr",
    "nvfp4-no-2d",
    "nvfp4-naive",
    "nvfp4-4over6",
    "nvfp4-fwd-mxfp8-bwd",
    "nvfp4-per-token",
    "mxfp4",
    "mxfp8",
    "fp8",
    "bf16",
]


def test_presets_exist_and_are_hashable():
    assert sorted(RECIPES) == sorted(PRESETS)
    assert len({get_recipe(n) for n in PRESETS}) == len(PRESETS)
    for name in PRESETS:
        assert get_recipe(name).name == name


def test_paper_recipe_settings():
    r = get_recipe("nvfp4")
    assert r.fprop_input == TensorQuant("nvfp4", (1, 16), "rne")
    assert r.fprop_weight == TensorQuant("nvfp4", (16, 16), "rne")
    assert r.grad == TensorQuant("nvfp4", (1, 16), "stochastic")
    assert r.wgrad_hadamard and r.hadamard_size == 16 and r.needs_key
    assert Recipe() == dataclasses.replace(r, name="custom")


def test_ablations_differ_in_one_setting():
    base = get_recipe("nvfp4")
    assert not get_recipe("nvfp4-no-rht").wgrad_hadamard
    assert get_recipe("nvfp4-no-sr").grad.rounding == "rne"
    assert get_recipe("nvfp4-no-2d").fprop_weight.block_shape == (1, 16)
    naive = get_recipe("nvfp4-naive")
    assert (
        not naive.needs_key and not naive.wgrad_hadamard and naive.fprop_weight != base.fprop_weight
    )
    assert not get_recipe("bf16").quantized and get_recipe("fp8").quantized
    assert get_recipe("mxfp4").alignment == 32 and base.alignment == 16


def test_recipes_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_recipe("nvfp4").wgrad_hadamard = False


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"fmt": "int4"}, "fmt must be one of"),
        ({"fmt": "nvfp4", "block_shape": (1, 32)}, "block_shape for fmt='nvfp4'"),
        ({"fmt": "mxfp4", "block_shape": (16, 16)}, "block_shape for fmt='mxfp4'"),
        ({"fmt": "fp8_e4m3", "block_shape": (1, 16)}, "block_shape for fmt='fp8_e4m3'"),
        ({"fmt": "fp8_e5m2", "block_shape": None, "rounding": "stochastic"}, "stochastic"),
        ({"fmt": "nvfp4", "rounding": "truncate"}, "rounding must be one of"),
    ],
)
def test_invalid_tensor_quant(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TensorQuant(**kwargs)


def test_invalid_recipes():
    with pytest.raises(ValueError, match="16x16 blocks are for the weight only"):
        Recipe(fprop_input=TensorQuant("nvfp4", (16, 16)))
    with pytest.raises(ValueError, match="16x16 blocks are for the weight only"):
        Recipe(grad=TensorQuant("nvfp4", (16, 16), "stochastic"))
    with pytest.raises(ValueError, match="hadamard_size must be a power of two"):
        Recipe(hadamard_size=12)
    bf16 = TensorQuant("bf16", None)
    with pytest.raises(ValueError, match="wgrad_hadamard=True needs a quantized"):
        Recipe(fprop_input=bf16, grad=bf16, wgrad_hadamard=True)
    with pytest.raises(TypeError, match="must be a TensorQuant"):
        Recipe(grad="nvfp4")
    with pytest.raises(ValueError, match="unknown recipe 'nvfp3'"):
        get_recipe("nvfp3")
