"""Mixture-of-Experts blocks: routing, dispatch and combine against a per-token loop, the MoE MLP
against a float64 reference, block placement, the auxiliary losses and the balancing bias in the
train step, and a run that resumes exactly (the bias included)."""

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
from nvfp4_train.config.loader import to_dict
from nvfp4_train.config.run_config import config_from_dict
from nvfp4_train.errors import ConfigError
from nvfp4_train.model.config import (
    ModelConfig,
    block_params,
    linear_paths,
    moe_blocks_note,
    moe_layers,
)
from nvfp4_train.model.flops import matmul_params
from nvfp4_train.model.moe.config import MoEConfig, expert_capacity, is_moe_layer
from nvfp4_train.model.moe.dispatch import combine, dispatch, gather_rows
from nvfp4_train.model.moe.layer import MoEMLP
from nvfp4_train.model.moe.routing import expert_counts, load_balancing_loss, route
from nvfp4_train.observe.metrics import read_metrics
from nvfp4_train.training.resume import check_same_model
from nvfp4_train.training.run import run
from nvfp4_train.training.session import load_run_config

MOE = {"num_experts": 4, "experts_per_token": 2, "expert_mlp_dim": 32}


def _model_cfg(**moe) -> ModelConfig:
    return ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1,
                       mlp_dim=64, max_seq_len=16, dtype="float32",
                       moe=MoEConfig(**{**MOE, **moe}))  # fmt: skip


# ----------------------------------------------------------------------------- routing, dispatch


def test_route_chooses_top_k_and_renormalises():
    logits = jax.random.normal(jax.random.key(0), (50, 6)) * 3
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    r = route(logits, k=2, norm_topk_prob=True)
    expected = np.argsort(-probs, axis=-1, kind="stable")[:, :2]
    np.testing.assert_array_equal(r.experts_TxK, expected)
    chosen = np.take_along_axis(probs, expected, axis=-1)
    np.testing.assert_allclose(r.weights_TxK, chosen / chosen.sum(-1, keepdims=True), rtol=1e-6)
    raw = route(logits, k=2, norm_topk_prob=False)
    np.testing.assert_allclose(raw.weights_TxK, chosen, rtol=1e-6)


def test_score_bias_changes_the_choice_not_the_weights():
    logits = jnp.array([[2.0, 1.0, 0.0]])
    r = route(logits, k=1, norm_topk_prob=False, score_bias_E=jnp.array([0.0, 0.0, 1.0]))
    assert r.experts_TxK.tolist() == [[2]]
    assert float(r.weights_TxK[0, 0]) == pytest.approx(float(jax.nn.softmax(logits)[0, 2]))


def test_load_balancing_loss_is_k_when_balanced():
    experts = jnp.array([[0, 1], [2, 3], [1, 0], [3, 2]])
    r = route(jnp.zeros((4, 4)), k=2, norm_topk_prob=True)._replace(experts_TxK=experts)
    assert float(load_balancing_loss(r, expert_counts(experts, 4))) == pytest.approx(2.0)


@pytest.mark.parametrize("capacity", [None, 3])
def test_dispatch_and_combine_equal_a_per_token_loop(capacity):
    """Every token's output is the weighted sum of its experts' outputs (a dropped assignment
    contributes nothing); experts see their tokens in token order."""
    t, k, e, d = 13, 2, 4, 8
    key_e, key_w, key_y = jax.random.split(jax.random.key(1), 3)
    experts = jax.random.randint(key_e, (t, k), 0, e)
    experts = experts.at[:, 1].set((experts[:, 0] + 1 + experts[:, 1] % (e - 1)) % e)  # distinct
    weights = jax.random.uniform(key_w, (t, k))
    x = jax.random.normal(key_y, (t, d))
    cap = t * k if capacity is None else capacity
    dd = dispatch(experts, num_experts=e, capacity=cap)
    rows = gather_rows(x, dd, k)
    scale = jnp.arange(1, e + 1, dtype=jnp.float32)  # "expert e" multiplies by e + 1
    group = np.repeat(np.arange(e), np.asarray(dd.group_sizes))
    y = np.zeros_like(np.asarray(rows))
    y[: len(group)] = np.asarray(rows)[: len(group)] * np.asarray(scale)[group, None]
    out = np.asarray(combine(jnp.asarray(y), weights, dd, jnp.float32))
    seen = np.zeros(e, int)
    expected = np.zeros((t, d), np.float32)
    for token in range(t):
        for j in range(k):
            expert = int(experts[token, j])
            if seen[expert] < cap:
                expected[token] += weights[token, j] * x[token] * scale[expert]
            seen[expert] += 1
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert np.asarray(dd.group_sizes).tolist() == np.minimum(seen, cap).tolist()


