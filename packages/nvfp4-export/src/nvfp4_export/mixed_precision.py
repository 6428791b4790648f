"""The quantization metadata of an export whose linears have several formats (`LayoutPlan.fmt`
"mixed": NVFP4 beside MXFP8, or beside its FP8 stand-in in ModelOpt).

ModelOpt: `quant_algo` "MIXED_PRECISION" with one entry per quantized module in
`quantized_layers` (`{"quant_algo": "NVFP4", "group_size": 16}`, `"W4A16_NVFP4"`, `{"quant_algo":
"FP8"}`), as ModelOpt's exporter writes it (modelopt/torch/export/quant_utils.py,
`process_layer_quant_config`; config.json through `convert_hf_quant_config_format`: one config
group per distinct layer config with its modules as `targets`, plus `quantized_layers`), and
the BF16 modules in `exclude_modules`. A module missing from `quantized_layers` is built
unquantized by every reader (vLLM and SGLang `ModelOptMixedPrecisionConfig.get_quant_method`,
TensorRT-LLM's per-layer `quant_config_dict`); a fused layer's name is looked up directly first,
so the fused q/k/v name is listed beside its parts (SGLang's mixed config has no packed-module
mapping of its own).

compressed-tensors: one config group per format, each with its own `format`
("nvfp4-pack-quantized", "mxfp8-quantized") and its modules as `targets`; the top-level
`format` is "mixed-precision" (compressed-tensors' `CompressionFormat.mixed_precision`). vLLM
picks each layer's scheme from its group (`CompressedTensorsConfig._get_scheme_from_parts`, the
per-layer format) after mapping the targets with the model's `hf_to_vllm_mapper`
(`CompressedTensorsConfig.apply_vllm_mapper`).

Example:
    >>> modelopt_layer("fp8", w4a4=True), modelopt_layer("nvfp4", w4a4=False)
    ({'quant_algo': 'FP8'}, {'quant_algo': 'W4A16_NVFP4', 'group_size': 16})
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from nvfp4_export.formats import FORMATS, NVFP4

MIXED_PRECISION = "MIXED_PRECISION"
MIXED_CT_FORMAT = "mixed-precision"


def modelopt_layer(fmt: str, *, w4a4: bool) -> dict:
    """One module's `quantized_layers` entry for stored format `fmt`."""
    f = FORMATS[fmt]
    algo = f.modelopt_algos[0 if w4a4 else 1]
    return {"quant_algo": algo, **({"group_size": f.block_size} if f.block_size else {})}


def quantized_layers(plan, fused: Mapping[str, str]) -> dict[str, dict]:
    """Module -> its ModelOpt layer config, every quantized module and each fused layer whose
    parts all have one format (`fused`: fused name -> that format)."""
    named = {name: fmt for name, fmt in plan.modules} | dict(fused)
    return {name: modelopt_layer(fmt, w4a4=plan.w4a4) for name, fmt in named.items()}


def _group_size(plan) -> int | None:
    return NVFP4.block_size if NVFP4.name in plan.formats else None


def mixed_hf_quant_config(plan, excluded: Sequence[str], fused, producer: dict) -> dict:
    """`hf_quant_config.json` of a mixed ModelOpt export."""
    quantization = {
        "quant_algo": MIXED_PRECISION, "kv_cache_quant_algo": None,
        "group_size": _group_size(plan), "exclude_modules": list(excluded),
        "quantized_layers": quantized_layers(plan, fused),
    }  # fmt: skip
    return {"producer": dict(producer), "quantization": quantization}


def _modelopt_group(layer: dict) -> dict:
    """ModelOpt's config group of one layer config (`_quant_algo_to_group_config`)."""
    bits, size = (8, None) if layer["quant_algo"] == "FP8" else (4, layer.get("group_size"))
    args = {"dynamic": False, "num_bits": bits, "type": "float"}
    args |= {"group_size": size} if size else {}
    weight_only = layer["quant_algo"].startswith("W4A16")
    return {"input_activations": None if weight_only else dict(args), "weights": args}


def mixed_modelopt_config(plan, excluded: Sequence[str], fused, producer: dict) -> dict:
    """config.json `quantization_config` of a mixed ModelOpt export."""
    layers = quantized_layers(plan, fused)
    groups: dict[str, dict] = {}
    for config in sorted({tuple(sorted(v.items())) for v in layers.values()}):
        targets = sorted(name for name, v in layers.items() if tuple(sorted(v.items())) == config)
        groups[f"group_{len(groups)}"] = {**_modelopt_group(dict(config)), "targets": targets}
    return {
        "quant_method": "modelopt", "quant_algo": MIXED_PRECISION, "kv_cache_quant_algo": None,
        "group_size": _group_size(plan), "exclude_modules": list(excluded),
        "quantized_layers": layers, "config_groups": groups, "ignore": list(excluded),
        "producer": dict(producer),
    }  # fmt: skip


def mixed_ct_scheme(plan, excluded: Sequence[str], fused) -> dict:
    """config.json `quantization_config` of a mixed compressed-tensors export."""
    groups = {}
    for k, fmt in enumerate(plan.formats):
        f = FORMATS[fmt]
        quant = dict(f.ct_args)
        acts = {**quant, "dynamic": f.ct_input_dynamic} if plan.w4a4 else None
        targets = sorted({n for n, m in plan.modules if m == fmt} | {n for n, m in fused.items()
                                                                      if m == fmt})  # fmt: skip
        groups[f"group_{k}"] = {
            "targets": targets, "format": f.ct_format, "weights": {**quant, "dynamic": False},
            "input_activations": acts, "output_activations": None,
        }  # fmt: skip
    return {
        "quant_method": "compressed-tensors", "format": MIXED_CT_FORMAT,
        "quantization_status": "compressed", "config_groups": groups, "ignore": list(excluded),
        "kv_cache_scheme": None,
    }  # fmt: skip
