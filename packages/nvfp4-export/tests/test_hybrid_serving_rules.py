"""The Nemotron-H loading rules of vLLM, SGLang, TensorRT-LLM and transformers, as checks on our
exports (conftest.HYBRID_EXPORTS: the plain NVFP4 layout and Nemotron 3 Super's mixed one).

Where each rule was read:

- vLLM vllm/model_executor/models/nemotron_h.py: `NemotronHForCausalLM.hf_to_vllm_mapper`
  (prefix backbone -> model, substrings A_log -> A and embeddings -> embed_tokens, q/k/v stacked
  into qkv_proj) and the layer classes per pattern letter (`ALL_DECODER_LAYER_TYPES`: `M`
  `MambaMixer2`, `-` `NemotronHMLP` up_proj/down_proj, `*` `NemotronHAttention` qkv_proj/o_proj,
  every block a `norm`, then `norm_f`, `embed_tokens`, `lm_head`);
  vllm/model_executor/layers/mamba/mamba2/mamba_mixer2.py, `MambaMixer2.__init__` (conv1d built
  with `quant_config=None`: never quantized; in_proj and out_proj with the model's; `A`, `D`,
  `dt_bias`, the gated `norm.weight`); vllm/model_executor/layers/quantization/modelopt.py,
  `ModelOptQuantConfigBase.is_layer_excluded` (fused-aware exact names, substring, fnmatch) and
  `ModelOptMixedPrecisionConfig` (`_resolve_quant_algo`: the name, then the packed shards, then a
  child; `get_quant_method`: FP8, NVFP4, W4A16_NVFP4, anything else unquantized; `apply_vllm_mapper`
  renames `quantized_layers`); compressed_tensors/compressed_tensors.py (`apply_vllm_mapper`
  renames targets and ignore; `_get_scheme_from_parts`: NVFP4 -> `CompressedTensorsW4A4Fp4`,
  MXFP8 -> `CompressedTensorsW8A8Mxfp8`: weight F8_E4M3 [out, in], weight_scale U8 [out, in/32]).
- SGLang python/sglang/srt/models/nemotron_h.py (`remap_prefix` backbone -> model, `remap_substr`
  A_log -> A, embeddings -> embed_tokens, q/k/v stacked into qkv_proj; attention without
  biases), python/sglang/srt/layers/quantization/modelopt/schemes/modelopt_mixed_precision.py
  (`ModelOptMixedPrecisionConfig`: FP8 and NVFP4 only, no packed-module mapping of its own, so a
  fused layer's own name is looked up).
- TensorRT-LLM tensorrt_llm/_torch/models/modeling_nemotron_h.py (`NemotronHForCausalLM.__init__`
  renames `backbone` to `model` in `exclude_modules` and `quant_config_dict`; eps from
  `rms_norm_eps`, else `layer_norm_epsilon`; `TransformerLayer` bias = `attention_bias`),
  tensorrt_llm/_torch/modules/mamba/mamba2_mixer.py (`Mamba2Mixer`: conv1d is a `Linear` with the
  checkpoint's quant config, so it must be excluded by name; no dt limit),
  tensorrt_llm/quantization/mode.py (`QuantAlgo`: FP8 and NVFP4, no MXFP8).
- transformers 5.25 (installed): `NemotronHConfig` reads the config.json, `conversion_mapping`
  renames backbone. -> model.; compressed-tensors' `get_dense_scheme` gives every dense module one
  group (a mixed export does not load: refused for `--server transformers`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import re

import pytest
from conftest import HYBRID, HYBRID_EXPORTS, model_config, write_run
from test_serving_rules import _ct_match, sglang_excluded, vllm_fused_excluded

from nvfp4_export import ExportError, LlamaSpec, export_hf, load_export
from nvfp4_export.hybrid_spec import HybridSpec
from nvfp4_export.layouts import plan_layout
from nvfp4_export.servers import check_servers, layout_refusal

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
"""`packed_modules_mapping` of vLLM's and SGLang's NemotronHForCausalLM."""
MIXER_LINEARS = {"M": ("in_proj", "out_proj"), "*": ("qkv_proj", "o_proj"),
                 "-": ("up_proj", "down_proj")}  # fmt: skip
"""The linears vLLM, SGLang and TensorRT-LLM build per block kind (q/k/v fused)."""
VLLM_MIXED = ("FP8", "NVFP4", "W4A16_NVFP4")
SGLANG_MIXED = ("FP8", "NVFP4")
TRTLLM_ALGOS = ("FP8", "NVFP4", "W4A16_NVFP4")
METHOD_PARAMS = {
    "unquantized": ("weight",),
    "NVFP4": ("weight", "weight_scale", "weight_scale_2", "input_scale"),
    "FP8": ("weight", "weight_scale", "input_scale"),
    "ct-nvfp4": ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"),
    "ct-mxfp8": ("weight", "weight_scale"),
}
"""The parameters each linear method registers (vLLM `ModelOptNvFp4LinearMethod`,
`ModelOptFp8LinearMethod`, `CompressedTensorsW4A4Fp4`, `CompressedTensorsW8A8Mxfp8`)."""


def vllm_name(hf: str) -> str:
    """`hf_to_vllm_mapper` on one checkpoint tensor name (q/k/v stacked into qkv_proj)."""
    name = re.sub(r"^backbone\.", "model.", hf).replace("A_log", "A")
    name = name.replace("embeddings", "embed_tokens")
    return re.sub(r"\.[qkv]_proj\.", ".qkv_proj.", name)


def _mapped(names: list[str]) -> list[str]:
    return [re.sub(r"^backbone\.", "model.", n) for n in names]


def vllm_modelopt_method(prefix: str, quant: dict) -> str:
    """vLLM's method for the linear it builds at `prefix` (a ModelOpt export)."""
    excluded = _mapped(quant.get("exclude_modules", []))
    if (
        vllm_fused_excluded(prefix, excluded)
        or any(e in prefix for e in excluded)
        or any(fnmatch.fnmatch(prefix, e) for e in excluded)
    ):
        return "unquantized"
    if quant["quant_algo"] != "MIXED_PRECISION":
        return quant["quant_algo"]
    layers = {re.sub(r"^backbone\.", "model.", k): v for k, v in quant["quantized_layers"].items()}
    *base, proj = prefix.split(".")
    shards = [".".join([*base, s]) for s in PACKED.get(proj, [])]
    algos = {layers[n]["quant_algo"] for n in [prefix] if n in layers} or {
        layers[s]["quant_algo"] for s in shards if s in layers
    }
    assert len(algos) <= 1, f"{prefix}: mixed quant_algo in one fused layer (vLLM raises)"
    algo = next(iter(algos), None)
    return algo if algo in VLLM_MIXED else "unquantized"


