"""Nemotron 3's MoE against transformers' own modules (`NemotronHTopkRouter`, `NemotronHMoE`),
built at random by transformers and their weights copied in: float32, the BF16 recipe (nothing
quantized). The routers choose the same top-k set for every token (0 differing selections with a
non-zero `e_score_correction_bias`, grouped top-k and a routing scale) with the same weights, and
the MoE block (sigmoid router, squared-ReLU experts, shared expert, with and without LatentMoE)
gives transformers' output within 1e-5 of its largest value (float32 sums in another order)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
nemotron_h = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")

import nvfp4_ops  # noqa: E402
from nvfp4_train.model.config import ModelConfig, linear_paths  # noqa: E402
from nvfp4_train.model.moe.config import MoEConfig  # noqa: E402
from nvfp4_train.model.moe.layer import MoEMLP  # noqa: E402

D, E, K, F, S, GROUPS, TOPK_GROUP, SCALE = 32, 16, 3, 16, 32, 4, 2, 2.5


def _hf_config(latent: int | None):
    from transformers import NemotronHConfig

    return NemotronHConfig(
        hidden_size=D, layers_block_type=["moe"], n_routed_experts=E, num_experts_per_tok=K,
        moe_intermediate_size=F, moe_shared_expert_intermediate_size=S, n_shared_experts=1,
        moe_latent_size=latent, n_group=GROUPS, topk_group=TOPK_GROUP,
        routed_scaling_factor=SCALE, norm_topk_prob=True, mlp_hidden_act="relu2",
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64,
    )  # fmt: skip


def _hf_moe(latent: int | None):
    torch.manual_seed(0)
    moe = nemotron_h.NemotronHMoE(_hf_config(latent), layer_idx=0).float().eval()
    with torch.no_grad():  # random values everywhere, a bias that changes the choice
        for _, p in moe.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2)
        moe.gate.e_score_correction_bias.copy_(torch.randn(E) * 0.1)
    return moe


def _ours(moe, latent: int | None) -> MoEMLP:
    """Our MoE MLP with `moe`'s weights (transformers' [out, in] transposed to [in, out])."""
    config = MoEConfig(num_experts=E, experts_per_token=K, expert_mlp_dim=F, shared_experts=1,
                       shared_expert_mlp_dim=S, router="sigmoid", n_group=GROUPS,
                       topk_group=TOPK_GROUP, routed_scaling_factor=SCALE,
                       expert_activation="relu2", latent_dim=latent or 0)  # fmt: skip
    cfg = ModelConfig(vocab_size=64, d_model=D, num_layers=1, num_heads=2, num_kv_heads=1,
                      mlp_dim=64, architecture="nemotron_h", pattern="E", rope=False,
                      dtype="float32", moe=config)  # fmt: skip
    recipes = dict.fromkeys(linear_paths(cfg), nvfp4_ops.get_recipe("bf16"))
    ours = MoEMLP(cfg, recipes, "layers.0.mlp", rngs=nnx.Rngs(0), backend="emulated")
    w = {name: p.detach().numpy() for name, p in moe.named_parameters()}
    w["gate.e_score_correction_bias"] = moe.gate.e_score_correction_bias.numpy()
    copies = [
        (ours.router.kernel, w["gate.weight"].T),
        (ours.router.score_bias, w["gate.e_score_correction_bias"]),
        (ours.experts.up.kernel, w["experts.up_proj"].transpose(0, 2, 1)),
        (ours.experts.down.kernel, w["experts.down_proj"].transpose(0, 2, 1)),
        (ours.shared.up.kernel, w["shared_experts.up_proj.weight"].T),
        (ours.shared.down.kernel, w["shared_experts.down_proj.weight"].T),
    ]
    if latent:
        copies += [(ours.fc1_latent_proj.kernel, w["fc1_latent_proj.weight"].T),
                   (ours.fc2_latent_proj.kernel, w["fc2_latent_proj.weight"].T)]  # fmt: skip
    for param, value in copies:
        assert param.shape == value.shape
        param[...] = jnp.asarray(value)
    return ours


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(1).standard_normal((2, 40, D)).astype(np.float32)


def test_router_chooses_transformers_top_k_with_its_weights(tokens):
    moe = _hf_moe(None)
    ours = _ours(moe, None)
    x = tokens.reshape(-1, D)
    with torch.no_grad():
        _, want_w, want_e = moe.gate(torch.from_numpy(x))
    got = ours.router(jnp.asarray(x))
    want_e, want_w = want_e.numpy(), want_w.numpy()
    order_want, order_got = np.argsort(want_e, -1), np.argsort(np.asarray(got.experts_TxK), -1)
    got_e = np.take_along_axis(np.asarray(got.experts_TxK), order_got, -1)
    want_e = np.take_along_axis(want_e, order_want, -1)
    differing = int(np.sum(np.any(got_e != want_e, axis=-1)))
    assert differing == 0  # measured: 0 of 80 tokens
    got_w = np.take_along_axis(np.asarray(got.weights_TxK), order_got, -1)
    want_w = np.take_along_axis(want_w, order_want, -1)
    assert np.max(np.abs(got_w - want_w)) <= 1e-6 * SCALE  # measured: < 3e-7
    plain = np.argsort(-(1 / (1 + np.exp(-x @ ours.router.kernel[...]))), -1)[:, :K]
    assert np.any(np.sort(plain, -1) != got_e)  # the bias and the groups changed some choices


@pytest.mark.parametrize("latent", [None, 16], ids=["nano", "latent"])
def test_moe_block_matches_transformers(tokens, latent):
    moe = _hf_moe(latent)
    ours = _ours(moe, latent)
    with torch.no_grad():
        want = moe(torch.from_numpy(tokens)).numpy()
    got = np.asarray(ours(jnp.asarray(tokens), (None,) * 6))
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
