"""Nemotron-H (`nemotron_h`: Mamba-2, attention, relu2 MLP blocks) exports: the Hub's
`backbone.layers.{i}.mixer.*` names and shapes, the Mamba parameters unquantized and bit-exact,
the plain NVFP4 layout and the mixed one of Nemotron 3 Super's policy (MXFP8 as trained in
compressed-tensors, as FP8 per tensor in ModelOpt with its added error printed), `verify` and the
transformers reload on each, and every refusal one line before anything is written. The servers'
rules are test_hybrid_serving_rules.py."""

from __future__ import annotations

import importlib.util
import json

import ml_dtypes
import numpy as np
import pytest
from conftest import (
    HYBRID,
    HYBRID_EXPORTS,
    SMALL_MODEL,
    model_config,
    set_scalar_and_reseal,
    write_run,
)

import nvfp4_format
from nvfp4_export import ExportError, export_hf, load_export, read_checkpoint, resolve_checkpoint
from nvfp4_export.eight_bit_formats import fp8_of_mxfp8
from nvfp4_export.linears import compute_weight_t
from nvfp4_export.onnx_export import export_onnx
from nvfp4_export.verify import render, verify

L = "backbone.layers"
CLIENTS = all(importlib.util.find_spec(m) for m in ("torch", "transformers", "compressed_tensors"))


def _masters(run) -> dict:
    return read_checkpoint(resolve_checkpoint(run)).params


def _bf16(x) -> bytes:
    return np.ascontiguousarray(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)).tobytes()


def test_hub_names_shapes_and_the_mamba_tensors_as_trained(hybrid_runs, hybrid_exports):
    loaded = load_export(hybrid_exports["nvfp4", "modelopt"][0].out_dir)
    t, p = loaded.tensors, _masters(hybrid_runs["nvfp4"])
    assert not [n for n in t if n.startswith("model.")]  # the Hub's backbone.* names only
    assert t["backbone.embeddings.weight"].shape == (257, 32)
    assert t["backbone.norm_f.weight"].tobytes() == _bf16(p["final_norm.scale"])
    conv = p["layers.0.mamba.conv1d.kernel"]  # [K, C] -> torch Conv1d [C, 1, K], float32
    assert t[f"{L}.0.mixer.conv1d.weight"].tobytes() == np.ascontiguousarray(
        conv.T[:, None, :]).tobytes()  # fmt: skip
    for name in ("A_log", "D", "dt_bias"):  # float32, bit for bit: training computes with them
        assert t[f"{L}.0.mixer.{name}"].dtype == np.float32
        assert t[f"{L}.0.mixer.{name}"].tobytes() == p[f"layers.0.mamba.{name}"].tobytes()
    assert t[f"{L}.0.mixer.conv1d.bias"].tobytes() == p["layers.0.mamba.conv1d.bias"].tobytes()
    assert t[f"{L}.0.mixer.norm.weight"].tobytes() == _bf16(p["layers.0.mamba.norm.scale"])
    assert t[f"{L}.0.norm.weight"].dtype.name == "bfloat16"
    shapes = {"0.mixer.in_proj": (176, 16), "0.mixer.out_proj": (32, 32),
              "1.mixer.q_proj": (32, 16), "1.mixer.k_proj": (16, 16), "1.mixer.o_proj": (32, 16),
              "2.mixer.up_proj": (32, 16), "2.mixer.down_proj": (32, 16)}  # fmt: skip
    for module, shape in shapes.items():  # packed NVFP4 codes [out, in/2]
        assert (
            t[f"{L}.{module}.weight"].dtype == np.uint8 and t[f"{L}.{module}.weight"].shape == shape
        )
    assert t[f"{L}.3.mixer.in_proj.weight"].dtype.name == "bfloat16"  # the BF16 last block
    assert {f"{L}.{i}.mixer.{n}" for i in (0, 1) for n in ("q_proj", "k_proj", "v_proj")
            if i == 1} <= set(loaded.quantized_modules)  # fmt: skip
    scales = {t[f"{L}.1.mixer.{n}_proj.weight_scale_2"].item() for n in "qkv"}
    assert len(scales) == 1  # q/k/v share one global scale (servers fuse them)