def vllm_ct_method(prefix: str, qc: dict) -> str:
    """vLLM's compressed-tensors scheme for the linear at `prefix`."""
    ignore = _mapped(qc["ignore"])
    *base, proj = prefix.split(".")
    parts = [".".join([*base, s]) for s in PACKED.get(proj, [])] or [prefix]
    if all(_ct_match(p, ignore) for p in parts) or _ct_match(prefix, ignore):
        return "unquantized"
    for group in qc["config_groups"].values():
        targets = _mapped(group["targets"])
        if "Linear" in targets or all(_ct_match(p, targets) for p in parts):
            w = group["weights"]
            if (w["num_bits"], w["strategy"], w["group_size"]) == (8, "group", 32):
                return "ct-mxfp8"  # `_is_mxfp8`: 8-bit float, group, 32
            assert (w["num_bits"], w["strategy"], w["group_size"]) == (4, "tensor_group", 16)
            return "ct-nvfp4"
    raise AssertionError(f"{prefix}: no config group targets it (vLLM raises)")


def vllm_params(loaded) -> set[str]:
    """Every parameter vLLM's NemotronHForCausalLM registers for this export, by its methods."""
    config, params = loaded.config, {"model.embed_tokens.weight", "model.norm_f.weight"}
    params.add("lm_head.weight")
    for i, letter in enumerate(config["hybrid_override_pattern"]):
        p = f"model.layers.{i}."
        params.add(p + "norm.weight")
        if letter == "M":
            params |= {p + f"mixer.{n}" for n in ("A", "D", "dt_bias", "norm.weight",
                                                   "conv1d.weight", "conv1d.bias")}  # fmt: skip
        for linear in MIXER_LINEARS[letter]:
            prefix = p + "mixer." + linear
            if loaded.layout == "modelopt":
                method = vllm_modelopt_method(prefix, loaded.hf_quant_config["quantization"])
            else:
                method = vllm_ct_method(prefix, loaded.config["quantization_config"])
            params |= {f"{prefix}.{n}" for n in METHOD_PARAMS[method]}
    return params


