"""The loading rules of the servers docs/export.md names, as executable checks on our exports.

Each rule is written from the server's loading code (file and function cited), and every
architecture (`conftest.ARCH_CASES`: Llama with and without attention biases, tied heads,
Mistral, Qwen 2, Qwen 3 with and without attention biases), layout and mode the exporter writes
is checked against it: which layers a server builds quantized and whether the stored tensors fit
that decision, which configs it accepts, which bias and q/k-norm tensors its model class loads,
tensor names/dtypes/shapes, the direction of the global scales, and the scales that fused modules
must share. A rule function returns the problems it finds ([] when the server would load the
export as trained).
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil

import numpy as np
import pytest
from conftest import ARCH_CASES, SMALL_MODEL, model_config, write_run

from nvfp4_export import export_hf, load_export

# ----------------------------------------------------------------------------- exclusion rules
# How a server decides that one of the layers it builds stays unquantized.

PACKED_MODULES = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}
"""`packed_modules_mapping` of vLLM's LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM
(vllm/model_executor/models/{llama,qwen2,qwen3}.py; Mistral subclasses Llama)."""


def _fullmatch_any(prefix: str, patterns: list[str]) -> bool:
    return any(re.fullmatch(p.replace(".", r"\.").replace("*", ".*"), prefix) for p in patterns)


def _shards(prefix: str) -> list[str]:
    *parent, name = prefix.split(".")
    return [".".join([*parent, s]) for s in PACKED_MODULES.get(name, [])]


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
    all its shards are (its own name is not consulted); some but not all raises ("Detected some
    but not all shards ...")."""
    if not _shards(prefix):
        return prefix in ignored or _fullmatch_any(prefix, ignored)
    skipped = [s in ignored or _fullmatch_any(s, ignored) for s in _shards(prefix)]
    if any(skipped) and not all(skipped):
        raise AssertionError(f"{prefix}: some but not all shards skipped (vLLM raises)")
    return all(skipped)


def _ct_match(name: str, targets: list[str]) -> bool:
    """compressed-tensors matching as vLLM/SGLang's `check_equal_or_regex_match`: exact name, or
    a "re:" entry by `re.match`."""
    return any(re.match(t[3:], name) if t.startswith("re:") else t == name for t in targets)


def vllm_ct_excluded(prefix: str, ignore: list[str], fused: dict | None = None) -> bool:
    """vLLM vllm/model_executor/layers/quantization/compressed_tensors/utils.py,
    `should_ignore_layer(layer_name, ignore, fused_mapping)`: a fused layer NOT listed by its own
    name is ignored when its shards are, and mixed shards raise ("Found a different quantization
    schemes ..."); a listed fused name, or an unfused layer, matches by name."""
    fused = PACKED_MODULES if fused is None else fused
    proj = prefix.split(".")[-1]
    if proj in fused and prefix not in ignore:
        skipped = [_ct_match(prefix.replace(proj, s), ignore) for s in fused[proj]]
        if any(skipped) and not all(skipped):
            raise AssertionError(f"{prefix}: shards with different schemes (vLLM raises)")
        return all(skipped)
    return _ct_match(prefix, ignore)


def sglang_ct_excluded(prefix: str, ignore: list[str]) -> bool:
    """SGLang python/sglang/srt/layers/quantization/compressed_tensors/compressed_tensors.py,
    `CompressedTensorsConfig.get_quant_method`: vLLM's `should_ignore_layer` with the config's
    own `packed_modules_mapping` (`from_config`: `config.get("packed_modules_mapping", {})`),
    which our exports do not write: the fused layer's own name decides."""
    return vllm_ct_excluded(prefix, ignore, fused={})


def trtllm_legacy_excluded(prefix: str, exclude_modules: list[str]) -> bool:
    """TensorRT-LLM before per-shard candidates: `DecoderModelForCausalLM.
    apply_quant_config_exclude_modules` (tensorrt_llm/_torch/models/modeling_utils.py) asks
    `QuantConfig.is_module_excluded_from_quantization(name)` (tensorrt_llm/models/
    modeling_utils.py: `fnmatch.fnmatchcase` per entry) for the built module's own (fused) name.
    compressed-tensors' `ignore` is that list (tensorrt_llm/models/quant_config_utils.py,
    `update_quant_config_from_compressed_tensors`: exclude_modules = ignore)."""
    return any(fnmatch.fnmatchcase(prefix, p) for p in exclude_modules)