def test_config_json_is_nemotron_h(hybrid_exports):
    config = json.loads((hybrid_exports["nvfp4", "bf16"][0].out_dir / "config.json").read_text())
    assert config["architectures"] == ["NemotronHForCausalLM"]
    assert config["hybrid_override_pattern"] == "M*-M" and config["mlp_hidden_act"] == "relu2"
    mamba = {k: config[k] for k in ("mamba_num_heads", "mamba_head_dim", "ssm_state_size",
                                    "n_groups", "conv_kernel", "chunk_size")}  # fmt: skip
    assert mamba == {"mamba_num_heads": 16, "mamba_head_dim": 4, "ssm_state_size": 8,
                     "n_groups": 2, "conv_kernel": 4, "chunk_size": 8}  # fmt: skip
    assert "time_step_limit" not in config  # no clip trained: every reader's default (0, inf)


def test_plain_nvfp4_metadata_has_the_nano_checkpoints_form(hybrid_exports):
    loaded = load_export(hybrid_exports["nvfp4", "modelopt"][0].out_dir)
    quant = loaded.hf_quant_config["quantization"]
    assert quant["quant_algo"] == "NVFP4" and quant["group_size"] == 16
    assert "quantized_layers" not in quant
    excluded = set(quant["exclude_modules"])
    assert {"lm_head", f"{L}.0.mixer.conv1d", f"{L}.3.mixer.conv1d", f"{L}.3.mixer.in_proj",
            f"{L}.3.mixer.out_proj"} <= excluded  # fmt: skip
    assert not [n for n in excluded if n.startswith(f"{L}.0.mixer.in_proj")]


def test_mixed_modelopt_is_mixed_precision_with_fp8_standins(hybrid_runs, hybrid_exports):
    result, lines = hybrid_exports["super", "modelopt"]
    loaded = load_export(result.out_dir)
    quant, t = loaded.hf_quant_config["quantization"], loaded.tensors
    assert quant["quant_algo"] == "MIXED_PRECISION"
    layers = quant["quantized_layers"]
    assert layers == {f"{L}.0.mixer.in_proj": {"quant_algo": "NVFP4", "group_size": 16},
                      f"{L}.0.mixer.out_proj": {"quant_algo": "FP8"},
                      f"{L}.2.mixer.up_proj": {"quant_algo": "NVFP4", "group_size": 16},
                      f"{L}.2.mixer.down_proj": {"quant_algo": "NVFP4", "group_size": 16}}  # fmt: skip
    assert {f"{L}.1.mixer.q_proj", f"{L}.1.mixer.qkv_proj"} <= set(quant["exclude_modules"])
    qc = loaded.config["quantization_config"]
    assert qc["quantized_layers"] == layers and qc["quant_method"] == "modelopt"
    out = f"{L}.0.mixer.out_proj"
    assert t[f"{out}.weight"].dtype.name == "float8_e4m3fn" and t[f"{out}.weight"].shape == (32, 64)
    kernel = _masters(hybrid_runs["super"])["layers.0.mamba.out_proj.kernel"]
    data, scale, error = fp8_of_mxfp8(compute_weight_t(kernel, "bfloat16"))
    assert t[f"{out}.weight"].tobytes() == data.tobytes()
    assert t[f"{out}.weight_scale"].item() == scale
    amax = json.loads((result.out_dir / "nvfp4_export.json").read_text())["input_amax"]
    assert t[f"{out}.input_scale"].item() == np.float32(amax["layers.0.mamba.out_proj"] / 448)
    assert result.standins == {"layers.0.mamba.out_proj": error} and error > 0
    assert any("layers.0.mamba.out_proj (trained MXFP8) is stored as FP8" in x for x in lines)


def test_mixed_compressed_tensors_holds_mxfp8_as_trained(hybrid_runs, hybrid_exports):
    result, _ = hybrid_exports["super", "compressed-tensors"]
    loaded = load_export(result.out_dir)
    qc, t = loaded.config["quantization_config"], loaded.tensors
    assert qc["format"] == "mixed-precision" and result.standins == {}
    groups = {g["format"]: g for g in qc["config_groups"].values()}
    assert groups["mxfp8-quantized"]["targets"] == [f"{L}.0.mixer.out_proj"]
    assert groups["mxfp8-quantized"]["weights"]["group_size"] == 32
    assert f"{L}.0.mixer.in_proj" in groups["nvfp4-pack-quantized"]["targets"]
    kernel = _masters(hybrid_runs["super"])["layers.0.mamba.out_proj.kernel"]
    q = nvfp4_format.quantize_mxfp8(compute_weight_t(kernel, "bfloat16"), "ceil")
    out = f"{L}.0.mixer.out_proj"
    assert t[f"{out}.weight"].tobytes() == np.asarray(q.data).tobytes()
    assert t[f"{out}.weight_scale"].tobytes() == np.asarray(q.scales).tobytes()


