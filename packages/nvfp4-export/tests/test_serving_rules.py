"""The loading rules of the servers docs/export.md names, as executable checks on our exports.

Each rule is written from the server's loading code (file and function cited), and every layout
and mode the exporter writes is checked against it: which layers a server builds quantized and
whether the stored tensors fit that decision, which `quant_algo` values it accepts, which fields
it requires, tensor names/dtypes/shapes, the direction of the global scales, and the scales that
fused modules must share. A rule function returns the problems it finds ([] when the server
would load the export).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from conftest import write_run

from nvfp4_export import export_hf, load_export

# ----------------------------------------------------------------------------- exclusion rules
# How a server decides that one of the layers it builds stays unquantized.

PACKED_MODULES = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}
"""vLLM's `packed_modules_mapping` of LlamaForCausalLM (vllm/model_executor/models/llama.py)."""


def _fullmatch_any(prefix: str, patterns: list[str]) -> bool:
    return any(re.fullmatch(p.replace(".", r"\.").replace("*", ".*"), prefix) for p in patterns)


def sglang_excluded(prefix: str, exclude_modules: list[str]) -> bool:
    """SGLang python/sglang/srt/layers/quantization/modelopt_quant.py,
    `ModelOptFp4Config.get_quant_method`: `is_layer_skipped(prefix, exclude_modules)` (exact
    name, no packed-module mapping for Llama) or `is_layer_excluded` (each pattern as a regex,
    '.' literal and '*' any, `re.fullmatch` against the prefix)."""
    return prefix in exclude_modules or _fullmatch_any(prefix, exclude_modules)


def vllm_legacy_excluded(prefix: str, exclude_modules: list[str]) -> bool:
    """vLLM before the fused-aware skip (vllm/model_executor/layers/quantization/modelopt.py,
    `ModelOptNvFp4Config.get_quant_method`): `is_layer_skipped(prefix, exclude_modules)` without
    a packed mapping (exact names) or `is_layer_excluded` (regex fullmatch, as SGLang)."""
    return prefix in exclude_modules or _fullmatch_any(prefix, exclude_modules)


def vllm_fused_excluded(prefix: str, ignored: list[str]) -> bool:
    """vLLM's fused-aware `is_layer_skipped(prefix, ignored, packed_modules_mapping)`
    (vllm/model_executor/layers/quantization/utils/quant_utils.py): a fused layer is skipped when
    all its shards are; some but not all raises ("Detected some but not all shards ...")."""
    *parent, name = prefix.split(".")
    if name not in PACKED_MODULES:
        return prefix in ignored or _fullmatch_any(prefix, ignored)
    shards = [".".join([*parent, s]) for s in PACKED_MODULES[name]]
    skipped = [s in ignored or _fullmatch_any(s, ignored) for s in shards]
    if any(skipped) and not all(skipped):
        raise AssertionError(f"{prefix}: some but not all shards skipped (vLLM raises)")
    return all(skipped)


SERVER_LAYERS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
"""The linears SGLang's and vLLM's Llama build per decoder layer (q/k/v and gate/up fused)."""

EXCLUSION_RULES = {
    "sglang": sglang_excluded,
    "vllm-legacy": vllm_legacy_excluded,
    "vllm-fused-aware": vllm_fused_excluded,
}


def exclusion_problems(export, rule) -> list[str]:
    """Layers a server would build quantized with BF16 weights in the export, or the reverse."""
    loaded = load_export(export)
    exclude = _exclude_list(loaded)
    problems = []
    for i in range(loaded.spec.num_layers):
        for layer in SERVER_LAYERS:
            prefix = f"model.layers.{i}.{layer}"
            *parent, name = prefix.split(".")
            parts = [".".join([*parent, s]) for s in PACKED_MODULES.get(name, [name])]
            stored_bf16 = [f"{p}.weight" in loaded.tensors and _is_bf16(loaded, p) for p in parts]
            if rule(prefix, exclude) != all(stored_bf16) or len(set(stored_bf16)) > 1:
                problems.append(
                    f"{prefix}: excluded={rule(prefix, exclude)}, stored BF16={stored_bf16}"
                )
    if not rule("lm_head", exclude):
        problems.append("lm_head would be built quantized")
    return problems


