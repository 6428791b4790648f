"""Layout invariants of an export directory (names, dtypes, shapes, shared scales, metadata)."""

from __future__ import annotations

import numpy as np

from nvfp4_export.hf_files import INDEX_FILE, hf_dense_names
from nvfp4_export.layouts import fused_exclusions
from nvfp4_export.linears import hf_modules
from nvfp4_export.model_spec import ARCHITECTURES
from nvfp4_export.reload import LoadedExport

FUSED = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("mlp.gate_proj", "mlp.up_proj"),
)
_MODELOPT_KEYS = ("quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules")


def _expected(kind: str, layout: str, fmt: str, w4a4: bool, out: int, inp: int) -> dict:
    """tensor suffix -> (dtype name, shape) for one module."""
    if kind == "bf16":
        return {"weight": ("bfloat16", (out, inp))}
    if fmt == "mxfp4":
        return {
            "weight_packed": ("uint8", (out, inp // 2)),
            "weight_scale": ("uint8", (out, inp // 32)),
        }
    packed = "weight" if layout == "modelopt" else "weight_packed"
    exp = {packed: ("uint8", (out, inp // 2)), "weight_scale": ("float8_e4m3fn", (out, inp // 16))}
    if layout == "modelopt":
        exp["weight_scale_2"] = ("float32", ())
        if w4a4:
            exp["input_scale"] = ("float32", ())
    else:
        exp["weight_global_scale"] = ("float32", (1,))
        if w4a4:
            exp["input_global_scale"] = ("float32", (1,))
    return exp


def _module_problems(loaded: LoadedExport, name: str, exp: dict, seen: set) -> list[str]:
    problems = []
    for suffix, (dtype, shape) in exp.items():
        full = f"{name}.{suffix}"
        seen.add(full)
        t = loaded.tensors.get(full)
        if t is None:
            problems.append(f"missing tensor {full}")
        elif t.dtype.name != dtype or tuple(t.shape) != shape:
            problems.append(
                f"{full}: expected {dtype}{list(shape)}, got {t.dtype.name}{list(t.shape)}"
            )
    return problems


def _shared_scale_problems(loaded: LoadedExport, layer: int) -> list[str]:
    problems = []
    for group in FUSED:
        for suffix in (
            "weight_scale_2",
            "weight_global_scale",
            "input_scale",
            "input_global_scale",
        ):
            values = [loaded.tensors.get(f"model.layers.{layer}.{m}.{suffix}") for m in group]
            present = [np.asarray(v).reshape(-1)[0] for v in values if v is not None]
            if present and (len(present) != len(group) or len(set(present)) != 1):
                problems.append(f"layer {layer} {group}: {suffix} not shared: {present}")
    return problems


def _linear_problems(loaded: LoadedExport) -> list[str]:
    spec, prov = loaded.spec, loaded.provenance
    excluded = set(prov.get("excluded") or [])
    problems, seen = [], set()
    for source in spec.linear_paths():
        kind = "bf16" if prov["recipes"][source] == "bf16" else "fp4"
        for name, rows in hf_modules(spec, source):
            inp = _in_features(spec, name)
            exp = _expected(kind, loaded.layout, prov["format"], prov["w4a4"], rows, inp)
            problems += _module_problems(loaded, name, exp, seen)
            if (kind == "bf16") != (name in excluded):
                problems.append(
                    f"{name}: {'BF16 but not' if kind == 'bf16' else 'quantized but'} listed as excluded"
                )
    for i in range(spec.num_layers):
        problems += _shared_scale_problems(loaded, i)
    for name in hf_dense_names(spec):
        seen.add(name)
        if name not in loaded.tensors or loaded.tensors[name].dtype.name != "bfloat16":
            problems.append(f"{name}: missing or not BF16")
    extra = sorted(set(loaded.tensors) - seen)
    return problems + ([f"unexpected tensors {extra[:5]}"] if extra else [])


def _in_features(spec, name: str) -> int:
    if name.endswith("o_proj"):
        return spec.num_heads * spec.head_dim
    return spec.mlp_dim if name.endswith("down_proj") else spec.d_model


def _metadata_problems(loaded: LoadedExport) -> list[str]:
    cfg, prov, problems = loaded.config, loaded.provenance, []
    arch = loaded.spec.architecture
    if cfg.get("architectures") != [ARCHITECTURES[arch]] or cfg.get("model_type") != arch:
        problems.append(f"config.json is not a {ARCHITECTURES[arch]} config")
    qc = cfg.get("quantization_config")
    excluded = prov.get("excluded") or []
    if prov["format"] == "bf16":
        return problems + (["a BF16 export must have no quantization_config"] if qc else [])
    if loaded.layout == "compressed-tensors":
        fmt = "mxfp4-pack-quantized" if prov["format"] == "mxfp4" else "nvfp4-pack-quantized"
        if not qc or qc.get("quant_method") != "compressed-tensors" or qc.get("format") != fmt:
            problems.append(f"quantization_config must be compressed-tensors format {fmt}")
        elif sorted(qc.get("ignore", [])) != sorted(excluded):
            problems.append("quantization_config.ignore does not list exactly the BF16 modules")
        return problems
    hq = (loaded.hf_quant_config or {}).get("quantization")
    if not hq or "producer" not in (loaded.hf_quant_config or {}):
        return problems + ["hf_quant_config.json missing, or without producer/quantization"]
    problems += [f"hf_quant_config.json lacks {k}" for k in _MODELOPT_KEYS if k not in hq]
    expected = sorted([*excluded, *fused_exclusions(tuple(excluded))])
    if sorted(hq.get("exclude_modules", [])) != expected:
        problems.append(
            "exclude_modules does not list exactly the BF16 modules and their fused groups"
        )
    if (
        not qc
        or qc.get("quant_method") != "modelopt"
        or qc.get("quant_algo") != hq.get("quant_algo")
    ):
        problems.append("config.json quantization_config must be modelopt with the same quant_algo")
    return problems


def _file_problems(loaded: LoadedExport) -> list[str]:
    from nvfp4_format.safetensors_file import read_safetensors_header

    problems = []
    for file in loaded.files:
        if read_safetensors_header(loaded.path / file).metadata.get("format") != "pt":
            problems.append(f"{file}: safetensors metadata lacks format=pt")
    if (loaded.path / INDEX_FILE).is_file():
        from nvfp4_format.safetensors_file import read_safetensors_index

        index = read_safetensors_index(loaded.path / INDEX_FILE)
        if set(index.weight_map) != set(loaded.tensors):
            problems.append("index weight_map does not cover exactly the stored tensors")
    if not (loaded.path / "tokenizer.json").is_file():
        problems.append("no tokenizer.json")
    return problems


def nonfinite_problems(loaded: LoadedExport) -> list[str]:
    """Tensors holding NaN or Inf: weights, norms, block scales (E4M3 NaN, or the E8M0 NaN byte
    255 of MXFP4 scales), global and input scales. Nothing finite can be computed from them."""
    problems = []
    mxfp4 = loaded.provenance.get("format") == "mxfp4"
    for name, tensor in sorted(loaded.tensors.items()):
        if tensor.dtype == np.uint8:
            bad = int((tensor == 255).sum()) if mxfp4 and name.endswith("weight_scale") else 0
        else:
            bad = int((~np.isfinite(tensor.astype(np.float32))).sum())
        if bad:
            problems.append(f"{name}: {bad} NaN or Inf value(s)")
    return problems


def layout_problems(loaded: LoadedExport) -> list[str]:
    """Every broken invariant of the export (empty when it is sound)."""
    problems = _metadata_problems(loaded) + _file_problems(loaded) + _linear_problems(loaded)
    return problems + nonfinite_problems(loaded)
