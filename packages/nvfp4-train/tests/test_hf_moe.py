"""`model.init_from` of Mixture-of-Experts checkpoints without transformers: config.json ->
`model.moe`, and the experts, router and shared expert read from the per-expert and the fused
layouts into the run's parameters (checkpoints written with `safetensors.numpy` under the HF
names). Parity with transformers itself: integration_tests/test_hf_moe_import.py."""

from __future__ import annotations

import numpy as np
import pytest
from test_hf_import import QWEN3, _canonical, _load, hf_tensors, write_model

from nvfp4_train.model.hf.config import HFConfigError, model_section
from nvfp4_train.model.hf.weights import HFImportError

MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
       "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1]}  # fmt: skip


def _hf(kind: str) -> dict:
    hf = {**QWEN3, **MOE, "model_type": kind}
    if kind == "mixtral":
        hf = {**hf, "intermediate_size": 16, "num_local_experts": 4, "attention_bias": False,
              "mlp_only_layers": [], "sliding_window": None}  # fmt: skip
        del hf["num_experts"]
    if kind == "qwen2_moe":
        hf = {**hf, "shared_expert_intermediate_size": 32, "attention_bias": False}
    return hf


def _moe_tensors(hf: dict, rng, fused: bool) -> dict[str, np.ndarray]:
    """Dense tensors of `hf` (attention, norms; MLPs of its dense blocks) plus its MoE blocks."""
    kind, d = hf["model_type"], hf["hidden_size"]
    f, e = hf.get("moe_intermediate_size") if kind != "mixtral" else hf["intermediate_size"], 4
    base = {**hf, "model_type": {"mixtral": "mistral", "qwen2_moe": "qwen2"}.get(kind, "qwen3")}
    tensors = hf_tensors(base, rng)
    block = "block_sparse_moe" if kind == "mixtral" and not fused else "mlp"
    names = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for i in range(hf["num_hidden_layers"]):
        if i in hf.get("mlp_only_layers", []):
            continue
        p = f"model.layers.{i}."
        for n in ("gate_proj", "up_proj", "down_proj"):
            del tensors[p + f"mlp.{n}.weight"]
        tensors[p + f"{block}.gate.weight"] = rng.normal(size=(e, d)).astype(np.float32)
        if fused:
            tensors[p + "mlp.experts.gate_up_proj"] = rng.normal(size=(e, 2 * f, d)).astype(
                np.float32
            )
            tensors[p + "mlp.experts.down_proj"] = rng.normal(size=(e, d, f)).astype(np.float32)
        else:
            for x in range(e):
                for n, shape in zip(names, ((f, d), (f, d), (d, f)), strict=True):
                    tensors[p + f"{block}.experts.{x}.{n}.weight"] = rng.normal(size=shape).astype(
                        np.float32
                    )
        if kind == "qwen2_moe":
            s = hf["shared_expert_intermediate_size"]
            for n, shape in (("gate_proj", (s, d)), ("up_proj", (s, d)), ("down_proj", (d, s))):
                tensors[p + f"mlp.shared_expert.{n}.weight"] = rng.normal(size=shape).astype(
                    np.float32
                )
            tensors[p + "mlp.shared_expert_gate.weight"] = rng.normal(size=(1, d)).astype(
                np.float32
            )
    return tensors