@pytest.fixture(scope="module")
def loaded_exports(hybrid_exports):
    return {key: load_export(result.out_dir) for key, (result, _) in hybrid_exports.items()}


@pytest.mark.parametrize("key", [k for k in HYBRID_EXPORTS if k[1] != "bf16"])
def test_vllm_builds_exactly_the_parameters_the_export_stores(loaded_exports, key):
    loaded = loaded_exports[key]
    stored = {vllm_name(n) for n in loaded.tensors}
    assert stored == vllm_params(loaded), sorted(stored ^ vllm_params(loaded))[:8]


@pytest.mark.parametrize("key", [k for k in HYBRID_EXPORTS if k[1] != "bf16"])
def test_the_mamba_conv_is_never_quantized_and_trtllm_excludes_it(loaded_exports, key):
    loaded = loaded_exports[key]
    for i in (0, 3):  # the Mamba blocks
        conv = f"backbone.layers.{i}.mixer.conv1d"
        assert loaded.tensors[f"{conv}.weight"].dtype.name == "float32"
        assert f"{conv}.weight_scale" not in loaded.tensors
        exclude = (loaded.hf_quant_config or {}).get("quantization", {}).get(
            "exclude_modules", loaded.config["quantization_config"].get("ignore"))  # fmt: skip
        renamed = [re.sub(r"(model\.layers\.)?backbone", "model", k) for k in exclude]
        assert any(fnmatch.fnmatchcase(f"model.layers.{i}.mixer.conv1d", e) for e in renamed)


def test_sglang_modelopt_mixed_builds_every_layer_as_stored(loaded_exports):
    loaded = loaded_exports["super", "modelopt"]
    quant = loaded.hf_quant_config["quantization"]
    layers = {re.sub(r"^backbone\.", "model.", k): v for k, v in quant["quantized_layers"].items()}
    excluded = _mapped(quant["exclude_modules"])
    assert {v["quant_algo"] for v in layers.values()} <= set(SGLANG_MIXED)
    for i, letter in enumerate(loaded.config["hybrid_override_pattern"]):
        for linear in MIXER_LINEARS[letter]:
            prefix = f"model.layers.{i}.mixer.{linear}"  # no packed mapping: its own name
            algo = None if sglang_excluded(prefix, excluded) else layers.get(prefix, {}).get(
                "quant_algo")  # fmt: skip
            hf = re.sub(r"^model\.", "backbone.", prefix).replace("qkv_proj", "q_proj")
            stored = loaded.tensors[f"{hf}.weight"].dtype.name
            want = {None: "bfloat16", "NVFP4": "uint8", "FP8": "float8_e4m3fn"}[algo]
            assert stored == want, (prefix, algo, stored)


def test_trtllm_per_layer_configs_are_quant_algos_it_has(loaded_exports):
    quant = loaded_exports["super", "modelopt"].hf_quant_config["quantization"]
    renamed = {re.sub(r"(model\.layers\.)?backbone", "model", k): v
               for k, v in quant["quantized_layers"].items()}  # fmt: skip
    assert all(k.startswith("model.layers.") for k in renamed)
    assert {v["quant_algo"] for v in renamed.values()} <= set(TRTLLM_ALGOS)