def _exclude_list(loaded) -> list[str]:
    if loaded.layout == "modelopt":
        return list(loaded.hf_quant_config["quantization"]["exclude_modules"])
    return list(loaded.config["quantization_config"]["ignore"])


def _is_bf16(loaded, module: str) -> bool:
    return loaded.tensors[f"{module}.weight"].dtype.name == "bfloat16"


# ----------------------------------------------------------------------------- config rules

QUANT_ALGOS = {
    # vllm/model_executor/layers/quantization/modelopt.py, QUANT_ALGOS (newer releases)
    "vllm": ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4", "MXFP8"),
    # the same list in vLLM releases before W4A16_NVFP4 was added
    "vllm-legacy": ("FP8", "NVFP4"),
    # sglang modelopt_quant.py, ModelOptFp4Config.from_config: quant_method not in ["FP8", "NVFP4"]
    "sglang": ("FP8", "NVFP4"),
}


def modelopt_config_problems(export, server: str) -> list[str]:
    """`hf_quant_config.json` against a server's ModelOpt config reader."""
    loaded = load_export(export)
    problems = []
    hq = loaded.hf_quant_config or {}
    quant = hq.get("quantization", {})
    if "producer" not in hq:  # vLLM: ModelOptQuantConfigBase reads config["producer"]
        problems.append("no producer object")
    if quant.get("quant_algo") not in QUANT_ALGOS[server]:
        problems.append(f"quant_algo {quant.get('quant_algo')!r} not accepted")
    for key in ("group_size", "kv_cache_quant_algo", "exclude_modules"):  # vLLM: all present
        if key not in quant:
            problems.append(f"missing {key}")
    if server == "sglang" and not (quant.get("group_size") and quant.get("exclude_modules")):
        problems.append("SGLang needs a group_size and a non-empty exclude_modules")
    if quant.get("group_size") != 16:
        problems.append("NVFP4 group_size must be 16")
    if any("*" in m for m in quant.get("exclude_modules", [])):
        problems.append("a wildcard in exclude_modules (layers.1* also matches layers.10..19)")
    return problems


# ----------------------------------------------------------------------------- tensor rules


def tensor_problems(export) -> list[str]:
    """Names, dtypes, shapes, scale direction and shared fused scales a loader relies on.

    vLLM ModelOptNvFp4LinearMethod.create_weights / process_weights_after_loading (and the same
    in SGLang and TensorRT-LLM): weight U8 [out, in/2], weight_scale F8_E4M3 [out, in/16],
    weight_scale_2 F32 scalar DECODE scale, input_scale F32 scalar DECODE scale; the fused layer
    takes ONE weight_scale_2 / input_scale (vLLM keeps the max: differing ones mis-scale, TRT-LLM
    asserts equality). compressed-tensors (CompressedTensorsW4A4Fp4 / W4A16Fp4): weight_packed,
    weight_scale, weight_global_scale F32 [1] ENCODE scale, input_global_scale likewise.
    """
    loaded = load_export(export)
    t, problems = loaded.tensors, []
    modelopt = loaded.layout == "modelopt"
    packed_name, global_name = ("weight", "weight_scale_2") if modelopt else (
        "weight_packed", "weight_global_scale")  # fmt: skip
    input_name = "input_scale" if modelopt else "input_global_scale"
    for name in sorted({k.rsplit(".", 1)[0] for k in t if k.endswith(".weight_scale")}):
        packed, scales = t[f"{name}.{packed_name}"], t[f"{name}.weight_scale"]
        out, half = packed.shape
        if packed.dtype != np.uint8 or scales.dtype.name != "float8_e4m3fn":
            problems.append(f"{name}: dtypes {packed.dtype}, {scales.dtype}")
        if scales.shape != (out, 2 * half // 16):
            problems.append(f"{name}: weight_scale shape {scales.shape}")
        g = np.float32(t[f"{name}.{global_name}"].reshape(-1)[0])
        sb_max = float(scales.astype(np.float32).max())
        decode = g if modelopt else np.float32(1.0) / g
        # the largest block scale is 448 (or the tile max): decode scale * 448 * 6 ~ |W|max
        if not (0 < decode < 1.0 and sb_max <= 448):
            problems.append(
                f"{name}: global scale {g} is not a {'decode' if modelopt else 'encode'} scale"
            )
    for i in range(loaded.spec.num_layers):
        for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                      ("mlp.gate_proj", "mlp.up_proj")):  # fmt: skip
            for suffix in (global_name, input_name):
                values = {float(t[f"model.layers.{i}.{m}.{suffix}"].reshape(-1)[0])
                          for m in group if f"model.layers.{i}.{m}.{suffix}" in t}  # fmt: skip
                if len(values) > 1:
                    problems.append(f"layer {i} {group}: {suffix} differ {sorted(values)}")
    return problems