def test_moe_sections_per_class():
    qwen3 = model_section(_hf("qwen3_moe"))
    assert qwen3["architecture"] == "qwen3_moe" and qwen3["qk_norm"]
    assert qwen3["moe"] == {"num_experts": 4, "experts_per_token": 2, "norm_topk_prob": True,
                            "aux_loss_coef": 0.001, "expert_mlp_dim": 16, "layer_freq": 1,
                            "dense_layers": [1]}  # fmt: skip
    mixtral = model_section({**_hf("mixtral"), "norm_topk_prob": False})
    assert mixtral["moe"]["norm_topk_prob"] is True and mixtral["moe"]["expert_mlp_dim"] == 16
    assert mixtral["qk_norm"] is False and mixtral["qkv_bias"] is False
    qwen2 = model_section(_hf("qwen2_moe"))
    assert qwen2["qkv_bias"] and not qwen2["o_bias"]
    assert {
        k: qwen2["moe"][k]
        for k in ("shared_experts", "shared_expert_mlp_dim", "shared_expert_gate")
    } == {  # fmt: skip
        "shared_experts": 1,
        "shared_expert_mlp_dim": 32,
        "shared_expert_gate": True,
    }


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "deepseek_v3"}, "multi-head latent attention"),
    ({"router_jitter_noise": 0.01}, "router_jitter_noise=0.01 is not supported"),
    ({"shared_expert_intermediate_size": 64}, "builds no shared expert"),
    ({"num_experts": 0}, "num_experts must be a whole number > 0"),
    ({"mlp_only_layers": "1"}, "mlp_only_layers must be a list"),
])  # fmt: skip
def test_moe_options_the_block_does_not_implement_are_refused(changes, message):
    with pytest.raises(HFConfigError, match=message):
        model_section({**_hf("qwen3_moe"), **changes})


@pytest.mark.parametrize("kind, fused", [("qwen3_moe", False), ("qwen3_moe", True),
                                         ("mixtral", False), ("mixtral", True),
                                         ("qwen2_moe", False)])  # fmt: skip
def test_experts_router_and_shared_expert_land_in_their_parameters(tmp_path, kind, fused):
    hf = _hf(kind)
    tensors = _moe_tensors(hf, np.random.default_rng(0), fused)
    cfg, params, unused = _load(write_model(tmp_path / "m", hf, tensors, shards=2), dtype="float32")
    assert unused == []
    got = _canonical(cfg, params)
    block = "block_sparse_moe" if kind == "mixtral" and not fused else "mlp"
    p = "model.layers.0."
    np.testing.assert_array_equal(
        got["layers.0.mlp.router.kernel"], tensors[p + f"{block}.gate.weight"].T
    )
    np.testing.assert_array_equal(got["layers.0.mlp.router.score_bias"], np.zeros(4, np.float32))
    for e in (0, 3):
        if fused:
            gate_up = tensors[p + "mlp.experts.gate_up_proj"][e].T
            down = tensors[p + "mlp.experts.down_proj"][e].T
        else:
            g, u, dn = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj",
                                                                      "down_proj")  # fmt: skip
            x = p + f"{block}.experts.{e}."
            gate_up = np.concatenate(
                [tensors[x + f"{g}.weight"].T, tensors[x + f"{u}.weight"].T], 1
            )
            down = tensors[x + f"{dn}.weight"].T
        np.testing.assert_array_equal(got["layers.0.mlp.experts.gate_up.kernel"][e], gate_up)
        np.testing.assert_array_equal(got["layers.0.mlp.experts.down.kernel"][e], down)
    if kind == "qwen2_moe":
        np.testing.assert_array_equal(got["layers.0.mlp.shared_gate.kernel"],
                                      tensors[p + "mlp.shared_expert_gate.weight"].T)  # fmt: skip
    if kind == "qwen3_moe":  # block 1 is dense (mlp_only_layers)
        assert "layers.1.mlp.gate_up.kernel" in got and "layers.1.mlp.router.kernel" not in got


def test_a_missing_expert_and_a_bigger_router_are_refused_before_reading(tmp_path):
    hf = _hf("qwen3_moe")
    tensors = _moe_tensors(hf, np.random.default_rng(1), False)
    missing = {k: v for k, v in tensors.items() if ".experts.2." not in k}
    with pytest.raises(HFImportError, match=r"layer 0 lacks expert 2 \(missing experts \[2\]"):
        _load(write_model(tmp_path / "a", hf, missing))
    extra = {
        **tensors,
        "model.layers.0.mlp.experts.4.gate_proj.weight": np.zeros((16, 32), np.float32),
    }
    with pytest.raises(HFImportError, match="holds expert 4, beyond config.json's num_experts=4"):
        _load(write_model(tmp_path / "b", hf, extra))
    router = {**tensors, "model.layers.0.mlp.gate.weight": np.zeros((6, 32), np.float32)}
    with pytest.raises(HFImportError, match="routes to 6 experts"):
        _load(write_model(tmp_path / "c", hf, router))
