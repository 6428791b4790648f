"""Precision policy: the scaled BF16 first/last rule, explicit counts, regex overrides, jaxpr check."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import nvfp4_ops
from nvfp4_train.model.config import ModelConfig
from nvfp4_train.model.decoder import Llama
from nvfp4_train.precision.policy import (
    PrecisionConfig,
    default_bf16_layers,
    layer_recipe_names,
    layer_recipes,
)


def model_cfg(num_layers: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=64, d_model=32, num_layers=num_layers, num_heads=2, num_kv_heads=1, mlp_dim=64,
        max_seq_len=16, scan_layers=False,  # the jaxpr below counts one GEMM per layer
    )  # fmt: skip


def recipe_by_layer(num_layers: int, **precision) -> list[str]:
    names = layer_recipe_names(model_cfg(num_layers), PrecisionConfig(**precision))
    per_layer = []
    for i in range(num_layers):
        layer = {
            names[f"layers.{i}.{lin}"] for lin in ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
        }
        assert len(layer) == 1, f"layer {i} mixes recipes {layer}"
        per_layer.append(layer.pop())
    return per_layer


@pytest.mark.parametrize(
    ("num_layers", "expected"),
    [(1, (0, 0)), (2, (0, 1)), (3, (1, 1)), (4, (1, 1)), (6, (1, 1)), (12, (1, 2)), (24, (1, 3)),
     (32, (1, 4)), (62, (2, 8)), (126, (2, 8))],
)  # fmt: skip
def test_default_rule_table(num_layers, expected):
    assert default_bf16_layers(num_layers) == expected


@pytest.mark.parametrize("num_layers", range(1, 130))
def test_default_rule_keeps_a_quantized_layer_and_caps_at_paper(num_layers):
    first, last = default_bf16_layers(num_layers)
    assert first + last < num_layers or num_layers == 0
    assert 0 <= first <= 2 and 0 <= last <= 8
    if num_layers >= 3:
        assert first >= 1 and last >= 1


def test_six_layer_model_gets_first_and_last_in_bf16():
    assert recipe_by_layer(6) == ["bf16", "nvfp4", "nvfp4", "nvfp4", "nvfp4", "bf16"]


def test_explicit_counts_and_other_recipe():
    assert recipe_by_layer(6, recipe="mxfp4", bf16_first_layers=2, bf16_last_layers=0) == [
        "bf16", "bf16", "mxfp4", "mxfp4", "mxfp4", "mxfp4",
    ]  # fmt: skip
    assert recipe_by_layer(3, bf16_first_layers=0, bf16_last_layers=0) == ["nvfp4"] * 3
    assert recipe_by_layer(3, bf16_first_layers=5) == ["bf16"] * 3


def test_overrides_apply_in_order_last_match_wins():
    names = layer_recipe_names(
        model_cfg(4),
        PrecisionConfig(
            overrides=(r"layers\.[12]\.mlp\..*=fp8", r"layers\.2\.mlp\.down=bf16", r".*\.qkv=nvfp4-no-sr"),
        ),
    )  # fmt: skip
    assert names["layers.1.mlp.gate_up"] == "fp8"
    assert names["layers.2.mlp.gate_up"] == "fp8"
    assert names["layers.2.mlp.down"] == "bf16"
    assert names["layers.1.attn.o"] == "nvfp4"
    assert names["layers.0.attn.o"] == "bf16"
    assert all(names[f"layers.{i}.attn.qkv"] == "nvfp4-no-sr" for i in range(4))


def test_layer_recipes_returns_recipe_objects():
    recipes = layer_recipes(model_cfg(4), PrecisionConfig())
    assert recipes["layers.0.mlp.down"] == nvfp4_ops.get_recipe("bf16")
    assert recipes["layers.1.mlp.down"] == nvfp4_ops.get_recipe("nvfp4")
    assert len(recipes) == 16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"recipe": "fp4"}, "precision.recipe: unknown recipe 'fp4'"),
        ({"overrides": ("layers.0",)}, "'REGEX=RECIPE'"),
        ({"overrides": ("layers.0.*=int4",)}, "unknown recipe 'int4'"),
        ({"overrides": ("layers.(=bf16",)}, "bad regex"),
        ({"overrides": "layers.0.*=bf16"}, "list of 'REGEX=RECIPE' strings"),
        ({"bf16_first_layers": -2}, "precision.bf16_first_layers must be >= 0 or -1"),
    ],
)
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PrecisionConfig(**kwargs)


def test_override_matching_nothing_is_an_error():
    with pytest.raises(ValueError, match="matches no linear"):
        layer_recipe_names(model_cfg(2), PrecisionConfig(overrides=(r"layers\.7\..*=bf16",)))


def _count_primitive(jaxpr, name: str) -> int:
    """Counts `name` equations, descending into sub-jaxprs except those of the counted ones."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            count += 1
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    count += _count_primitive(inner, name)
    return count


def _quantized_matmuls_in_jaxpr(num_layers: int, **precision) -> int:
    cfg = model_cfg(num_layers)
    model = Llama(cfg, layer_recipes(cfg, PrecisionConfig(**precision)), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def forward(params, x, key):
        return nnx.merge(graphdef, params)(x, key=key)

    # nvfp4_ops wraps each quantized GEMM triple (Fprop/Dgrad/Wgrad) in one custom_vjp; a BF16
    # linear is a plain dot_general.
    inputs = jnp.zeros((2, 16), jnp.int32)
    closed = jax.make_jaxpr(forward)(state, inputs, jax.random.key(0))
    return _count_primitive(closed.jaxpr, "custom_vjp_call")


def test_jaxpr_quantizes_exactly_the_policy_linears():
    # 4 layers, default rule: layers 0 and 3 BF16, layers 1 and 2 quantized (4 linears each).
    assert _quantized_matmuls_in_jaxpr(4) == 8
    assert _quantized_matmuls_in_jaxpr(4, recipe="bf16") == 0
    assert _quantized_matmuls_in_jaxpr(4, overrides=(r"layers\.[12]\..*=bf16",)) == 0
    assert _quantized_matmuls_in_jaxpr(4, overrides=(r"layers\.0\.mlp\.down=nvfp4",)) == 9