def trtllm_excluded(prefix: str, exclude_modules: list[str]) -> bool:
    """Current TensorRT-LLM `apply_quant_config_exclude_modules`: the fused name or ANY of its
    shard names (`candidates` of a FUSED_QKV_LINEAR / FUSED_GATE_UP_LINEAR) excluded."""
    return any(trtllm_legacy_excluded(n, exclude_modules) for n in [prefix, *_shards(prefix)])


SERVER_LAYERS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
"""The linears vLLM, SGLang and TensorRT-LLM build per decoder layer (q/k/v and gate/up fused)."""
HF_LAYERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
"""The linears transformers builds per decoder layer (nothing fused)."""

MODELOPT_RULES = {
    "sglang": sglang_excluded,
    "vllm-legacy": vllm_legacy_excluded,
    "vllm-fused-aware": vllm_fused_excluded,
    "tensorrt-llm-legacy": trtllm_legacy_excluded,
    "tensorrt-llm": trtllm_excluded,
}
CT_RULES = {
    "vllm": vllm_ct_excluded,
    "sglang": sglang_ct_excluded,
    "tensorrt-llm-legacy": trtllm_legacy_excluded,
    "tensorrt-llm": trtllm_excluded,
}


def exclusion_problems(loaded, rule, layers=SERVER_LAYERS) -> list[str]:
    """Layers a server would build quantized with BF16 weights in the export, or the reverse."""
    exclude = _exclude_list(loaded)
    problems = []
    for i in range(loaded.spec.num_layers):
        for layer in layers:
            prefix = f"model.layers.{i}.{layer}"
            parts = _shards(prefix) or [prefix]
            stored_bf16 = [_is_bf16(loaded, p) for p in parts]
            if rule(prefix, exclude) != all(stored_bf16) or len(set(stored_bf16)) > 1:
                problems.append(
                    f"{prefix}: excluded={rule(prefix, exclude)}, stored BF16={stored_bf16}"
                )
    if not rule("lm_head", exclude):
        problems.append("lm_head would be built quantized")
    return problems


def transformers_problems(loaded) -> list[str]:
    """transformers + compressed-tensors (compressed_tensors/utils/match.py,
    `match_named_modules(model, targets, ignore)`): each unfused module by its own name."""
    return exclusion_problems(loaded, _ct_match, HF_LAYERS)


def _exclude_list(loaded) -> list[str]:
    if loaded.layout == "modelopt":
        return list(loaded.hf_quant_config["quantization"]["exclude_modules"])
    return list(loaded.config["quantization_config"]["ignore"])


def _is_bf16(loaded, module: str) -> bool:
    weight = loaded.tensors.get(f"{module}.weight")
    return weight is not None and weight.dtype.name == "bfloat16"


# ----------------------------------------------------------------------------- config rules

QUANT_ALGOS = {
    # vllm/model_executor/layers/quantization/modelopt.py, QUANT_ALGOS (newer releases)
    "vllm": ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4", "MXFP8"),
    # the same list in vLLM releases before W4A16_NVFP4 was added
    "vllm-legacy": ("FP8", "NVFP4"),
    # sglang modelopt_quant.py, ModelOptFp4Config.from_config: quant_method not in ["FP8", "NVFP4"]
    "sglang": ("FP8", "NVFP4"),
}


def modelopt_config_problems(loaded, server: str) -> list[str]:
    """`hf_quant_config.json` against a server's ModelOpt config reader."""
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


def _nvfp4_args(args) -> bool:
    """vLLM compressed_tensors.py `_is_nvfp4_format` / SGLang `_is_fp4a4_nvfp4` on one side."""
    return bool(args) and (args["num_bits"], args["type"], args["strategy"]) == (
        4, "float", "tensor_group") and args["group_size"] == 16 and args["symmetric"]  # fmt: skip


def _mxfp4_args(args) -> bool:
    """vLLM compressed_tensors.py `_is_mxfp4`: 4-bit float, strategy group, group_size 32."""
    return (args["num_bits"], args["type"], args["strategy"], args["group_size"]) == (
        4, "float", "group", 32)  # fmt: skip


