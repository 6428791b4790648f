"""The Mixture-of-Experts loading rules of vLLM, SGLang, TensorRT-LLM and transformers, as checks
on our MoE exports (Qwen3-MoE, Mixtral, Qwen2-MoE; ModelOpt and compressed-tensors; W4A4 and
weight-only; block 0 NVFP4 and block 1 BF16 by the policy rule).

Where each rule was read (vLLM 0.34.0 and SGLang 0.5.23 wheels from PyPI, TensorRT-LLM main,
ModelOpt main, transformers 5.25 + compressed-tensors 0.20 installed here):

- vLLM ModelOpt: vllm/model_executor/layers/quantization/modelopt.py, `ModelOptNvFp4FusedMoE.
  create_weights` (per expert `w13_weight` U8 [E, 2F, D/2], `w13_weight_scale` F8_E4M3
  [E, 2F, D/16], `w13_weight_scale_2` [E, 2] and `w13_input_scale` [E, 2] as torch.empty: an
  expert the checkpoint lacks keeps uninitialised memory) and `process_weights_after_loading`
  ("w1_weight_scale_2 must match w3_weight_scale_2", keeps the gate's); `ModelOptQuantConfigBase.
  is_layer_excluded` (exact name, then SUBSTRING `exclude in prefix`, then fnmatch) decides the
  fused MoE layer `model.layers.{i}.mlp.experts` and the router; vllm/model_executor/models/
  qwen3_moe.py builds its router `GateLinear(..., quant_config=quant_config, prefix=...mlp.gate)`
  (quantized unless excluded), qwen2_moe.py and mixtral.py build it without a quant_config.
- vLLM compressed-tensors: compressed_tensors_moe/compressed_tensors_moe.py, `get_moe_method`
  (the scheme of `{experts}.0.{gate,up,down}_proj`, which must agree: "All MoE projections need
  to have same quantization scheme"; none: unquantized), compressed_tensors_moe_w4a4_nvfp4.py
  (`w13_weight_global_scale` [E, 2] ENCODE scales, gate's kept with a warning; input scales
  `1 / w13_input_global_scale`).
- SGLang: python/sglang/srt/layers/quantization/modelopt_quant.py, `ModelOptFp4Config.
  is_layer_excluded` (regex fullmatch of the name or one of its dot-separated parts) for the
  fused MoE layer, `ModelOptNvFp4FusedMoEMethod.create_weights` (input scales filled with 1.0
  where the checkpoint has none, then `max` over the experts or sliced per rank); its routers
  never quantize (models/qwen3_moe.py: a quant_config only for modelslim; qwen2_moe.py,
  mixtral.py: None).
- TensorRT-LLM: tensorrt_llm/_torch/modules/fused_moe/quantization.py, `NVFP4FusedMoEMethod.
  load_expert_fc31_input_scale_nvfp4` (asserts w1_input_scale == w3_input_scale) and
  `load_expert_fc31_alpha_nvfp4` (asserts w1_weight_scale_2 == w3_weight_scale_2); exclusions as
  for dense layers (fnmatch of the built module's name).
- transformers + compressed-tensors: transformers/integrations/compressed_tensors.py,
  `CompressedTensorsDequantize.convert` rebuilds each expert from weight_packed, weight_scale
  and weight_shape without its weight_global_scale and drops BF16 experts: the export refuses
  `--server transformers` for an MoE compressed-tensors export (`servers.layout_refusal`).
- ModelOpt (what the rules expect of an exporter): modelopt/torch/export/layer_utils.py,
  `set_expert_quantizer_amax` (an uncalibrated expert's input amax = the max of its block's
  calibrated experts), and one weight amax over each expert's gate and up.
"""

from __future__ import annotations

import fnmatch
import re

import ml_dtypes
import numpy as np
import pytest
from conftest import MOE_CASES
from test_serving_rules import (
    _ct_match,
    modelopt_config_problems,
    sglang_excluded,
    trtllm_excluded,
    trtllm_legacy_excluded,
    vllm_ct_excluded,
    vllm_fused_excluded,
)

from nvfp4_export import ExportError, export_hf, load_export
from nvfp4_export.moe_spec import MOE_CLASSES

SIX_448 = np.float32(6 * 448)
MODES = ("modelopt-w4a4", "modelopt-w4a16", "ct-w4a4", "ct-w4a16")


