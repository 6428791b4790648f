"""`model.init_from` of Nemotron-H checkpoints without transformers: config.json (transformers 5's
form and the legacy one) -> `model.pattern`, `model.mamba` and the rest, weights from the Hub's
`backbone.*` layout and transformers' `model.*` one into the run's parameters, and the bad
checkpoints refused in one line before any weight is read (checkpoints written with
`safetensors.numpy` under the HF names). Parity with transformers itself:
integration_tests/test_hf_nemotron_h_import.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_hf_import import _canonical, write_model

from nvfp4_train.config.run_config import ConfigError, config_from_dict
from nvfp4_train.model.hf.config import HFConfigError, model_section
from nvfp4_train.model.hf.weights import HFImportError, unused_lines

NH = {
    "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "vocab_size": 64,
    "hidden_size": 32,
    "layers_block_type": ["linear_attention", "mlp", "linear_attention", "mlp", "full_attention"],
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 48,
    "mamba_num_heads": 16, "mamba_head_dim": 4, "ssm_state_size": 8, "n_groups": 2,
    "conv_kernel": 4, "use_conv_bias": True, "use_bias": False, "chunk_size": 16,
    "time_step_limit": [0.0, {"__float__": "Infinity"}], "time_step_min": 0.001,
    "time_step_max": 0.1, "time_step_floor": 1e-4, "layer_norm_epsilon": 1e-5,
    "max_position_embeddings": 128, "mlp_hidden_act": "relu2", "tie_word_embeddings": False,
    "eos_token_id": 2, "num_nextn_predict_layers": 0,
}  # fmt: skip
"""transformers 5's config.json of a 5-block Nemotron-H (M-M-*): d_inner 64, conv_dim 96."""
PATTERN = "M-M-*"
LEGACY = {
    **{k: v for k, v in NH.items() if k not in ("layers_block_type", "n_groups", "conv_kernel",
       "use_conv_bias", "chunk_size", "time_step_limit", "time_step_min", "time_step_max",
       "time_step_floor", "head_dim")},
    "hybrid_override_pattern": PATTERN, "num_hidden_layers": 5, "mamba_n_groups": 2,
    "mamba_d_conv": 4, "mamba_conv_bias": True, "mamba_chunk_size": 16,
    "mamba_dt_limit": [0.0, math.inf], "mamba_dt_min": 0.001, "mamba_dt_max": 0.1,
    "mamba_dt_init_floor": 1e-4, "mamba_expand": 2, "attention_head_dim": 16,
}  # fmt: skip
"""The same model as NVIDIA's remote-code config.json writes it."""


def nh_tensors(hf: dict, rng, prefix: str = "backbone.") -> dict[str, np.ndarray]:
    """Random weights under Nemotron-H's names for `NH`'s shapes ("backbone." the Hub's layout,
    "model." transformers')."""
    d, v, f = hf["hidden_size"], hf["vocab_size"], hf["intermediate_size"]
    h, inner, conv = 16, 64, 64 + 2 * 2 * 8
    shapes = {prefix + "embeddings.weight": (v, d), prefix + "norm_f.weight": (d,),
              "lm_head.weight": (v, d)}  # fmt: skip
    for i, kind in enumerate(PATTERN):
        m = f"{prefix}layers.{i}.mixer."
        shapes[f"{prefix}layers.{i}.norm.weight"] = (d,)
        shapes |= {
            "M": {m + "in_proj.weight": (2 * inner + 2 * 2 * 8 + h, d), m + "conv1d.weight":
                  (conv, 1, 4), m + "conv1d.bias": (conv,), m + "dt_bias": (h,), m + "A_log": (h,),
                  m + "D": (h,), m + "norm.weight": (inner,), m + "out_proj.weight": (d, inner)},
            "*": {m + "q_proj.weight": (32, d), m + "k_proj.weight": (16, d),
                  m + "v_proj.weight": (16, d), m + "o_proj.weight": (d, 32)},
            "-": {m + "up_proj.weight": (f, d), m + "down_proj.weight": (d, f)},
        }[kind]  # fmt: skip
    return {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}