def ct_config_problems(loaded, server: str) -> list[str]:
    """config.json `quantization_config` against a server's compressed-tensors reader.

    vllm: `CompressedTensorsConfig._get_scheme_from_parts` takes NVFP4 weights with NVFP4
    activations (W4A4) or none (`CompressedTensorsW4A4Fp4(use_a16=True)`), and MXFP4 weights.
    sglang (W4A4 only here): `_is_fp4a4_nvfp4(weight_quant, input_quant)` -> CompressedTensorsW4A4Fp4.
    tensorrt-llm: tensorrt_llm/models/quant_config_utils.py, `_quant_config_from_config_group`:
    "mxfp4-pack-quantized" -> W4A16_MXFP4 (group_size 32); otherwise it indexes
    `group["input_activations"]["strategy"]`, which must be "tensor_group" with weights
    tensor_group, group_size 16 (NVFP4).
    """
    qc = loaded.config.get("quantization_config") or {}
    groups = qc.get("config_groups") or {}
    if qc.get("quant_method") != "compressed-tensors" or len(groups) != 1:
        return ["not a one-group compressed-tensors config"]
    group = next(iter(groups.values()))
    weights, inputs = group["weights"], group.get("input_activations")
    if group.get("targets") != ["Linear"]:
        return [f"targets {group.get('targets')} (the servers read one group targeting Linear)"]
    if server == "tensorrt-llm" and group.get("format", qc.get("format")) == "mxfp4-pack-quantized":
        return [] if weights["group_size"] == 32 else ["MXFP4 group_size must be 32"]
    if server == "tensorrt-llm" and inputs is None:
        return ["input_activations is null and TensorRT-LLM indexes it (TypeError)"]
    if _mxfp4_args(weights) and server == "vllm":
        return []
    if not _nvfp4_args(weights):
        return [f"weights {weights} are not NVFP4 (tensor_group, 16)"]
    if inputs is not None and not _nvfp4_args(inputs):
        return [f"input_activations {inputs} are not NVFP4 (tensor_group, 16)"]
    return []


# ----------------------------------------------------------------------------- tensor rules


def tensor_problems(loaded) -> list[str]:
    """Names, dtypes, shapes, scale direction and shared fused scales a loader relies on.

    vLLM ModelOptNvFp4LinearMethod.create_weights / process_weights_after_loading (and the same
    in SGLang and TensorRT-LLM): weight U8 [out, in/2], weight_scale F8_E4M3 [out, in/16],
    weight_scale_2 F32 scalar DECODE scale, input_scale F32 scalar DECODE scale; the fused layer
    takes ONE weight_scale_2 / input_scale (vLLM keeps the max: differing ones mis-scale, TRT-LLM
    asserts equality). compressed-tensors (CompressedTensorsW4A4Fp4 / W4A16Fp4): weight_packed,
    weight_scale, weight_global_scale F32 [1] ENCODE scale, input_global_scale likewise.
    """
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


# ----------------------------------------------------------------------------- model-class rules


def built_biases(server: str, config: dict) -> tuple[bool, bool]:
    """(q/k/v biases, o_proj bias) the server's class builds for this config.json.

    vllm: models/llama.py `LlamaDecoderLayer` (bias = bias_o_proj = attention_bias; Mistral is
    `MistralForCausalLM(LlamaForCausalLM)`), models/qwen2.py `Qwen2Attention` (qkv True, o False),
    models/qwen3.py `Qwen3Attention` (qkv = attention_bias, o_proj bias=False).
    sglang: models/llama.py `LlamaAttention` (both = attention_bias; mistral.py subclasses it),
    models/qwen2.py (qkv True, o False), models/qwen3.py `Qwen3Attention` (both = attention_bias).
    tensorrt-llm: _torch/models/modeling_llama.py `LlamaAttention` (bias = attention_bias,
    dense_bias defaults to bias), modeling_mistral.py `MistralAttention` (bias=False),
    modeling_qwen.py `QwenAttention` (bias=True, dense_bias=False), modeling_qwen3.py
    `Qwen3DecoderLayer` (bias = dense_bias = attention_bias).
    transformers: Llama/Qwen3 attention_bias on both, Mistral none, Qwen2 q/k/v only.
    """
    ab = bool(config.get("attention_bias", False))
    return {
        "vllm": {"llama": (ab, ab), "mistral": (ab, ab), "qwen2": (True, False),
                 "qwen3": (ab, False)},
        "sglang": {"llama": (ab, ab), "mistral": (ab, ab), "qwen2": (True, False),
                   "qwen3": (ab, ab)},
        "tensorrt-llm": {"llama": (ab, ab), "mistral": (False, False), "qwen2": (True, False),
                         "qwen3": (ab, ab)},
        "transformers": {"llama": (ab, ab), "mistral": (False, False), "qwen2": (True, False),
                         "qwen3": (ab, ab)},
    }[server][config["model_type"]]  # fmt: skip


