"""Hybrid Mamba-Transformer models (`model.pattern`): the config's checks, one mixer per block,
packed documents that never see each other through any mixer, presets, and a tiny NVFP4
Nemotron-3-style hybrid run (Nemotron 3 MoE, MTP layers) that resumes bit for bit."""

from __future__ import annotations

import dataclasses
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from run_reading import final_state, straight_and_resumed

import nvfp4_ops
from nvfp4_train.config.run_config import config_from_dict
from nvfp4_train.errors import ConfigError
from nvfp4_train.model.blocks.mamba_config import MambaConfig
from nvfp4_train.model.config import ModelConfig, block_params, linear_paths
from nvfp4_train.model.decoder import Llama
from nvfp4_train.model.moe.config import MoEConfig
from nvfp4_train.observe.metrics import read_metrics
from nvfp4_train.precision.policy import PrecisionConfig, layer_recipe_names
from nvfp4_train.training.run import run

MAMBA = {"num_heads": 8, "head_dim": 4, "state_dim": 6, "n_groups": 2, "chunk_size": 8}
HYBRID = {"d_model": 32, "num_layers": 4, "num_heads": 2, "num_kv_heads": 1, "mlp_dim": 64,
          "max_seq_len": 32, "architecture": "nemotron_h", "pattern": "M*-M", "rope": False,
          "mlp_activation": "relu2", "mamba": MAMBA}  # fmt: skip
"""A 4-block hybrid: Mamba, attention, squared-ReLU MLP, Mamba (in_proj 2 * 32 + 2 * 2 * 6 + 8 =
96 wide, a multiple of 16)."""