# ----------------------------------------------------------------------------- config, layout


@pytest.mark.parametrize(
    "moe, match",
    [
        ({"experts_per_token": 5}, r"model.moe.experts_per_token must be in \[1, num_experts=4\]"),
        ({"expert_mlp_dim": 40}, "model.moe.expert_mlp_dim must be a multiple of 16"),
        ({"expert_mlp_dim": 0}, "model.moe.expert_mlp_dim must be >= 1"),
        ({"capacity_factor": -1.0}, "model.moe.capacity_factor must be > 0"),
        ({"shared_expert_gate": True}, "model.moe.shared_expert_gate must be false"),
        ({"dense_layers": (7,)}, "model.moe.dense_layers must be block indices < num_layers=2"),
        ({"first_dense_layers": 10}, "no block is MoE: model.moe.first_dense_layers=10"),
        ({"dense_layers": (0, 1)}, r"model.moe.dense_layers=\[0, 1\] leave all num_layers=2"),
        ({"layer_freq": 5}, "model.moe.layer_freq=5 and"),
        ({"dispatch": "ring"}, "model.moe.dispatch must be 'all_to_all' or 'all_gather'"),
    ],
)
def test_bad_moe_settings_name_the_key(moe, match):
    with pytest.raises(ValueError, match=match):
        _model_cfg(**moe)


def test_a_run_may_resume_with_the_other_expert_exchange(tmp_path):
    """`model.moe.dispatch` says how expert parallelism moves tokens (same numbers): a checkpoint
    of either, or of a version without the key, resumes under the other."""
    section = {"num_experts": 4, "expert_mlp_dim": 16}
    gather = config_from_dict({"model": {"moe": {**section, "dispatch": "all_gather"}}})
    default = config_from_dict({"model": {"moe": section}})
    assert default.model.moe.dispatch == "all_to_all"
    older = to_dict(default)
    del older["model"]["moe"]["dispatch"]
    for cfg, saved in ((default, to_dict(gather)), (gather, to_dict(default)), (gather, older)):
        check_same_model(cfg, saved, tmp_path)
    with pytest.raises(ConfigError, match=r"model.moe.num_experts differ"):
        check_same_model(gather, to_dict(config_from_dict({"model": {"moe": {**section,
                                                             "num_experts": 8}}})), tmp_path)  # fmt: skip


def test_which_blocks_are_moe_and_their_linears():
    moe = MoEConfig(**MOE, first_dense_layers=1, layer_freq=2, dense_layers=(5,))
    assert [i for i in range(8) if is_moe_layer(moe, i)] == [1, 3, 7]
    cfg = _model_cfg(shared_experts=1, shared_expert_gate=True, first_dense_layers=1)
    assert moe_layers(cfg) == [1]
    assert [p for p in linear_paths(cfg) if p.startswith("layers.1")] == [
        "layers.1.attn.qkv", "layers.1.attn.o", "layers.1.mlp.experts.gate_up",
        "layers.1.mlp.experts.down", "layers.1.mlp.shared.gate_up", "layers.1.mlp.shared.down",
    ]  # fmt: skip
    assert "mlp.router.score_bias" in block_params(cfg, 1)
    assert "mlp.gate_up.kernel" in block_params(cfg, 0)


def test_the_start_up_line_names_the_moe_blocks():
    assert moe_blocks_note(_model_cfg(num_experts=0)) == ""
    assert moe_blocks_note(_model_cfg()) == "MoE blocks 0-1 (4 experts, top 2)"
    every_other = dataclasses.replace(_model_cfg(layer_freq=2), num_layers=6)
    assert moe_blocks_note(every_other) == "MoE blocks 1, 3, 5 (4 experts, top 2)"


def test_flops_count_the_active_experts():
    dense, moe = _model_cfg(num_experts=0), _model_cfg(shared_experts=1)
    attention = 2 * (32 * 4 * 16 + 2 * 16 * 32)
    assert matmul_params(dense) == attention + 2 * 3 * 32 * 64 + 32 * 64
    assert matmul_params(moe) == attention + 2 * (3 * 32 * (2 * 32 + 32) + 32 * 4) + 32 * 64