def model_class_problems(loaded, server: str) -> list[str]:
    """Bias, q/k-norm and head tensors the server's class would drop or never find.

    A stored `.bias` without a parameter is skipped silently (vLLM `Qwen2Model.load_weights` /
    `LlamaModel.load_weights`: "Skip loading extra bias for GPTQ models"); q/k norms are built by
    every server's Qwen 3 and no other class; a tied head (`tie_word_embeddings`) is the
    embedding (vLLM skips `lm_head.` weights, `AutoWeightsLoader(skip_prefixes=["lm_head."])`).
    """
    config, stored = loaded.config, set(loaded.tensors)
    qkv, o = built_biases(server, config)
    norms = config["model_type"] == "qwen3"
    expected = set() if config["tie_word_embeddings"] else {"lm_head.weight"}
    for i in range(config["num_hidden_layers"]):
        attn = f"model.layers.{i}.self_attn."
        expected |= {attn + f"{m}_proj.bias" for m in "qkv"} if qkv else set()
        expected |= {attn + "o_proj.bias"} if o else set()
        expected |= {attn + "q_norm.weight", attn + "k_norm.weight"} if norms else set()
    optional = {n for n in stored if n.endswith((".bias", "_norm.weight")) or n == "lm_head.weight"}
    problems = [f"{n}: stored, {server} drops it" for n in sorted(optional - expected)]
    return problems + [f"{n}: {server} needs it, not stored" for n in sorted(expected - stored)]


# ----------------------------------------------------------------------------- the exports

MODES = ("modelopt-w4a4", "modelopt-w4a16", "ct-w4a4", "ct-w4a16")


def _export(run, out, mode):
    layout = "modelopt" if mode.startswith("modelopt") else "compressed-tensors"
    # qwen3-bias drops o_proj.bias in vLLM: exported anyway so that the rules can say so
    return export_hf(run, out, layout=layout, weight_only=mode.endswith("w4a16"),
                     allow_dropped_tensors=True).out_dir  # fmt: skip


@pytest.fixture(scope="module")
def exports(arch_runs, tmp_path_factory):
    """(case, mode) -> the loaded export, for every architecture case and mode, plus MXFP4."""
    root = tmp_path_factory.mktemp("serving")
    out = {
        (case, mode): load_export(_export(run, root / f"{case}-{mode}", mode))
        for case, run in arch_runs.items()
        for mode in MODES
    }
    mx = write_run(root / "mx", model=model_config(**SMALL_MODEL), precision={"recipe": "mxfp4"})
    out["llama", "ct-mxfp4"] = load_export(_export(mx, root / "ctmx", "ct-w4a4"))
    return out


CASES = sorted(ARCH_CASES)
CT_EXPORTS = [(c, m) for c in CASES for m in ("ct-w4a4", "ct-w4a16")] + [("llama", "ct-mxfp4")]
"""MXFP4 is exported for Llama only: its layout does not depend on the architecture."""


@pytest.mark.parametrize("mode", ["modelopt-w4a4", "modelopt-w4a16"])
@pytest.mark.parametrize("case", CASES)
def test_modelopt_exports_load_under_every_exclusion_rule(exports, case, mode):
    loaded = exports[case, mode]
    problems = {rule: exclusion_problems(loaded, fn) for rule, fn in MODELOPT_RULES.items()}
    assert problems == dict.fromkeys(MODELOPT_RULES, [])


@pytest.mark.parametrize("case, mode", CT_EXPORTS)
def test_compressed_tensors_exports_load_under_every_exclusion_rule(exports, case, mode):
    loaded = exports[case, mode]
    problems = {rule: exclusion_problems(loaded, fn) for rule, fn in CT_RULES.items()}
    assert problems == dict.fromkeys(CT_RULES, [])
    assert transformers_problems(loaded) == []