def _expected(t: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    out = {"embed.embedding": t[prefix + "embeddings.weight"],
           "final_norm.scale": t[prefix + "norm_f.weight"], "lm_head.kernel": t["lm_head.weight"].T}  # fmt: skip
    for i, kind in enumerate(PATTERN):
        m, q = f"{prefix}layers.{i}.mixer.", f"layers.{i}."
        out[q + "norm.scale"] = t[f"{prefix}layers.{i}.norm.weight"]
        if kind == "M":
            out |= {q + "mamba.in_proj.kernel": t[m + "in_proj.weight"].T,
                    q + "mamba.conv1d.kernel": t[m + "conv1d.weight"][:, 0, :].T,
                    q + "mamba.conv1d.bias": t[m + "conv1d.bias"],
                    q + "mamba.norm.scale": t[m + "norm.weight"],
                    q + "mamba.out_proj.kernel": t[m + "out_proj.weight"].T}  # fmt: skip
            out |= {q + f"mamba.{n}": t[m + n] for n in ("dt_bias", "A_log", "D")}
        elif kind == "*":
            qkv = [t[m + f"{n}_proj.weight"].T for n in "qkv"]
            out[q + "attn.qkv.kernel"] = np.concatenate(qkv, axis=1)
            out[q + "attn.o.kernel"] = t[m + "o_proj.weight"].T
        else:
            out[q + "mlp.up.kernel"] = t[m + "up_proj.weight"].T
            out[q + "mlp.down.kernel"] = t[m + "down_proj.weight"].T
    return out


def _load(path, **model):
    """(cfg, params, unused) of `path` imported with the BF16 recipe (every block alike, so
    repeating blocks stack when scanned)."""
    import jax

    from nvfp4_train.mesh.sharding import make_mesh, tree_shardings
    from nvfp4_train.model.hf.weights import load_hf_params
    from nvfp4_train.training.resume import abstract_state

    cfg = config_from_dict({"model": {"init_from": str(path), **model},
                            "precision": {"recipe": "bf16"}})  # fmt: skip
    _, abstract = abstract_state(cfg)
    shardings = tree_shardings(abstract, abstract.params, make_mesh(cfg.mesh, jax.devices()))
    return cfg, *load_hf_params(path, cfg.model, abstract.params, shardings.params)


# ----------------------------------------------------------------------------- config.json


def test_both_config_forms_give_the_same_section():
    section = model_section(NH)
    assert section == model_section(LEGACY)
    assert (section["architecture"], section["pattern"], section["num_layers"]) == (
        "nemotron_h", PATTERN, 5,
    )  # fmt: skip
    assert (section["rope"], section["mlp_activation"], section["tie_embeddings"]) == (
        False, "relu2", False,
    )  # fmt: skip
    assert section["mamba"] == {
        "num_heads": 16, "head_dim": 4, "state_dim": 8, "n_groups": 2, "conv_kernel": 4,
        "conv_bias": True, "proj_bias": False, "chunk_size": 16, "time_step_limit": [],
        "time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 1e-4,
    }  # fmt: skip
    assert (section["rms_norm_eps"], section["max_seq_len"], section["head_dim"]) == (1e-5, 128, 16)
    old_names = {**NH, "layers_block_type": ["mamba", "mlp", "mamba", "mlp", "attention"]}
    assert model_section(old_names)["pattern"] == PATTERN
    clipped = model_section({**LEGACY, "mamba_dt_limit": [0.001, 0.5]})
    assert clipped["mamba"]["time_step_limit"] == [0.001, 0.5]


@pytest.mark.parametrize("change, message", [
    ({"hybrid_override_pattern": "M-*E", "layers_block_type": None, "n_shared_experts": 0},
     "n_shared_experts=0 is not supported for nemotron_h"),
    ({"hybrid_override_pattern": "M-*-", "layers_block_type": None, "num_hidden_layers": 6},
     "num_hidden_layers=6 but its pattern 'M-\\*-' has 4 blocks"),
    ({"hybrid_override_pattern": "M-M-M"}, "gives hybrid_override_pattern='M-M-M' and "
     "layers_block_type=.* which disagree"),
    ({"layers_block_type": ["mamba", "sliding_attention"]}, "'sliding_attention' at block 1"),
    ({"mlp_hidden_act": "silu"}, "mlp_hidden_act='silu' is not supported for nemotron_h"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings=True is not supported"),
    ({"time_step_limit": [0.0, "lots"]}, "time_step_limit must hold numbers, got 'lots'"),
    ({"model_type": "mamba", "architectures": ["MambaForCausalLM"]},
     r"MambaForCausalLM \(model_type 'mamba'\) is not imported: Mamba-1"),
    ({"model_type": "jamba"}, r"JambaForCausalLM \(model_type 'jamba'\) is not imported"),
    ({"model_type": "falcon_h1"}, r"FalconH1ForCausalLM \(model_type 'falcon_h1'\)"),
    ({"model_type": "zamba2"}, r"Zamba2ForCausalLM \(model_type 'zamba2'\)"),
])  # fmt: skip
def test_checkpoints_the_import_does_not_compute_are_refused_in_one_line(change, message):
    hf = {k: v for k, v in {**NH, **change}.items() if v is not None}
    with pytest.raises(HFConfigError, match=message) as e:
        model_section(hf)
    assert "\n" not in str(e.value)


def test_the_config_loader_merges_the_users_keys(tmp_path):
    model_dir = write_model(tmp_path / "m", NH, {})
    base = {"init_from": str(model_dir), "dtype": "float32"}
    kinds = ["mamba", "mlp", "mamba", "mlp", "attention"]
    cfg = config_from_dict({"model": {**base, "pattern": kinds, "mamba": {"chunk_size": 8}}})
    assert cfg.model.pattern == PATTERN and not cfg.model.rope
    assert cfg.model.mamba.chunk_size == 8 and cfg.model.mamba.num_heads == 16  # the run's chunks
    with pytest.raises(ConfigError, match=r"model.mamba.n_groups=4 but .*config.json gives 2"):
        config_from_dict({"model": {**base, "mamba": {"n_groups": 4}}})
    with pytest.raises(
        ConfigError, match=r"model.pattern='M-M-M' but .*config.json gives 'M-M-\*'"
    ):
        config_from_dict({"model": {**base, "pattern": "M-M-M"}})
    with pytest.raises(ConfigError, match=r"model.rope=True but"):
        config_from_dict({"model": {**base, "rope": True}})


def test_the_continue_from_hf_example_loads_with_a_nemotron_h(tmp_path):
    from pathlib import Path

    from nvfp4_train.config.run_config import load_config

    model_dir = write_model(tmp_path / "m", {**NH, "max_position_embeddings": 4096}, {})
    example = Path(__file__).resolve().parents[3] / "examples/configs/nemotron-h-from-hf.yaml"
    cfg = load_config(example, [f"model.init_from={model_dir}"])
    assert cfg.model.architecture == "nemotron_h" and cfg.model.pattern == PATTERN
    assert cfg.train.seq_len <= cfg.model.max_seq_len and cfg.data.tokenizer_path == str(model_dir)


# ----------------------------------------------------------------------------- weights


@pytest.mark.parametrize("prefix, scan", [("backbone.", False), ("model.", True)],
                         ids=["hub-unrolled", "library-scanned"])  # fmt: skip
def test_weights_land_from_either_layout(tmp_path, prefix, scan):
    tensors = nh_tensors(NH, np.random.default_rng(0), prefix)
    config = LEGACY if prefix == "backbone." else NH
    cfg, params, unused = _load(write_model(tmp_path / "m", config, tensors), scan_layers=scan)
    assert unused == []
    assert scan == any("-" in key for key in params["layers"])  # (M-) x 2 stacked when scanned
    got, want = _canonical(cfg, params), _expected(tensors, prefix)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_bad_checkpoints_are_named_before_reading(tmp_path):
    rng = np.random.default_rng(1)
    tensors = nh_tensors(NH, rng)
    cases = {
        "missing": ({k: v for k, v in tensors.items() if not k.endswith("0.mixer.dt_bias")},
                    r"no tensor 'backbone.layers.0.mixer.dt_bias'"),
        "conv": ({**tensors, "backbone.layers.0.mixer.conv1d.weight": np.ones((96, 1, 3), "f4")},
                 r"conv1d.weight has shape \(96, 1, 3\), but config.json implies \(96, 1, 4\)"),
        "pattern": ({**{k: v for k, v in tensors.items() if "layers.4.mixer" not in k},
                     "backbone.layers.4.mixer.up_proj.weight": np.ones((48, 32), "f4"),
                     "backbone.layers.4.mixer.down_proj.weight": np.ones((32, 48), "f4")},
                    r"pattern 'M-M-\*' makes block 4 attention \('\*'\) but backbone.layers.4.mixer "
                    r"holds \['down_proj', 'up_proj'\] \(mlp tensors\)"),
        "beyond": ({**tensors, "backbone.layers.5.mixer.up_proj.weight": np.ones((48, 32), "f4")},
                   r"holds block 5 \(backbone.layers.5.mixer.\*\) but config.json's pattern 'M-M-\*' "
                   "has 5 blocks"),
        "layout": ({k.replace("backbone.", "transformer."): v for k, v in tensors.items()},
                   r"neither 'backbone.embeddings.weight' \(the Hub's"),
    }  # fmt: skip
    for case, (bad, message) in cases.items():
        with pytest.raises(HFImportError, match=message) as e:
            _load(write_model(tmp_path / case, NH, bad))
        assert "\n" not in str(e.value), case


def test_mtp_tensors_are_dropped_with_a_line(tmp_path):
    tensors = nh_tensors(NH, np.random.default_rng(2))
    mtp = {f"mtp.layers.0.{n}": np.ones((32,), "f4") for n in ("enorm.weight", "hnorm.weight")}
    hf = {**NH, "num_nextn_predict_layers": 1, "mtp_layers_block_type": ["attention", "mlp"]}
    _, _, unused = _load(write_model(tmp_path / "m", hf, {**tensors, **mtp, "extra": np.ones(2)}))
    assert unused == ["extra", *sorted(mtp)]
    assert unused_lines(unused) == [
        "model.init_from: dropping the 2 multi-token-prediction (MTP) tensors (mtp.*): the run "
        "trains without MTP",
        "warning: 1 tensors of the checkpoint are not used: ['extra']",
    ]
