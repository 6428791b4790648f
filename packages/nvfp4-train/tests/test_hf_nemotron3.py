"""`model.init_from` of Nemotron 3 (a `NemotronHForCausalLM` with MoE blocks and MTP layers)
without transformers: config.json -> `model.moe` / `model.mtp`, the MoE blocks' router, experts
(per expert as the Hub holds them, or stacked as transformers holds them), shared expert and
LatentMoE projections, and the MTP layers (`mtp.layers.{j}.*`, NVIDIA's names) into the run's
parameters; malformed checkpoints refused in one line before any weight is read. Parity with
transformers itself: integration_tests/test_hf_nemotron3_import.py."""

from __future__ import annotations

import numpy as np
import pytest
from test_hf_import import _canonical, write_model
from test_hf_nemotron_h import NH, _load, nh_tensors

from nvfp4_train.config.run_config import ConfigError, config_from_dict
from nvfp4_train.model.hf.config import HFConfigError, model_section
from nvfp4_train.model.hf.weights import HFImportError, unused_lines

E, F, S, LATENT = 4, 16, 32, 16
NH3 = {
    **NH, "layers_block_type": ["linear_attention", "moe", "full_attention", "moe"],
    "n_routed_experts": E, "num_experts_per_tok": 2, "moe_intermediate_size": F,
    "moe_shared_expert_intermediate_size": S, "n_shared_experts": 1, "n_group": 2,
    "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "moe_latent_size": None,
    "num_nextn_predict_layers": 1, "mtp_layers_block_type": ["attention", "moe"],
}  # fmt: skip
"""transformers 5's config.json of a 4-block Nemotron 3 (M E * E, 4 experts in 2 groups, one
shared expert) with one MTP module of an attention and an MoE layer (Super's `*E`)."""
PATTERN = "ME*E"


def _moe_tensors(mixer: str, d: int, w: int, stacked: bool, latent: bool, rng) -> dict:
    """Random MoE tensors under `mixer` (experts of input width `w`)."""
    shapes = {mixer + "gate.weight": (E, d), mixer + "gate.e_score_correction_bias": (E,),
              mixer + "shared_experts.up_proj.weight": (S, d),
              mixer + "shared_experts.down_proj.weight": (d, S)}  # fmt: skip
    if stacked:
        shapes |= {mixer + "experts.up_proj": (E, F, w), mixer + "experts.down_proj": (E, w, F)}
    else:
        for e in range(E):
            shapes[f"{mixer}experts.{e}.up_proj.weight"] = (F, w)
            shapes[f"{mixer}experts.{e}.down_proj.weight"] = (w, F)
    if latent:
        shapes |= {
            mixer + "fc1_latent_proj.weight": (w, d),
            mixer + "fc2_latent_proj.weight": (d, w),
        }
    return {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}