# ----------------------------------------------------------------------------- the exports


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    trained = write_run(root / "trained", steps=(2,))  # with activation amax, as training writes
    bare = write_run(root / "bare", steps=(2,), quant_stats=None)
    mx = write_run(root / "mx", steps=(2,), precision={"recipe": "mxfp4"})
    return {
        "modelopt-w4a4": export_hf(trained, root / "mo", layout="modelopt").out_dir,
        "modelopt-w4a16": export_hf(
            bare, root / "mo16", layout="modelopt", weight_only=True
        ).out_dir,
        "ct-w4a4": export_hf(trained, root / "ct", layout="compressed-tensors").out_dir,
        "ct-w4a16": export_hf(bare, root / "ct16", layout="compressed-tensors").out_dir,
        "ct-mxfp4": export_hf(mx, root / "ctmx", layout="compressed-tensors").out_dir,
    }


@pytest.mark.parametrize("rule", sorted(EXCLUSION_RULES))
@pytest.mark.parametrize("mode", ["modelopt-w4a4", "modelopt-w4a16"])
def test_modelopt_exports_load_under_every_exclusion_rule(exports, mode, rule):
    assert exclusion_problems(exports[mode], EXCLUSION_RULES[rule]) == []


@pytest.mark.parametrize("mode", ["ct-w4a4", "ct-w4a16", "ct-mxfp4"])
def test_compressed_tensors_exports_load_under_vllm_fused_aware_rule(exports, mode):
    # vLLM's compressed-tensors path uses the fused-aware should_ignore_layer; transformers
    # builds q/k/v separately (exact names), which the same list satisfies.
    assert exclusion_problems(exports[mode], vllm_fused_excluded) == []


def test_the_exclusion_rules_have_teeth(exports, tmp_path):
    # the export as it was before the fused names: SGLang and legacy vLLM build NVFP4 qkv_proj
    import shutil

    old = shutil.copytree(exports["modelopt-w4a4"], tmp_path / "old")
    path = old / "hf_quant_config.json"
    hq = json.loads(path.read_text())
    quant = hq["quantization"]
    quant["exclude_modules"] = [m for m in quant["exclude_modules"] if "_proj" not in m
                                or not m.endswith(("qkv_proj", "gate_up_proj"))]  # fmt: skip
    path.write_text(json.dumps(hq))
    assert exclusion_problems(old, sglang_excluded)
    assert exclusion_problems(old, vllm_legacy_excluded)
    assert exclusion_problems(old, vllm_fused_excluded) == []  # new vLLM maps the shards
    quant["exclude_modules"].append("model.layers.1*")  # a wildcard: layers 1 and 10..19
    path.write_text(json.dumps(hq))
    assert "a wildcard in exclude_modules" in " ".join(modelopt_config_problems(old, "vllm"))


@pytest.mark.parametrize(
    "mode, server, accepted",
    [
        ("modelopt-w4a4", "vllm", True),
        ("modelopt-w4a4", "vllm-legacy", True),
        ("modelopt-w4a4", "sglang", True),
        ("modelopt-w4a16", "vllm", True),
        ("modelopt-w4a16", "vllm-legacy", False),  # QUANT_ALGOS without W4A16_NVFP4
        ("modelopt-w4a16", "sglang", False),  # quant_method not in ["FP8", "NVFP4"]
    ],
)
def test_modelopt_config_against_each_server(exports, mode, server, accepted):
    problems = modelopt_config_problems(exports[mode], server)
    assert (problems == []) == accepted, problems


@pytest.mark.parametrize("mode", ["modelopt-w4a4", "modelopt-w4a16", "ct-w4a4", "ct-w4a16"])
def test_tensors_scales_and_shared_fused_scales(exports, mode):
    assert tensor_problems(exports[mode]) == []