def test_capacity():
    moe = MoEConfig(**MOE, capacity_factor=1.25)
    assert expert_capacity(moe, 10) == 7  # ceil(1.25 * 20 / 4)
    assert expert_capacity(MoEConfig(**MOE), 10) == 20  # dropless


# ----------------------------------------------------------------------------- the MoE MLP


def test_moe_mlp_equals_a_float64_reference():
    """bf16 recipe, float32 compute: router, top-2, SwiGLU experts, a gated shared expert."""
    cfg = _model_cfg(shared_experts=1, shared_expert_gate=True, norm_topk_prob=False)
    recipes = dict.fromkeys(linear_paths(cfg), nvfp4_ops.get_recipe("bf16"))
    mlp = MoEMLP(cfg, recipes, "layers.0.mlp", rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (2, 5, 32))
    out = np.asarray(mlp(x, (None,) * 4), np.float64)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(mlp)))
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    xs = np.asarray(x, np.float64).reshape(10, 32)
    logits = xs @ p["router"]["kernel"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    expected = np.zeros_like(xs)
    for t in range(10):
        for e in np.argsort(-probs[t], kind="stable")[:2]:
            h = xs[t] @ p["experts"]["gate_up"]["kernel"][e]
            expected[t] += probs[t, e] * (
                (silu(h[:32]) * h[32:]) @ p["experts"]["down"]["kernel"][e]
            )
        h = xs[t] @ p["shared"]["gate_up"]["kernel"]
        gate = 1 / (1 + np.exp(-(xs[t] @ p["shared_gate"]["kernel"])))
        expected[t] += gate * ((silu(h[:32]) * h[32:]) @ p["shared"]["down"]["kernel"])
    np.testing.assert_allclose(out.reshape(10, 32), expected, rtol=2e-4, atol=2e-5)


# ----------------------------------------------------------------------------- runs

MOE_RUN = {
    "model": {"num_layers": 2, "moe": {**MOE, "aux_loss_coef": 0.01, "z_loss_coef": 0.001,
                                       "bias_update_rate": 0.01}},
    "train": {"steps": 4, "log_every": 1, "eval_every": 2, "batch_size": 4, "seq_len": 16},
    "checkpoint": {"every_steps": 2, "keep": 3},
    "logging": {"progress": "plain", "tensorboard": False},
}  # fmt: skip


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory, tiny_config):
    """A 4-step NVFP4 MoE run, and the same run stopped after 2 steps and resumed."""
    root = tmp_path_factory.mktemp("moe")
    return straight_and_resumed(root, config_from_dict(tiny_config(root, **MOE_RUN)), 2)


def test_moe_run_resumes_bit_identically(moe_runs):
    straight, resumed = (final_state(d) for d in moe_runs)
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), straight, resumed)
    assert all(jax.tree.leaves(same))
    bias = np.asarray(straight.params["layers"]["0"]["mlp"]["router"]["score_bias"])
    assert np.any(bias != 0)  # moved by +-rate per step, never by the optimizer
    steps = np.round(bias / 0.01)  # whole multiples of the rate, at most one per step
    np.testing.assert_allclose(bias, steps * 0.01, atol=1e-6)
    assert np.all(np.abs(steps) <= 4)
    expert_amax = straight.activation_amax["layers"]["0"]["mlp"]["experts"]["gate_up"]
    assert expert_amax.shape == (4,) and np.all(np.asarray(expert_amax) > 0)


def test_moe_metrics_rows(moe_runs):
    rows = [r for r in read_metrics(moe_runs[0] / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        assert set(row["moe"]) == {"layers.0", "layers.1"}
        load = row["moe"]["layers.1"]["load"]
        assert len(load) == 4 and sum(load) == pytest.approx(1.0)
        assert (
            row["max_load"] >= 1.0
            and row["aux_loss"] > 0
            and row["moe"]["layers.0"]["dropped"] == 0
        )


@pytest.mark.parametrize(
    "moe, key",
    [({"num_experts": 0}, "model.moe.num_experts"), ({"num_experts": 8}, "model.moe.num_experts")],
)
def test_resuming_with_other_experts_is_refused(moe_runs, moe, key):
    cfg = load_run_config(moe_runs[0])
    changed = dataclasses.replace(cfg.model, moe=dataclasses.replace(cfg.model.moe, **moe))
    with pytest.raises(ConfigError, match=rf"holds a checkpoint of a different run \(.*{key}"):
        run(dataclasses.replace(cfg, model=changed), stream=io.StringIO())