def _model_cfg(**changes) -> ModelConfig:
    values = {**HYBRID, "vocab_size": 64, "dtype": "float32", **changes}
    values["mamba"] = MambaConfig(**values["mamba"])
    values["moe"] = MoEConfig(**values.get("moe", {}))
    return ModelConfig(**values)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"pattern": "M*X-"}, "unknown letter 'X' at block 2"),
        ({"pattern": ("mamba", "attention", "mlp", "conv")}, "unknown block kind 'conv'"),
        ({"pattern": "M*-"}, "one kind per block: num_layers=4"),
        ({"architecture": "llama"}, "model.architecture must be one of ('nemotron_h',)"),
        ({"pattern": ""}, "model.pattern must be set for model.architecture='nemotron_h'"),
        ({"mamba": {**MAMBA, "d_inner": 48}}, "model.mamba.d_inner must be 0 or num_heads"),
        ({"mamba": {**MAMBA, "n_groups": 3}}, "model.mamba.n_groups must be a divisor"),
        ({"mamba": {**MAMBA, "conv_kernel": 0}}, "model.mamba.conv_kernel must be >= 1"),
        ({"mamba": {**MAMBA, "chunk_size": 0}}, "model.mamba.chunk_size must be >= 1"),
        ({"mamba": {**MAMBA, "head_dim": 3}}, "multiple of 16"),
        ({"pattern": "M*-E"}, "model.moe.num_experts must be > 0 exactly when"),
    ],
)
def test_bad_hybrid_configs_are_refused_naming_the_key(changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _model_cfg(**changes)


def test_moe_block_choosers_are_refused_with_a_pattern():
    moe = {"num_experts": 4, "expert_mlp_dim": 32, "layer_freq": 2}
    with pytest.raises(ValueError, match="model.moe.layer_freq must be 1 with a model.pattern"):
        config_from_dict(
            {"model": {**HYBRID, "pattern": "M*-E", "moe": moe}, "train": {"seq_len": 32}}
        )


def test_rope_off_and_relu2_need_a_pattern():
    with pytest.raises(ValueError, match="hybrid blocks only"):
        ModelConfig(rope=False)


def test_tensor_parallelism_on_mamba_blocks_is_refused():
    with pytest.raises(ConfigError, match="mesh.tensor=2: the Mamba-2 mixer"):
        config_from_dict({"model": HYBRID, "train": {"seq_len": 32}, "mesh": {"tensor": 2}})


def test_blocks_hold_one_mixer_each_with_their_linears():
    cfg = _model_cfg()
    assert linear_paths(cfg) == [
        "layers.0.mamba.in_proj", "layers.0.mamba.out_proj", "layers.1.attn.qkv",
        "layers.1.attn.o", "layers.2.mlp.up", "layers.2.mlp.down", "layers.3.mamba.in_proj",
        "layers.3.mamba.out_proj",
    ]  # fmt: skip
    bf16 = nvfp4_ops.get_recipe("bf16")
    model = Llama(cfg, {p: bf16 for p in linear_paths(cfg)}, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for i in range(cfg.num_layers):
        flat = {".".join(k) for k in _paths(params["layers"][str(i)])}
        assert flat == set(block_params(cfg, i))
    mamba = params["layers"]["0"]["mamba"]
    m = cfg.mamba
    assert mamba["in_proj"]["kernel"].shape == (32, 2 * m.inner + 2 * m.n_groups * 6 + 8)
    assert mamba["conv1d"]["kernel"].shape == (m.conv_kernel, m.conv_dim)
    np.testing.assert_array_equal(mamba["A_log"], np.log(np.arange(1, 9, dtype=np.float32)))
    dt = np.log1p(np.exp(mamba["dt_bias"]))  # softplus of the init: log-uniform in [1e-3, 0.1]
    assert np.all((dt > 0.99e-3) & (dt < 0.101))


def _paths(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _paths(value, (*prefix, key))
        else:
            yield (*prefix, key)


def test_packed_documents_never_see_each_other_through_any_mixer():
    """Two documents packed in one row give, token for token, the logits of each run alone:
    Mamba's conv window and state restart, attention stays in the document."""
    cfg = _model_cfg()
    bf16 = nvfp4_ops.get_recipe("bf16")
    model = Llama(cfg, {p: bf16 for p in linear_paths(cfg)}, rngs=nnx.Rngs(1))
    tokens = jax.random.randint(jax.random.key(2), (1, 27), 0, 64)
    split = 11  # the second document starts inside the second chunk of 8
    segments = jnp.where(jnp.arange(27) < split, 1, 2)[None]
    packed = model(tokens, segment_ids_BxL=segments)
    first, second = model(tokens[:, :split]), model(tokens[:, split:])
    alone = jnp.concatenate([first, second], axis=1)
    scale = float(jnp.max(jnp.abs(alone)))
    assert float(jnp.max(jnp.abs(packed - alone))) <= 1e-5 * scale


def test_nemotron_3_super_preset():
    cfg = _model_cfg(num_layers=8, pattern="M*MEM-MM", moe={"num_experts": 4,
                     "expert_mlp_dim": 32})  # fmt: skip
    names = layer_recipe_names(cfg, PrecisionConfig(preset="nemotron-3-super"))
    assert names["layers.0.mamba.in_proj"] == "nvfp4"  # no first blocks in BF16
    assert names["layers.0.mamba.out_proj"] == "mxfp8"
    assert names["layers.1.attn.qkv"] == names["layers.1.attn.o"] == "bf16"
    assert names["layers.3.mlp.experts.gate_up"] == "nvfp4"
    assert names["layers.7.mamba.in_proj"] == "bf16"  # last 15% of 8 blocks: 1
    assert names["layers.6.mamba.in_proj"] == "nvfp4"


def test_an_override_on_the_conv_or_the_scan_is_refused():
    cfg = _model_cfg()
    for override in (r"layers\.0\.mamba\.conv1d=nvfp4", r"layers\.\d+\.mamba\.scan=nvfp4"):
        with pytest.raises(ConfigError, match="never quantizes"):
            layer_recipe_names(cfg, PrecisionConfig(overrides=(override,)))


NEMOTRON3_MOE = {"num_experts": 4, "experts_per_token": 2, "expert_mlp_dim": 16,
                 "shared_experts": 1, "shared_expert_mlp_dim": 32, "router": "sigmoid",
                 "routed_scaling_factor": 2.5, "expert_activation": "relu2", "latent_dim": 16,
                 "bias_update_rate": 0.01}  # fmt: skip
"""Nemotron 3's MoE, tiny: sigmoid router with scaled weights (one group, as Nano), squared-ReLU
experts and shared expert, LatentMoE (Super), aux-loss-free balancing (grouped top-k:
test_nemotron3.py)."""
HYBRID_RUN = {
    "model": {**HYBRID, "pattern": "M*E-", "moe": NEMOTRON3_MOE,
              "mtp": {"num_layers": 1, "pattern": "*E", "loss_scaling_factor": 0.3}},
    "train": {"steps": 4, "log_every": 1, "eval_every": 2, "batch_size": 4, "seq_len": 16},
    "checkpoint": {"every_steps": 2, "keep": 3},
    "logging": {"progress": "plain", "tensorboard": False},
}  # fmt: skip
"""A Nemotron-3-style hybrid (Mamba, attention, Nemotron 3 MoE, squared-ReLU MLP) with one MTP
module (attention, MoE) trained with the nvfp4 recipe."""


@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory, tiny_config):
    """A 4-step NVFP4 hybrid run, and the same run stopped after 2 steps and resumed."""
    root = tmp_path_factory.mktemp("hybrid")
    return straight_and_resumed(root, config_from_dict(tiny_config(root, **HYBRID_RUN)), 2)


def test_hybrid_run_resumes_bit_identically(hybrid_runs):
    """Router bias and MTP layers included; the bias moved, the MTP loss is its own metric."""
    straight, resumed = (final_state(d) for d in hybrid_runs)
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), straight, resumed)
    assert all(jax.tree.leaves(same))
    amax = straight.activation_amax
    assert float(amax["layers"]["0"]["mamba"]["in_proj"]) > 0
    assert float(amax["mtp"]["layers"]["0"]["eh_proj"]) > 0
    assert float(amax["layers"]["2"]["mlp"]["fc1_latent_proj"]) > 0
    rows = [r for r in read_metrics(hybrid_runs[0] / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 4 and all(np.isfinite(r["mtp_loss"]) for r in rows)
    assert rows[-1]["mtp_loss"] != rows[-1]["loss"]
    for block, router in (
        ("layers.2", straight.params["layers"]["2"]["mlp"]["router"]),
        ("mtp.layers.1", straight.params["mtp"]["layers"]["1"]["mlp"]["router"]),
    ):
        # each step moved the bias by +-rate towards the mean share (1/4) of that step's load
        moves = [np.sign(0.25 - np.asarray(r["moe"][block]["load"])) for r in rows]
        assert np.any(moves)
        np.testing.assert_allclose(router["score_bias"], 0.01 * np.sum(moves, axis=0), atol=1e-6)


def test_a_changed_pattern_cannot_resume(hybrid_runs, tiny_config):
    model = {**HYBRID_RUN["model"], "pattern": "MME-"}
    changed = config_from_dict(tiny_config(hybrid_runs[0], **{**HYBRID_RUN, "model": model}))
    with pytest.raises(ConfigError, match="model.pattern differ"):
        run(dataclasses.replace(changed, train=dataclasses.replace(changed.train, steps=6)),
            stream=io.StringIO())  # fmt: skip