def test_the_exclusion_rules_have_teeth(exports, tmp_path):
    # the ModelOpt export as it was before the fused names: SGLang and legacy vLLM and TRT-LLM
    # build an NVFP4 qkv_proj over the BF16 q/k/v of block 1
    mo = shutil.copytree(exports["qwen3", "modelopt-w4a4"].path, tmp_path / "mo")
    path = mo / "hf_quant_config.json"
    hq = json.loads(path.read_text())
    quant = hq["quantization"]
    quant["exclude_modules"] = [m for m in quant["exclude_modules"]
                                if not m.endswith(("qkv_proj", "gate_up_proj"))]  # fmt: skip
    path.write_text(json.dumps(hq))
    old = load_export(mo)
    assert exclusion_problems(old, sglang_excluded)
    assert exclusion_problems(old, vllm_legacy_excluded)
    assert exclusion_problems(old, trtllm_legacy_excluded)
    assert exclusion_problems(old, vllm_fused_excluded) == []  # new vLLM maps the shards
    assert exclusion_problems(old, trtllm_excluded) == []  # so does TRT-LLM's candidates list
    quant["exclude_modules"].append("model.layers.1*")  # a wildcard: layers 1 and 10..19
    path.write_text(json.dumps(hq))
    wildcard = modelopt_config_problems(load_export(mo), "vllm")
    assert "a wildcard in exclude_modules" in " ".join(wildcard)
    # compressed-tensors likewise, and a fused name listed for a half-BF16 group trips vLLM
    ct = shutil.copytree(exports["qwen3", "ct-w4a4"].path, tmp_path / "ct")
    cfg = json.loads((ct / "config.json").read_text())
    ignore = cfg["quantization_config"]["ignore"]
    cfg["quantization_config"]["ignore"] = [m for m in ignore if not m.endswith("_up_proj")]
    (ct / "config.json").write_text(json.dumps(cfg))
    old = load_export(ct)
    assert exclusion_problems(old, sglang_ct_excluded)
    assert exclusion_problems(old, trtllm_legacy_excluded)
    assert exclusion_problems(old, vllm_ct_excluded) == []
    with pytest.raises(AssertionError, match="different schemes"):
        vllm_ct_excluded("model.layers.1.mlp.gate_up_proj", ["model.layers.1.mlp.up_proj"])


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
@pytest.mark.parametrize("case", CASES)
def test_modelopt_config_against_each_server(exports, case, mode, server, accepted):
    problems = modelopt_config_problems(exports[case, mode], server)
    assert (problems == []) == accepted, problems


CT_SERVERS = {
    "ct-w4a4": {"vllm": True, "sglang": True, "tensorrt-llm": True},
    # vLLM: CompressedTensorsW4A4Fp4(use_a16=True), Marlin; TRT-LLM: input_activations null, which
    # the export refuses too (servers.layout_refusal)
    "ct-w4a16": {"vllm": True, "tensorrt-llm": False},
    "ct-mxfp4": {"vllm": True, "tensorrt-llm": True},  # TRT-LLM as W4A16_MXFP4: BF16 activations
}


@pytest.mark.parametrize("case, mode", CT_EXPORTS)
def test_compressed_tensors_config_against_each_server(exports, case, mode):
    problems = {s: ct_config_problems(exports[case, mode], s) for s in CT_SERVERS[mode]}
    accepted = {s: problems[s] == [] for s in problems}
    assert accepted == CT_SERVERS[mode], problems
    if not CT_SERVERS[mode].get("tensorrt-llm", True):
        assert problems["tensorrt-llm"] == [
            "input_activations is null and TensorRT-LLM indexes it (TypeError)"
        ]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_tensors_scales_and_shared_fused_scales(exports, case, mode):
    assert tensor_problems(exports[case, mode]) == []


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_each_server_builds_exactly_the_biases_and_norms_stored(exports, case, mode):
    # except vLLM's Qwen 3, which has no o_proj bias: the export refuses it unless told
    problems = {s: model_class_problems(exports[case, mode], s) for s in
                ("vllm", "sglang", "tensorrt-llm", "transformers")}  # fmt: skip
    dropped = [f"model.layers.{i}.self_attn.o_proj.bias: stored, vllm drops it" for i in (0, 1)]
    assert problems == {
        "vllm": dropped if case == "qwen3-bias" else [],
        "sglang": [],
        "tensorrt-llm": [],
        "transformers": [],
    }
    stored = exports[case, mode].tensors
    assert ("lm_head.weight" in stored) == (case != "llama-tied")
    assert ("model.layers.1.self_attn.q_norm.weight" in stored) == case.startswith("qwen3")
    assert ("model.layers.0.self_attn.v_proj.bias" in stored) == (
        case in ("llama-bias", "qwen2", "qwen3-bias")
    )