@pytest.mark.parametrize("case,layout", HYBRID_EXPORTS)
def test_verify_passes_with_the_transformers_reload(hybrid_runs, hybrid_exports, case, layout):
    report = verify(hybrid_exports[case, layout][0].out_dir, against=hybrid_runs[case])
    text = render(report)
    assert report.ok and report.complete, text
    loader = [c for c in report.comparisons if c.passed is not None and "NumPy" in c.against]
    if CLIENTS and layout != "modelopt":  # NemotronHForCausalLM against the NumPy forward
        assert loader and all(c.passed for c in loader), text
    if (case, layout) == ("super", "modelopt"):  # FP8 stand-ins: the reload check is informational
        assert "stored as FP8 per tensor" in text


def test_verify_catches_a_changed_ssm_parameter(hybrid_runs, hybrid_exports, tmp_path):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(hybrid_exports["nvfp4", "compressed-tensors"][0].out_dir, out)
    set_scalar_and_reseal(out, f"{L}.0.mixer.A_log", 1.5)
    report = verify(out, against=hybrid_runs["nvfp4"])
    assert not report.ok
    assert any(f"{L}.0.mixer.A_log differs from the checkpoint's" in p for p in report.problems)


def _refusal(tmp_path, match: str, *, precision=None, stats="trained", **model) -> None:
    """Writes a tiny run of HYBRID changed by `model`; its ModelOpt export is refused in one line
    matching `match`, and nothing is written."""
    run = write_run(tmp_path / "run", model=model_config(**{**HYBRID, **model}),
                    precision=precision, quant_stats=stats)  # fmt: skip
    with pytest.raises(ExportError, match=match) as err:
        export_hf(run, tmp_path / "out", layout="modelopt")
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("model,match", [
    ({"pattern": "M*-E", "moe": {"num_experts": 4, "expert_mlp_dim": 32}},
     r"Mixture-of-Experts blocks \(E at blocks \[3\]\)"),
    ({"rope": True}, "model.rope: true"),
    ({"mlp_activation": "swiglu"}, "relu2"),
])  # fmt: skip
def test_a_model_nemotron_h_does_not_build_is_refused(tmp_path, model, match):
    _refusal(tmp_path, match, **model)


def test_a_policy_that_would_quantize_the_conv_is_refused(tmp_path):
    stats = {"recipes": {"layers.0.mamba.conv1d": "nvfp4"}}
    _refusal(tmp_path, "would quantize layers.0.mamba.conv1d with 'nvfp4'", stats=stats)
    rule = {"recipe": "nvfp4", "overrides": [r"layers\.\d+\.mamba\.conv1d=nvfp4"]}
    _refusal(tmp_path / "rule", r"entry .* would quantize layers.0.mamba.conv1d", precision=rule,
             stats=None)  # fmt: skip


def test_modelopt_weight_only_with_mxfp8_and_onnx_are_refused(hybrid_runs, tmp_path):
    with pytest.raises(ExportError, match="need their static input scales"):
        export_hf(hybrid_runs["super"], tmp_path / "wo", layout="modelopt", weight_only=True)
    with pytest.raises(ExportError, match="ONNX export of hybrid"):
        export_onnx(hybrid_runs["nvfp4"], tmp_path / "m.onnx")
    assert not (tmp_path / "wo").exists() and not (tmp_path / "m.onnx").exists()


def test_an_all_mxfp8_run_exports_as_mxfp8_and_as_fp8(tmp_path):
    """Any run's MXFP8 linears (here a Llama trained with the `mxfp8` recipe): compressed-tensors
    `mxfp8-quantized` as trained, ModelOpt plain `quant_algo: FP8` stand-ins; both verify."""
    all_mxfp8 = {"recipe": "mxfp8", "bf16_first_layers": 0, "bf16_last_layers": 0}
    run = write_run(tmp_path / "run", model=model_config(**SMALL_MODEL), precision=all_mxfp8)
    ct = export_hf(run, tmp_path / "ct", layout="compressed-tensors")
    mo = export_hf(run, tmp_path / "mo", layout="modelopt")
    assert ct.plan.fmt == "mxfp8" and mo.plan.fmt == "fp8" and len(mo.standins) == 8
    qc = load_export(ct.out_dir).config["quantization_config"]
    assert qc["format"] == "mxfp8-quantized" and qc["config_groups"]["group_0"]["targets"] == [
        "Linear"
    ]
    quant = load_export(mo.out_dir).hf_quant_config["quantization"]
    assert (quant["quant_algo"], quant["group_size"]) == ("FP8", None)
    for out in (ct.out_dir, mo.out_dir):
        report = verify(out, against=run)
        assert report.ok, render(report)
