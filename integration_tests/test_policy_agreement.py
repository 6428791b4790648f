"""Export's fallback precision policy and architecture table against the training ones.

A checkpoint lists the recipe of every linear (`quant_stats.recipes`); for checkpoints written
before it did, nvfp4-export re-derives the list from the saved `precision:` section with its own
copy of the rule (`nvfp4_export.policy`: nvfp4-export never imports nvfp4-train). This test keeps
the copy in step: for every depth the default first/last BF16 blocks agree, and for configs with
explicit counts, overrides and a late BF16 forward the two recipe maps are the same. Export's
copy of the biases and norms each architecture builds (its check of hand-edited configs) is
training's table.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from nvfp4_export.model_spec import ARCHITECTURE_OPTIONS as EXPORT_ARCHITECTURES
from nvfp4_export.model_spec import LlamaSpec
from nvfp4_export.policy import default_bf16_layers as export_default
from nvfp4_export.policy import linear_recipes
from nvfp4_train.config.loader import to_dict
from nvfp4_train.config.run_config import config_from_dict
from nvfp4_train.model.config import ARCHITECTURE_OPTIONS as TRAIN_ARCHITECTURES
from nvfp4_train.model.config import ARCHITECTURES as TRAINED
from nvfp4_train.precision.policy import default_bf16_layers as train_default
from nvfp4_train.precision.policy import export_recipe_names


def test_export_checks_the_architectures_training_allows():
    # training's `_check_architecture` gives an architecture missing from its table Mistral's
    # options (the hybrid nemotron_h: no biases, no q/k norms); export lists it explicitly
    trained = {a: TRAIN_ARCHITECTURES.get(a, TRAIN_ARCHITECTURES["mistral"]) for a in TRAINED}
    assert trained == EXPORT_ARCHITECTURES


def test_the_default_bf16_blocks_agree_at_every_depth():
    assert [export_default(n) for n in range(1, 200)] == [train_default(n) for n in range(1, 200)]


@pytest.mark.parametrize(
    "precision",
    [
        {},
        {"recipe": "mxfp4"},
        {"bf16_first_layers": 0, "bf16_last_layers": 3},
        {"overrides": [r"layers\.2\..*=bf16", r"layers\.[0-9]+\.mlp\.down=nvfp4-no-sr"]},
        {"recipe": "nvfp4-4over6", "bf16_forward_from": 0.5},
    ],
)
@pytest.mark.parametrize("layers", [1, 4, 12])
def test_export_rederives_the_recipe_map_training_records(precision, layers):
    model = {"vocab_size": 256, "d_model": 64, "num_layers": layers, "num_heads": 4,
             "num_kv_heads": 2, "mlp_dim": 128}  # fmt: skip
    if layers < 3 and "overrides" in precision:
        precision = {**precision, "overrides": [precision["overrides"][1]]}
    cfg = config_from_dict({"model": model, "precision": precision, "train": {"steps": 10}})
    spec = LlamaSpec(vocab_size=256, d_model=64, num_layers=layers, num_heads=4, num_kv_heads=2,
                     head_dim=16, mlp_dim=128)  # fmt: skip
    recorded = export_recipe_names(cfg.model, cfg.precision, cfg.train.steps)
    assert linear_recipes(spec, to_dict(cfg), None) == recorded


def _documented_moe_classes() -> dict[str, dict[str, tuple]]:
    """docs/checkpoint-schema.md's table of the `model.moe` values each MoE class builds."""
    text = (Path(__file__).parents[1] / "docs" / "checkpoint-schema.md").read_text()
    section = text.split("### The `model.moe` values each Mixture-of-Experts class builds")[1]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    keys = [cell.strip(" `") for cell in rows[0].split("|")[2:-1]]
    table = {}
    for row in rows[1:]:
        cells = [cell.strip(" `") for cell in row.split("|")[1:-1]]
        table[cells[0]] = {key: (ast.literal_eval(value),)
                           for key, value in zip(keys, cells[1:], strict=True) if value != "any"}  # fmt: skip
    return table


