"""Nemotron 3's MoE and multi-token prediction, each piece against a hand computation: the sigmoid
router (the bias moves the choice, never the weights), grouped top-k, the MTP loss's shift and
masks in float32 (its gradient too), the MTP forward's causality, the config's one-line refusals,
and the policy's names. Against transformers' own modules: integration_tests/
test_nemotron3_moe_parity.py; a Nemotron-3-style run: test_hybrid.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh

import nvfp4_ops
from nvfp4_train.mesh.sharding import param_spec
from nvfp4_train.mesh_axes import AXES
from nvfp4_train.model.blocks.mamba_config import MambaConfig
from nvfp4_train.model.config import ModelConfig, linear_paths
from nvfp4_train.model.decoder import Llama
from nvfp4_train.model.flops import matmul_params
from nvfp4_train.model.moe.config import MoEConfig
from nvfp4_train.model.moe.routing import grouped_choice_scores, route
from nvfp4_train.model.mtp.config import MTPConfig
from nvfp4_train.model.mtp.loss import mtp_loss
from nvfp4_train.model.structure import mtp_layer_params
from nvfp4_train.precision.policy import PrecisionConfig, layer_recipe_names
from nvfp4_train.tree_paths import flat_paths

MOE = {"num_experts": 8, "experts_per_token": 2, "expert_mlp_dim": 16, "shared_experts": 1,
       "shared_expert_mlp_dim": 32, "router": "sigmoid", "n_group": 2, "topk_group": 1,
       "routed_scaling_factor": 2.5, "expert_activation": "relu2", "latent_dim": 16}  # fmt: skip
MAMBA = {"num_heads": 8, "head_dim": 4, "state_dim": 6, "n_groups": 2, "chunk_size": 8}


def _cfg(mtp=None, dtype="float32", **moe) -> ModelConfig:
    return ModelConfig(
        vocab_size=64, d_model=32, num_layers=3, num_heads=2, num_kv_heads=1, mlp_dim=64,
        max_seq_len=32, architecture="nemotron_h", pattern="M*E", rope=False, dtype=dtype,
        mlp_activation="relu2", mamba=MambaConfig(**MAMBA), moe=MoEConfig(**{**MOE, **moe}),
        mtp=MTPConfig(**(mtp or {})),
    )  # fmt: skip


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


# ----------------------------------------------------------------------------- the router


def test_the_bias_changes_the_choice_not_the_weights():
    logits = jnp.array([[2.0, 1.0, 0.0, -1.0]])
    plain = route(logits, k=2, norm_topk_prob=True, router="sigmoid", routed_scaling_factor=2.5)
    bias = jnp.array([0.0, 0.0, 0.3, 0.0])  # sigmoid(2) > sigmoid(0) + 0.3 > sigmoid(1)
    biased = route(logits, k=2, norm_topk_prob=True, router="sigmoid", score_bias_E=bias,
                   routed_scaling_factor=2.5)  # fmt: skip
    assert plain.experts_TxK.tolist() == [[0, 1]] and biased.experts_TxK.tolist() == [[0, 2]]
    s = _sigmoid(np.array([2.0, 1.0, 0.0]))
    np.testing.assert_allclose(plain.weights_TxK[0], 2.5 * s[[0, 1]] / s[[0, 1]].sum(), rtol=1e-6)
    np.testing.assert_allclose(biased.weights_TxK[0], 2.5 * s[[0, 2]] / s[[0, 2]].sum(), rtol=1e-6)
    raw = route(logits, k=2, norm_topk_prob=False, router="sigmoid", score_bias_E=bias)
    np.testing.assert_allclose(raw.weights_TxK[0], s[[0, 2]], rtol=1e-6)  # no bias in them


def _grouped_reference(choice: np.ndarray, n_group: int, topk_group: int, k: int) -> set:
    """The chosen experts of one token by hand: groups scored by their two best, the best
    `topk_group` groups searched."""
    groups = choice.reshape(n_group, -1)
    group_score = np.sort(groups, axis=-1)[:, -2:].sum(-1)
    kept = np.argsort(-group_score, kind="stable")[:topk_group]
    size = choice.size // n_group
    candidates = [e for g in kept for e in range(g * size, (g + 1) * size)]
    return set(sorted(candidates, key=lambda e: -choice[e])[:k])


def test_grouped_top_k_searches_only_the_best_groups():
    # group 0 holds the single best expert (0.9) but its second is poor: sums 1.0, 1.2, 1.3, 0.2
    choice = np.array([[0.9, 0.1, 0.6, 0.6, 0.7, 0.6, 0.1, 0.1]], np.float32)
    masked = np.asarray(grouped_choice_scores(jnp.asarray(choice), 4, 2))
    assert np.isinf(masked[0, [0, 1, 6, 7]]).all() and np.isfinite(masked[0, 2:6]).all()
    r = route(jnp.log(choice / (1 - choice)), k=3, norm_topk_prob=True, router="sigmoid",
              n_group=4, topk_group=2)  # fmt: skip
    assert set(r.experts_TxK[0].tolist()) == {2, 3, 4}  # not 0, the best expert
    scores = jax.random.uniform(jax.random.key(0), (200, 16))
    got = route(jnp.log(scores / (1 - scores)), k=3, norm_topk_prob=True, router="sigmoid",
                n_group=4, topk_group=2)  # fmt: skip
    for t in range(200):
        want = _grouped_reference(np.asarray(jax.nn.sigmoid(got.logits_TxE[t])), 4, 2, 3)
        assert set(got.experts_TxK[t].tolist()) == want


# ----------------------------------------------------------------------------- the MTP loss


def test_mtp_loss_is_the_hand_shifted_cross_entropy_in_float32():
    rng = np.random.default_rng(0)
    targets = rng.integers(0, 5, (2, 6))
    segments = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
    logits = [rng.standard_normal((2, 6, 5)).astype(np.float32) for _ in range(2)]
    got = mtp_loss(tuple(map(jnp.asarray, logits)), jnp.asarray(targets), jnp.asarray(segments),
                   0.3)  # fmt: skip
    want = []
    for d, lg in enumerate(logits, start=1):  # position i predicts token i + d + 1 = targets[i + d]
        terms = [
            -(lg[b, i, targets[b, i + d]] - np.log(np.exp(lg[b, i].astype(np.float64)).sum()))
            for b in range(2) for i in range(6 - d) if segments[b, i + d] == segments[b, i]
        ]  # fmt: skip
        want.append(np.mean(terms))
    assert len(terms) == 2 + 4  # depth 2: row 0 keeps i = 0 and 3, row 1 keeps i = 0..3
    np.testing.assert_allclose(got.depth_losses, want, rtol=1e-6)
    np.testing.assert_allclose(got.objective, 0.3 / 2 * sum(want), rtol=1e-6)
    assert got.objective.dtype == got.depth_losses.dtype == jnp.float32
    # bf16 logits are upcast first: every sum of the loss and of its gradient is float32 (the
    # gradient's cast back to the logits' own dtype is its last step)
    bf16 = tuple(jnp.asarray(lg, jnp.bfloat16) for lg in logits)
    grad = jax.grad(lambda ls: mtp_loss(ls, jnp.asarray(targets), None, 0.3).objective)
    sums = [e for e in jax.make_jaxpr(grad)(bf16).eqns if e.primitive.name == "reduce_sum"]
    assert len(sums) >= 4 and all(e.outvars[0].aval.dtype == jnp.float32 for e in sums)


# ----------------------------------------------------------------------------- MTP in the model


@pytest.fixture(scope="module")
def mtp_model():
    cfg = _cfg(mtp={"num_layers": 1, "pattern": "*E", "depths": 2}, dtype="bfloat16")
    bf16 = nvfp4_ops.get_recipe("bf16")
    return cfg, Llama(cfg, dict.fromkeys(linear_paths(cfg), bf16), rngs=nnx.Rngs(0))


def test_mtp_depths_read_the_next_tokens_and_return_float32(mtp_model):
    """Depth d at position i reads tokens up to i + d and no later one; logits float32; its
    gradient into the logits float32."""
    cfg, model = mtp_model
    tokens = jax.random.randint(jax.random.key(1), (1, 12), 0, 64)
    logits, depths = model(tokens, mtp=True)
    assert logits.dtype == jnp.float32 and [d.dtype for d in depths] == [jnp.float32] * 2
    i = 4
    for d, changed_at, moves in ((1, i + 1, True), (1, i + 2, False), (2, i + 2, True),
                                 (2, i + 3, False)):  # fmt: skip
        other = tokens.at[0, changed_at].set((tokens[0, changed_at] + 1) % 64)
        moved = float(
            jnp.max(jnp.abs(model(other, mtp=True)[1][d - 1][0, i] - depths[d - 1][0, i]))
        )
        assert (moved > 0) == moves, (d, changed_at, moved)
    cotangents = jax.grad(lambda ls: mtp_loss(ls, tokens, None, 0.1).objective)(depths)
    assert all(c.dtype == jnp.float32 for c in cotangents)


def test_mtp_parameters_follow_hugging_faces_flat_layout(mtp_model):
    cfg, model = mtp_model
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))["mtp"]["layers"]
    flat = {j: set(flat_paths(params[str(j)])) for j in range(2)}
    assert flat == {j: set(mtp_layer_params(cfg, j)) for j in range(2)}
    assert "eh_proj.kernel" in flat[0] and "final_layernorm.scale" in flat[1]
    assert params["0"]["eh_proj"]["kernel"].shape == (64, 32)


# ----------------------------------------------------------------------------- config, policy


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"router": "topk"}, "model.moe.router must be 'softmax' or 'sigmoid'"),
        ({"n_group": 3}, "model.moe.n_group must be a divisor of num_experts=8"),
        ({"n_group": 8}, "model.moe.n_group must be 1, or leave >= 2 experts per group"),
        ({"topk_group": 3}, r"model.moe.topk_group must be in \[1, n_group=2\]"),
        ({"n_group": 4, "experts_per_token": 3}, "experts_per_token must be <= topk_group"),
        ({"routed_scaling_factor": 0.0}, "model.moe.routed_scaling_factor must be a finite"),
        ({"expert_activation": "gelu"}, "model.moe.expert_activation must be 'swiglu' or"),
        ({"latent_dim": 20}, "model.moe.latent_dim must be 0 .none. or a multiple of 16"),
        ({"mtp": {"num_layers": 1, "pattern": "*M"}}, "model.mtp.pattern must be a string of"),
        ({"mtp": {"num_layers": 2, "depths": 3}}, "model.mtp.depths must be 0 or num_layers=2"),
        ({"mtp": {"num_layers": 1, "loss_scaling_factor": -1.0}}, "loss_scaling_factor must"),
    ],
)
def test_bad_nemotron3_settings_name_the_key(changes, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**changes)


def test_mtp_and_nemotron3_moe_are_refused_where_no_class_builds_them():
    with pytest.raises(ValueError, match="model.mtp.num_layers must be 0 without a model.pattern"):
        ModelConfig(mtp=MTPConfig(num_layers=1))
    moe = MoEConfig(num_experts=4, expert_mlp_dim=16, router="sigmoid")
    with pytest.raises(ValueError, match=r"'qwen3_moe' builds model.moe.router in \('softmax',\)"):
        ModelConfig(architecture="qwen3_moe", qk_norm=True, moe=moe)


def test_policy_names_the_new_linears_mtp_in_bf16_latent_by_the_preset():
    cfg = _cfg(mtp={"num_layers": 1, "pattern": "*E"})
    names = layer_recipe_names(cfg, PrecisionConfig(bf16_first_layers=0, bf16_last_layers=0))
    assert names["layers.2.mlp.experts.up"] == names["layers.2.mlp.fc1_latent_proj"] == "nvfp4"
    assert {n for p, n in names.items() if p.startswith("mtp.")} == {"bf16"}
    assert "mtp.layers.0.eh_proj" in names and "mtp.layers.1.mlp.shared.up" in names
    preset = layer_recipe_names(cfg, PrecisionConfig(preset="nemotron-3-super",
                                                     bf16_last_layers=0))  # fmt: skip
    assert preset["layers.2.mlp.fc2_latent_proj"] == "bf16"
    assert preset["layers.2.mlp.experts.down"] == preset["layers.2.mlp.shared.down"] == "nvfp4"
    mtp4 = layer_recipe_names(cfg, PrecisionConfig(overrides=(r"mtp\..*=nvfp4",)))
    assert mtp4["mtp.layers.0.attn.qkv"] == "nvfp4"


def test_sharding_rules_name_the_new_kernels():
    mesh = AbstractMesh((1, 2, 2, 1), AXES)  # data, fsdp, expert, tensor: only sizes matter
    spec = lambda *path, shape: tuple(param_spec(path, shape, mesh))  # noqa: E731
    assert spec("layers", "2", "mlp", "experts", "up", "kernel", shape=(8, 16, 16)) == (
        "expert", "fsdp", None,
    )  # fmt: skip
    assert spec("layers", "2", "mlp", "fc1_latent_proj", "kernel", shape=(32, 16)) == ("fsdp", None)
    assert spec("layers", "2", "mlp", "fc2_latent_proj", "kernel", shape=(16, 32)) == (None, "fsdp")
    assert spec("mtp", "layers", "0", "eh_proj", "kernel", shape=(64, 32)) == ("fsdp", None)
    assert spec("layers", "2", "mlp", "router", "score_bias", shape=(8,)) == ()


def test_flops_count_relu2_latent_experts_and_mtp_depths():
    cfg = _cfg(mtp={"num_layers": 1, "pattern": "*E", "depths": 2})
    no_mtp = _cfg()
    d, mamba = 32, cfg.mamba
    attention = d * (2 + 2) * 16 + 2 * 16 * d
    moe = 2 * 16 * 2 * 16 + 2 * d * 32 + d * 8 + 2 * d * 16  # routed (latent), shared, router, fc
    blocks = d * mamba.in_proj_width + mamba.inner * d + attention + moe
    assert matmul_params(no_mtp) == blocks + d * 64
    assert matmul_params(cfg) == blocks + d * 64 + 2 * (attention + moe + 2 * d * d + d * 64)