def test_config_json_has_every_key_the_servers_read(loaded_exports):
    config = loaded_exports["nvfp4", "modelopt"].config
    read = {  # vLLM NemotronHModel / its layer classes; TensorRT-LLM NemotronHLayer, Mamba2Mixer
        "vllm": ("hybrid_override_pattern", "hidden_size", "ssm_state_size", "conv_kernel",
                 "mamba_num_heads", "mamba_head_dim", "use_conv_bias", "use_bias", "n_groups",
                 "layer_norm_epsilon", "mamba_hidden_act", "intermediate_size", "mlp_bias",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size"),
        "tensorrt-llm": ("hybrid_override_pattern", "num_hidden_layers", "chunk_size",
                         "attention_bias", "layer_norm_epsilon", "n_groups"),
    }  # fmt: skip
    for server, keys in read.items():
        assert not [k for k in keys if k not in config], server
    assert config["layer_norm_epsilon"] == 1e-5 and config["attention_bias"] is False
    assert len(config["hybrid_override_pattern"]) == config["num_hidden_layers"]


def test_transformers_reads_the_config_as_trained(loaded_exports):
    pytest.importorskip("transformers")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(loaded_exports["nvfp4", "bf16"].path))
    assert config.layers_block_type == ["linear_attention", "full_attention", "mlp",
                                        "linear_attention"]  # fmt: skip
    assert (config.n_groups, config.conv_kernel, config.mamba_num_heads) == (2, 4, 16)
    assert config.layer_norm_epsilon == 1e-5 and config.tie_word_embeddings is False


def test_default_servers_of_each_export(hybrid_exports):
    servers = {key: result.servers for key, (result, _) in hybrid_exports.items()}
    assert servers["nvfp4", "compressed-tensors"] == ("vllm", "sglang", "tensorrt-llm",
                                                       "transformers")  # fmt: skip
    assert servers["super", "modelopt"] == ("vllm", "sglang", "tensorrt-llm")
    assert servers["super", "compressed-tensors"] == ("vllm", "sglang")


def test_layout_refusals_of_the_mixed_exports(loaded_exports):
    from nvfp4_export.invariants import plan_of_export

    ct = plan_of_export(loaded_exports["super", "compressed-tensors"])
    assert "get_dense_scheme" in layout_refusal("transformers", ct)
    assert "QuantAlgo" in layout_refusal("tensorrt-llm", ct)
    weight_only = dataclasses.replace(plan_of_export(loaded_exports["super", "modelopt"]),
                                      w4a4=False)  # fmt: skip
    assert "W4A16_NVFP4" in layout_refusal("sglang", weight_only)


def test_a_trained_dt_clip_is_refused_for_the_servers_that_ignore_it():
    hybrid = HybridSpec("M*-M", 16, 4, 8, 2, time_step_limit=(0.0, 0.5))
    spec = LlamaSpec(257, 32, 4, 2, 1, 16, 32, architecture="nemotron_h", hybrid=hybrid)
    plan = plan_layout("bf16", [], weight_only=False)
    with pytest.raises(ExportError, match=r"vllm computes the Mamba dt clip .*dt_limit"):
        check_servers(spec, plan, None, allow_dropped=False)
    _, notes = check_servers(spec, plan, None, allow_dropped=True)
    assert {n.split(" ")[0] for n in notes} == {"vllm", "tensorrt-llm"}
    assert check_servers(spec, plan, ["transformers"], allow_dropped=False)[1] == ()


def test_export_with_allow_dropped_tensors_warns_for_the_dt_clip(tmp_path):
    mamba = {**HYBRID["mamba"], "time_step_limit": [0.0, 0.5]}
    run = write_run(tmp_path / "run", model=model_config(**{**HYBRID, "mamba": mamba}))
    with pytest.raises(ExportError, match="time_step_limit"):
        export_hf(run, tmp_path / "a", layout="bf16")
    result = export_hf(run, tmp_path / "b", layout="bf16", allow_dropped_tensors=True)
    assert any("tensorrt-llm computes the Mamba dt clip" in n for n in result.notes)
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert config["time_step_limit"] == [0.0, 0.5]  # transformers applies it