def test_export_and_training_check_the_documented_moe_classes():
    from nvfp4_export.moe_spec import MOE_ARCHITECTURES as EXPORT_MOE
    from nvfp4_train.model.moe.config import MOE_ARCHITECTURES as TRAIN_MOE

    documented = _documented_moe_classes()
    assert set(documented) == {"qwen3_moe", "mixtral", "qwen2_moe"}
    assert documented == TRAIN_MOE
    assert documented == EXPORT_MOE


@pytest.mark.parametrize(
    "moe",
    [
        {"num_experts": 4, "expert_mlp_dim": 32},
        {"num_experts": 4, "expert_mlp_dim": 32, "layer_freq": 2, "dense_layers": [3]},
        {"num_experts": 8, "expert_mlp_dim": 16, "shared_experts": 1, "shared_expert_gate": True},
    ],
)
def test_export_rederives_an_moe_models_linears_and_recipes(moe):
    from nvfp4_export.model_spec import spec_from_config
    from nvfp4_train.model.config import linear_paths

    arch = "qwen2_moe" if moe.get("shared_experts") else "qwen3_moe"
    flags = {"qkv_bias": True} if arch == "qwen2_moe" else {"qk_norm": True}
    model = {"vocab_size": 256, "d_model": 64, "num_layers": 4, "num_heads": 4,
             "num_kv_heads": 2, "mlp_dim": 128, "architecture": arch, "moe": moe, **flags}  # fmt: skip
    cfg = config_from_dict({"model": model, "train": {"steps": 10},
                            "precision": {"overrides": [r"layers\.1\.mlp\.experts\..*=bf16"]}})  # fmt: skip
    config = to_dict(cfg)
    import jax

    from nvfp4_train.training.resume import abstract_state

    _, abstract = abstract_state(cfg)
    shapes = {
        ".".join(str(k.key) for k in path): tuple(leaf.shape)
        for path, leaf in jax.tree_util.tree_flatten_with_path(abstract.params)[0]
    }
    params = {
        k: np.broadcast_to(np.float32(0), v) for k, v in shapes.items()
    }  # unscanned: 4 blocks
    spec = spec_from_config(config, params)
    assert spec.linear_paths() == linear_paths(cfg.model)
    recorded = export_recipe_names(cfg.model, cfg.precision, cfg.train.steps)
    assert linear_recipes(spec, config, None) == recorded


def test_export_reads_a_hybrid_model_as_training_builds_it():
    import dataclasses

    import jax

    from nvfp4_export.hybrid_spec import MAMBA_DEFAULTS
    from nvfp4_export.model_spec import spec_from_config
    from nvfp4_train.model.blocks.mamba_config import MambaConfig
    from nvfp4_train.model.config import linear_paths
    from nvfp4_train.training.resume import abstract_state

    trained_defaults = dataclasses.asdict(MambaConfig())
    assert {k: trained_defaults[k] for k in MAMBA_DEFAULTS} == MAMBA_DEFAULTS
    mamba = {"num_heads": 16, "head_dim": 4, "state_dim": 8, "n_groups": 2, "chunk_size": 8}
    model = {"vocab_size": 256, "d_model": 32, "num_layers": 4, "num_heads": 2, "num_kv_heads": 1,
             "mlp_dim": 32, "architecture": "nemotron_h", "pattern": "M*-M", "rope": False,
             "mlp_activation": "relu2", "mamba": mamba}  # fmt: skip
    cfg = config_from_dict({"model": model, "train": {"steps": 10}})
    config = to_dict(cfg)
    _, abstract = abstract_state(cfg)
    params = {
        ".".join(str(k.key) for k in path): np.broadcast_to(np.float32(0), leaf.shape)
        for path, leaf in jax.tree_util.tree_flatten_with_path(abstract.params)[0]
    }
    spec = spec_from_config(config, params)  # checks every parameter's name and shape
    assert spec.linear_paths() == linear_paths(cfg.model)
    recorded = export_recipe_names(cfg.model, cfg.precision, cfg.train.steps)
    assert linear_recipes(spec, config, None) == recorded