@pytest.fixture(scope="module")
def moe_exports(moe_runs, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_serving")
    out = {}
    for case, run in moe_runs.items():
        for mode in MODES:
            layout = "modelopt" if mode.startswith("modelopt") else "compressed-tensors"
            result = export_hf(run, root / f"{case}-{mode}", layout=layout,
                               weight_only=mode.endswith("w4a16"))  # fmt: skip
            out[case, mode] = load_export(result.out_dir)
    return out


def _exclude_list(loaded) -> list[str]:
    if loaded.layout == "modelopt":
        return list(loaded.hf_quant_config["quantization"]["exclude_modules"])
    return list(loaded.config["quantization_config"]["ignore"])


def _names(loaded):
    """(MoE class names, packed suffix, global-scale suffix, input-scale suffix)."""
    modelopt = loaded.layout == "modelopt"
    return (
        MOE_CLASSES[loaded.spec.architecture],
        "weight" if modelopt else "weight_packed",
        "weight_scale_2" if modelopt else "weight_global_scale",
        "input_scale" if modelopt else "input_global_scale",
    )


def _experts(loaded, i: int) -> str:
    return f"model.layers.{i}.{MOE_CLASSES[loaded.spec.architecture].block}.experts"


def _block_bf16(loaded, i: int) -> bool:
    names = MOE_CLASSES[loaded.spec.architecture]
    return f"{_experts(loaded, i)}.0.{names.projections[0]}.weight" in loaded.tensors and (
        loaded.tensors[f"{_experts(loaded, i)}.0.{names.projections[0]}.weight"].dtype.name
        == "bfloat16"
    )


# ----------------------------------------------------------------------------- exclusion rules


def vllm_modelopt_excluded(prefix: str, exclude: list[str]) -> bool:
    """vLLM `ModelOptQuantConfigBase.is_layer_excluded`: exact (fused-aware), SUBSTRING, fnmatch."""
    return (
        vllm_fused_excluded(prefix, exclude)
        or any(e != prefix and e in prefix for e in exclude)
        or any(fnmatch.fnmatch(prefix, e) for e in exclude)
    )


def _sglang_parts_excluded(prefix: str, exclude: list[str]) -> bool:
    """SGLang `ModelOptFp4Config.is_layer_excluded`: fullmatch of the name or of one part."""
    return sglang_excluded(prefix, exclude) or any(
        re.fullmatch(e.replace(".", r"\.").replace("*", ".*"), part)
        for e in exclude
        for part in prefix.split(".")
    )


def _quantized_routers(server: str, arch: str) -> bool:
    """Whether the server builds the router with the checkpoint's quant config (so only an
    exclusion keeps it BF16): vLLM's Qwen3-MoE `GateLinear(quant_config=quant_config)`."""
    return server.startswith("vllm") and arch == "qwen3_moe"


def moe_exclusion_problems(loaded, server: str) -> list[str]:
    """The fused MoE layers and routers `server` would build against what the export stores."""
    exclude, arch = _exclude_list(loaded), loaded.spec.architecture
    rule = {
        "vllm-modelopt": vllm_modelopt_excluded,
        "sglang-modelopt": _sglang_parts_excluded,
        "tensorrt-llm": trtllm_excluded,
        "tensorrt-llm-legacy": trtllm_legacy_excluded,
    }.get(server)
    problems = []
    for i in loaded.spec.moe_layers():
        experts, bf16 = _experts(loaded, i), _block_bf16(loaded, i)
        if server == "vllm-ct":  # get_moe_method: expert 0's per-expert names
            gate, up, down = MOE_CLASSES[arch].projections
            ignored = {vllm_ct_excluded(f"{experts}.0.{p}", exclude) for p in (gate, up, down)}
            if len(ignored) > 1:
                problems.append(f"{experts}: expert 0's projections have different schemes")
            excluded = ignored == {True}
        else:
            excluded = rule(experts, exclude)
        if excluded != bf16:
            problems.append(f"{experts}: excluded={excluded}, stored BF16={bf16}")
        router = experts.removesuffix(".experts") + ".gate"
        if _quantized_routers(server, arch):
            matched = (vllm_ct_excluded if server == "vllm-ct" else vllm_modelopt_excluded)(
                router, exclude
            )
            if not matched:
                problems.append(f"{router}: built NVFP4 over the BF16 router weight")
    return problems


def substring_traps(loaded) -> list[str]:
    """vLLM's ModelOpt SUBSTRING rule: an exclusion inside the name of a layer stored in FP4
    would silently build that layer unquantized over packed weights."""
    exclude = _exclude_list(loaded)
    quantized = {k.rsplit(".", 1)[0] for k in loaded.tensors if k.endswith(".weight_scale")}
    servers_fused = set()
    for name in quantized:
        servers_fused.add(re.sub(r"\.experts\.\d+\.[^.]+$", ".experts", name))
        servers_fused.add(re.sub(r"\.(q|k|v)_proj$", ".qkv_proj", name))
        servers_fused.add(re.sub(r"\.(gate|up)_proj$", ".gate_up_proj", name))
    return [f"{e!r} is inside FP4 layer {p}" for p in sorted(servers_fused) for e in exclude
            if e in p and e != p and ".experts." not in p]  # fmt: skip


# ----------------------------------------------------------------------------- tensor rules


def expert_tensor_problems(loaded, stats: dict) -> list[str]:
    """Every expert's tensors as the fused-MoE loaders allocate them, its scales filled from
    training (`stats`: the checkpoint's quant_stats amax) with the layout's direction, gate and
    up sharing one global and one input scale."""
    names, packed, global_name, input_name = _names(loaded)
    spec, t, problems = loaded.spec, loaded.tensors, []
    w4a4 = loaded.provenance["w4a4"]
    for i in spec.moe_layers():
        if _block_bf16(loaded, i):
            continue
        for e in range(spec.num_experts):
            base = f"{_experts(loaded, i)}.{e}."
            gate, up, down = (base + p for p in names.projections)
            for module, rows, cols in ((gate, spec.expert_mlp_dim, spec.d_model),
                                       (up, spec.expert_mlp_dim, spec.d_model),
                                       (down, spec.d_model, spec.expert_mlp_dim)):  # fmt: skip
                if t[f"{module}.{packed}"].shape != (rows, cols // 2):
                    problems.append(f"{module}.{packed} shape {t[f'{module}.{packed}'].shape}")
                if t[f"{module}.weight_scale"].dtype.name != "float8_e4m3fn":
                    problems.append(f"{module}.weight_scale is not F8_E4M3")
                need = [global_name] + [input_name] * w4a4
                for suffix in need:
                    value = t.get(f"{module}.{suffix}")
                    if value is None:
                        problems.append(f"{module}.{suffix} missing (vLLM: uninitialised)")
                    elif not (np.isfinite(value).all() and (value > 0).all()):
                        problems.append(f"{module}.{suffix} = {value} (not finite > 0)")
            for suffix in [global_name] + [input_name] * w4a4:
                if t[f"{gate}.{suffix}"].tobytes() != t[f"{up}.{suffix}"].tobytes():
                    problems.append(f"layer {i} expert {e}: gate/up {suffix} differ")
            if w4a4:
                for module, kind in ((gate, "gate_up"), (down, "down")):
                    amax = np.float32(stats[f"layers.{i}.mlp.experts.{kind}"][e])
                    stored = np.float32(t[f"{module}.{input_name}"].reshape(-1)[0])
                    decode = stored if loaded.layout == "modelopt" else np.float32(1) / stored
                    if not np.isclose(decode, amax / SIX_448, rtol=1e-6):
                        problems.append(f"{module}.{input_name}: {stored} is not amax {amax} "
                                        f"as {'amax/2688' if loaded.layout == 'modelopt' else '2688/amax'}")  # fmt: skip
    return problems


def weight_scale_problems(loaded, params) -> list[str]:
    """weight_scale_2 = amax / (6 * 448) of each expert's gate|up (ModelOpt: one weight amax
    per expert over both), compressed-tensors the reciprocal."""
    names, _, global_name, _ = _names(loaded)
    spec, problems = loaded.spec, []
    for i in spec.moe_layers():
        if _block_bf16(loaded, i):
            continue
        kernel = params[f"layers.{i}.mlp.experts.gate_up.kernel"]
        for e in range(spec.num_experts):  # the BF16 compute-dtype values training quantized
            amax = np.float32(np.abs(kernel[e].astype(ml_dtypes.bfloat16)).astype(np.float32).max())
            module = f"{_experts(loaded, i)}.{e}.{names.projections[0]}"
            stored = np.float32(loaded.tensors[f"{module}.{global_name}"].reshape(-1)[0])
            decode = stored if loaded.layout == "modelopt" else np.float32(1) / stored
            if not np.isclose(decode, amax / SIX_448, rtol=1e-6):
                problems.append(f"{module}.{global_name}: {stored} for weight amax {amax}")
    return problems


# ----------------------------------------------------------------------------- the tests

CASES = sorted(MOE_CASES)
SERVERS_MODELOPT = ("vllm-modelopt", "sglang-modelopt", "tensorrt-llm", "tensorrt-llm-legacy")
SERVERS_CT = ("vllm-ct", "tensorrt-llm", "tensorrt-llm-legacy")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_every_server_builds_the_moe_layers_and_routers_as_stored(moe_exports, case, mode):
    loaded = moe_exports[case, mode]
    servers = SERVERS_MODELOPT if mode.startswith("modelopt") else SERVERS_CT
    assert {s: moe_exclusion_problems(loaded, s) for s in servers} == dict.fromkeys(servers, [])
    assert substring_traps(loaded) == []
    # the BF16 MoE block (1) is excluded, the NVFP4 one (0) is not
    assert [_block_bf16(loaded, i) for i in (0, 1)] == [False, True]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_every_expert_has_its_tensors_and_scales(moe_exports, case, mode):
    loaded = moe_exports[case, mode]
    assert expert_tensor_problems(loaded, loaded.provenance["input_amax"]) == []


@pytest.mark.parametrize("case", CASES)
def test_expert_weight_scales_are_one_amax_over_gate_and_up(moe_exports, moe_runs, case):
    from nvfp4_export import read_checkpoint, resolve_checkpoint

    params = read_checkpoint(resolve_checkpoint(moe_runs[case])).params
    for mode in ("modelopt-w4a4", "ct-w4a4"):
        assert weight_scale_problems(moe_exports[case, mode], params) == []


@pytest.mark.parametrize("case", CASES)
def test_input_scales_come_from_each_experts_training_amax(moe_exports, moe_runs, case):
    from nvfp4_export import read_checkpoint, resolve_checkpoint

    stats = read_checkpoint(resolve_checkpoint(moe_runs[case])).quant_stats["activation_amax"]
    for mode in ("modelopt-w4a4", "ct-w4a4"):
        assert expert_tensor_problems(moe_exports[case, mode], stats) == []


@pytest.mark.parametrize("case", CASES)
def test_modelopt_moe_config_is_accepted(moe_exports, case):
    loaded = moe_exports[case, "modelopt-w4a4"]
    assert modelopt_config_problems(loaded, "vllm") == []
    assert modelopt_config_problems(loaded, "sglang") == []
    # the router is BF16 and named exactly (no wildcard), the shared-expert gate too
    exclude = _exclude_list(loaded)
    block = MOE_CLASSES[case].block
    assert f"model.layers.0.{block}.gate" in exclude
    assert ("model.layers.0.mlp.shared_expert_gate" in exclude) == (case == "qwen2_moe")


@pytest.mark.parametrize("case", CASES)
def test_transformers_is_not_offered_an_moe_compressed_tensors_export(moe_runs, case, tmp_path):
    with pytest.raises(ExportError, match="without its weight_global_scale"):
        export_hf(moe_runs[case], tmp_path / "ct", layout="compressed-tensors",
                  servers=["transformers"])  # fmt: skip
    assert not (tmp_path / "ct").exists()


def test_the_moe_rules_have_teeth(moe_exports):
    loaded = moe_exports["qwen3_moe", "modelopt-w4a4"]
    exclude = _exclude_list(loaded)
    # without the fused name, SGLang and TRT-LLM build the BF16 block 1 as NVFP4
    without = [e for e in exclude if not e.endswith(".experts")]
    assert not _sglang_parts_excluded("model.layers.1.mlp.experts", without)
    assert not trtllm_excluded("model.layers.1.mlp.experts", without)
    # without the router, vLLM's Qwen3-MoE builds an NVFP4 gate over the BF16 weight
    assert not vllm_modelopt_excluded("model.layers.0.mlp.gate", [e for e in exclude
                                                                  if not e.endswith(".gate")])  # fmt: skip
    # a wildcard or a short name is a substring trap for vLLM's ModelOpt rule
    assert vllm_modelopt_excluded("model.layers.10.mlp.experts", ["model.layers.1"])
    assert _ct_match("model.layers.1.mlp.gate", ["model.layers.1.mlp.gate"])