def nh3_tensors(prefix: str, stacked: bool, latent: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights of `NH3` (LatentMoE with `latent`) under Nemotron-H's names, MTP included."""
    rng, d = np.random.default_rng(seed), NH["hidden_size"]
    w = LATENT if latent else d
    dense = nh_tensors(NH, rng, prefix)  # blocks 0 (M) and 4 (*) have PATTERN's blocks 0 and 2
    out = {k: v for k, v in dense.items() if ".layers." not in k}
    for i, j in ((0, 0), (2, 4)):
        old, new = f"{prefix}layers.{j}.", f"{prefix}layers.{i}."
        out |= {k.replace(old, new): v for k, v in dense.items() if k.startswith(old)}
    for i in (1, 3):
        out[f"{prefix}layers.{i}.norm.weight"] = rng.normal(size=d).astype(np.float32)
        out |= _moe_tensors(f"{prefix}layers.{i}.mixer.", d, w, stacked, latent, rng)
    attn = {k.replace(f"{prefix}layers.2.", "mtp.layers.0."): v + 1 for k, v in out.items()
            if k.startswith(f"{prefix}layers.2.")}  # fmt: skip
    out |= attn | _moe_tensors("mtp.layers.1.mixer.", d, w, stacked, latent, rng)
    out |= {f"mtp.layers.{n}.weight": rng.normal(size=d).astype(np.float32)
            for n in ("0.enorm", "0.hnorm", "1.norm", "1.final_layernorm")}  # fmt: skip
    out["mtp.layers.0.eh_proj.weight"] = rng.normal(size=(d, 2 * d)).astype(np.float32)
    return out


def _moe_expected(t: dict, mixer: str, ours: str, stacked: bool, latent: bool) -> dict:
    if stacked:
        up, down = t[mixer + "experts.up_proj"], t[mixer + "experts.down_proj"]
    else:
        up = np.stack([t[f"{mixer}experts.{e}.up_proj.weight"] for e in range(E)])
        down = np.stack([t[f"{mixer}experts.{e}.down_proj.weight"] for e in range(E)])
    out = {"router.kernel": t[mixer + "gate.weight"].T,
           "router.score_bias": t[mixer + "gate.e_score_correction_bias"],
           "experts.up.kernel": up.transpose(0, 2, 1), "experts.down.kernel": down.transpose(0, 2, 1),
           "shared.up.kernel": t[mixer + "shared_experts.up_proj.weight"].T,
           "shared.down.kernel": t[mixer + "shared_experts.down_proj.weight"].T}  # fmt: skip
    if latent:
        out["fc1_latent_proj.kernel"] = t[mixer + "fc1_latent_proj.weight"].T
        out["fc2_latent_proj.kernel"] = t[mixer + "fc2_latent_proj.weight"].T
    return {f"{ours}mlp.{k}": v for k, v in out.items()}


def _config(tmp_path, tensors=None, **hf):
    return write_model(tmp_path, {**NH3, **hf}, tensors or {})


# ----------------------------------------------------------------------------- config.json


def test_the_moe_and_mtp_keys_give_model_moe_and_model_mtp():
    section = model_section(NH3)
    assert section["pattern"] == PATTERN and section["mtp"] == {"num_layers": 1, "pattern": "*E"}
    assert section["moe"] == {
        "num_experts": E, "experts_per_token": 2, "expert_mlp_dim": F, "shared_experts": 1,
        "shared_expert_mlp_dim": S, "norm_topk_prob": True, "router": "sigmoid", "n_group": 2,
        "topk_group": 1, "routed_scaling_factor": 2.5, "expert_activation": "relu2",
        "latent_dim": 0,
    }  # fmt: skip
    legacy = {k: v for k, v in NH3.items() if k not in ("layers_block_type", "n_routed_experts",
                                                         "mtp_layers_block_type")}  # fmt: skip
    legacy |= {"hybrid_override_pattern": PATTERN, "num_local_experts": E,
               "mtp_hybrid_override_pattern": "*E", "moe_latent_size": LATENT}  # fmt: skip
    assert model_section(legacy)["moe"] == {**section["moe"], "latent_dim": LATENT}
    no_mtp = model_section({**NH3, "num_nextn_predict_layers": 0})
    assert "mtp" not in no_mtp and no_mtp["moe"] == section["moe"]


@pytest.mark.parametrize("change, message", [
    ({"n_shared_experts": 2}, "n_shared_experts=2 is not supported for nemotron_h"),
    ({"n_routed_experts": 4.5}, "n_routed_experts must be a whole number, got 4.5"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false, got 'yes'"),
    ({"routed_scaling_factor": "big"}, "routed_scaling_factor must hold numbers, got 'big'"),
    ({"mtp_layers_block_type": ["attention", "sliding"]}, "'sliding' at block 1"),
])  # fmt: skip
def test_moe_configs_the_import_does_not_compute_are_refused_in_one_line(change, message):
    with pytest.raises(HFConfigError, match=message) as e:
        model_section({**NH3, **change})
    assert "\n" not in str(e.value)


def test_mtp_is_on_only_when_the_run_asks_for_it(tmp_path):
    base = {"init_from": str(_config(tmp_path / "m")), "dtype": "float32"}
    off = config_from_dict({"model": base}).model
    assert (off.mtp.num_layers, off.moe.num_experts, off.moe.n_group) == (0, E, 2)
    on = config_from_dict({"model": {**base, "mtp": {"num_layers": 1, "depths": 2}}}).model
    assert (on.mtp.num_layers, on.mtp.pattern, on.mtp.depths) == (1, "*E", 2)
    only_mtp_moe = {"init_from": str(_config(tmp_path / "d", layers_block_type=["mamba", "mlp"]))}
    assert config_from_dict({"model": only_mtp_moe}).model.moe.num_experts == 0
    assert (
        config_from_dict({"model": {**only_mtp_moe, "mtp": {"num_layers": 1}}}).model.moe.router
        == "sigmoid"
    )
    refused = {
        "m": ({"mtp": {"num_layers": 1, "pattern": "*-"}}, r"model.mtp.pattern='\*-' but .* '\*E'"),
        "n": ({"mtp": {"num_layers": 1}}, r"num_nextn_predict_layers=0\); the import loads MTP"),
        "m2": ({"moe": {"n_group": 1}}, r"model.moe.n_group=1 but .*config.json gives 2"),
    }  # fmt: skip
    _config(tmp_path / "n", num_nextn_predict_layers=0)
    for name, (keys, message) in refused.items():
        model = {"init_from": str(tmp_path / name.removesuffix("2")), **keys}
        with pytest.raises(ConfigError, match=message):
            config_from_dict({"model": model})


# ----------------------------------------------------------------------------- weights


@pytest.mark.parametrize("prefix, stacked, latent, scan", [
    ("backbone.", False, False, False), ("model.", True, True, True),
], ids=["hub-nano-unrolled", "library-latent-scanned"])  # fmt: skip
def test_moe_and_mtp_weights_land_from_either_layout(tmp_path, prefix, stacked, latent, scan):
    t = nh3_tensors(prefix, stacked, latent)
    hf = {"moe_latent_size": LATENT if latent else None}
    cfg, params, unused = _load(_config(tmp_path / "m", t, **hf), scan_layers=scan,
                                mtp={"num_layers": 1})  # fmt: skip
    assert unused == [] and cfg.model.moe.latent_dim == (LATENT if latent else 0)
    got = _canonical(cfg, params)
    want = {}
    for mixer, ours in ((f"{prefix}layers.1.mixer.", "layers.1."),
                        (f"{prefix}layers.3.mixer.", "layers.3."),
                        ("mtp.layers.1.mixer.", "mtp.layers.1.")):  # fmt: skip
        want |= _moe_expected(t, mixer, ours, stacked, latent)
    want |= {"mtp.layers.0.eh_proj.kernel": t["mtp.layers.0.eh_proj.weight"].T,
             "mtp.layers.0.enorm.scale": t["mtp.layers.0.enorm.weight"],
             "mtp.layers.1.final_layernorm.scale": t["mtp.layers.1.final_layernorm.weight"],
             "mtp.layers.0.attn.o.kernel": t["mtp.layers.0.mixer.o_proj.weight"].T,
             "layers.3.norm.scale": t[f"{prefix}layers.3.norm.weight"],
             "layers.2.attn.o.kernel": t[f"{prefix}layers.2.mixer.o_proj.weight"].T}  # fmt: skip
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_mtp_layers_are_dropped_with_a_line_when_mtp_is_off(tmp_path):
    t = nh3_tensors("backbone.", False, False)
    cfg, _, unused = _load(_config(tmp_path / "m", t))
    assert cfg.model.mtp.num_layers == 0
    assert unused == sorted(n for n in t if n.startswith("mtp."))
    assert unused_lines(unused)[0].startswith(f"model.init_from: dropping the {len(unused)} multi")


def test_bad_moe_checkpoints_are_named_before_reading(tmp_path):
    t = nh3_tensors("backbone.", False, False, seed=1)
    s = nh3_tensors("model.", True, False, seed=1)
    m = "backbone.layers.3.mixer."
    cases = {
        "missing": ({k: v for k, v in t.items() if ".3.mixer.experts.2." not in k},
                    r"backbone.layers.3.mixer lacks expert 2 \(missing experts \[2\] of "
                    r"n_routed_experts=4\)"),
        "down": ({k: v for k, v in t.items() if k != m + "experts.1.down_proj.weight"},
                 r"no tensor 'backbone.layers.3.mixer.experts.1.down_proj.weight'"),
        "beyond": ({**t, m + "experts.4.up_proj.weight": np.ones((F, 32), "f4")},
                   r"backbone.layers.3.mixer holds expert 4, beyond config.json's n_routed_experts=4"),
        "router": ({**t, m + "gate.weight": np.ones((5, 32), "f4")},
                   r"gate.weight routes to 5 experts, but config.json gives n_routed_experts=4"),
        "stacked": ({**s, "model.layers.1.mixer.experts.up_proj": np.ones((3, F, 32), "f4")},
                    r"model.layers.1.mixer.experts.up_proj stacks 3 experts, but config.json "
                    "gives n_routed_experts=4"),
        "shape": ({**t, m + "shared_experts.up_proj.weight": np.ones((S + 16, 32), "f4")},
                  r"'backbone.layers.3.mixer.shared_experts.up_proj.weight' has shape \(48, 32\), "
                  r"the config implies \(32, 32\)"),
        "mtp": ({k: v for k, v in t.items() if "mtp.layers.1.mixer.experts.0." not in k},
                r"mtp.layers.1.mixer lacks expert 0"),
    }  # fmt: skip
    for case, (bad, message) in cases.items():
        with pytest.raises(HFImportError, match=message) as e:
            _load(write_model(tmp_path / case, NH3, bad), mtp={"num_layers": 1})
        assert "\n" not in str(e.value), case


def test_the_nemotron_3_example_loads_with_a_nemotron_3(tmp_path):
    from pathlib import Path

    from nvfp4_train.config.run_config import load_config

    model_dir = _config(tmp_path / "m", max_position_embeddings=4096)
    example = Path(__file__).resolve().parents[3] / "examples/configs/nemotron-3-from-hf.yaml"
    cfg = load_config(example, [f"model.init_from={model_dir}"])
    assert (cfg.model.pattern, cfg.model.moe.router, cfg.model.mtp.num_layers) == (
        PATTERN, "sigmoid", 0,
    )  # fmt: skip
    assert cfg.model.moe.bias_update_rate == 0.001 and cfg.data.tokenizer_path == str(model_dir)
