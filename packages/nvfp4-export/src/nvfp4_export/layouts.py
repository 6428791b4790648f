"""Tensor names, dtypes and quantization metadata of the two HF layouts (spec: export-formats.md).

ModelOpt ("modelopt"): `<m>.weight` U8 packed, `<m>.weight_scale` F8_E4M3, `<m>.weight_scale_2` F32 []
(DECODE global scale), `<m>.input_scale` F32 [] (W4A4). compressed-tensors ("compressed-tensors"):
`<m>.weight_packed`, `<m>.weight_scale` (same bytes), `<m>.weight_global_scale` F32 [1] (ENCODE scale,
the reciprocal), `<m>.input_global_scale` F32 [1] (W4A4); MXFP4 linears use "mxfp4-pack-quantized"
(`weight_packed`, `weight_scale` U8 E8M0, no global scale).
"""

from __future__ import annotations

import dataclasses

import numpy as np

import nvfp4_format
from nvfp4_export.errors import ExportError
from nvfp4_export.linears import ExportedLinear

LAYOUTS = ("modelopt", "compressed-tensors")
PRODUCER = {"name": "nvfp4-export", "version": "0.1.0"}


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
    """What a layout writes for a set of exported linears.

    Attributes:
        layout: "modelopt" or "compressed-tensors".
        fmt: "nvfp4" or "mxfp4" (the quantized linears' format; "bf16" when none is quantized).
        w4a4: input (activation) scales are written.
        excluded: HF module names kept in BF16 (lm_head first).
    """

    layout: str
    fmt: str
    w4a4: bool
    excluded: tuple[str, ...]


def plan_layout(layout: str, linears: list[ExportedLinear], *, weight_only: bool) -> LayoutPlan:
    """Checks that `linears` fit `layout` and decides W4A4 vs weight-only.

    W4A4 needs an `input_amax` on every NVFP4 linear (MXFP4 activations are scaled per block at run
    time, so MXFP4 W4A4 needs none).

    Raises:
        ExportError: unknown layout, NVFP4 and MXFP4 linears mixed, MXFP4 with "modelopt".
    """
    if layout not in LAYOUTS:
        raise ExportError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    fmts = sorted({m.fmt for m in linears} - {"bf16"})
    if len(fmts) > 1:
        raise ExportError(f"one export holds one FP4 format; this model mixes {fmts}")
    fmt = fmts[0] if fmts else "bf16"
    if fmt == "mxfp4" and layout == "modelopt":
        raise ExportError(
            "MXFP4-trained linears are exported in the compressed-tensors layout "
            "('mxfp4-pack-quantized'); use --layout compressed-tensors, got --layout modelopt"
        )
    quantized = [m for m in linears if m.fmt != "bf16"]
    has_amax = bool(quantized) and all(m.input_amax is not None for m in quantized)
    w4a4 = not weight_only and (fmt == "mxfp4" or has_amax)
    excluded = ("lm_head", *[m.name for m in linears if m.fmt == "bf16"])
    return LayoutPlan(layout, fmt, w4a4, excluded)


FUSED_MODULES = (
    ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
)
"""The modules servers fuse (their name, then the checkpoint modules they load into them)."""


def fused_exclusions(excluded: tuple[str, ...]) -> tuple[str, ...]:
    """The fused module names (`model.layers.<i>.self_attn.qkv_proj`, `...mlp.gate_up_proj`)
    whose every part is in `excluded`.

    SGLang matches `exclude_modules` against the fused layers it builds (regex fullmatch, no
    fused-module mapping for Llama), as do vLLM releases before its fused-aware
    `is_layer_skipped`: listing only `q_proj`, `k_proj`, `v_proj` makes them build an NVFP4
    `qkv_proj` and fail on the BF16 weights. Exact names only: a wildcard such as
    `model.layers.1*` would also match layers 10 to 19.
    """
    names, fused = set(excluded), []
    for module in excluded:
        for fused_name, parts in FUSED_MODULES:
            if module.endswith("." + parts[0]):
                prefix = module[: -len(parts[0])]
                if all(prefix + part in names for part in parts):
                    fused.append(prefix + fused_name)
    return tuple(fused)


def modelopt_exclusions(plan: LayoutPlan) -> list[str]:
    """ModelOpt's `exclude_modules`: the BF16 modules, then the fused names of fully BF16 groups."""
    return [*plan.excluded, *fused_exclusions(plan.excluded)]


def _scalar(x: float, shape: tuple[int, ...]) -> np.ndarray:
    return np.full(shape, x, dtype=np.float32)


def linear_tensors(m: ExportedLinear, plan: LayoutPlan) -> dict[str, np.ndarray]:
    """The safetensors entries of one module in `plan`'s layout."""
    if m.fmt == "bf16":
        return {f"{m.name}.weight": m.weight}
    if m.fmt == "mxfp4":
        return {f"{m.name}.weight_packed": m.packed, f"{m.name}.weight_scale": m.scales}
    if plan.layout == "modelopt":
        out = {
            f"{m.name}.weight": m.packed,
            f"{m.name}.weight_scale": m.scales,
            f"{m.name}.weight_scale_2": _scalar(m.global_decode_scale, ()),
        }
        if plan.w4a4:
            out[f"{m.name}.input_scale"] = _scalar(
                nvfp4_format.global_decode_scale(np.float32(m.input_amax)), ()
            )
        return out
    out = {
        f"{m.name}.weight_packed": m.packed,
        f"{m.name}.weight_scale": m.scales,
        f"{m.name}.weight_global_scale": _scalar(m.global_encode_scale, (1,)),
    }
    if plan.w4a4:
        out[f"{m.name}.input_global_scale"] = _scalar(
            nvfp4_format.global_encode_scale(np.float32(m.input_amax)), (1,)
        )
    return out


def _ct_scheme(plan: LayoutPlan) -> dict:
    if plan.fmt == "mxfp4":
        quant = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group"}
        quant |= {"group_size": 32, "observer": "minmax"}
        acts = {**quant, "dynamic": True} if plan.w4a4 else None
        weights, fmt = {**quant, "dynamic": False}, "mxfp4-pack-quantized"
    else:
        quant = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group"}
        quant |= {"group_size": 16, "observer": "minmax"}
        acts = {**quant, "dynamic": "local"} if plan.w4a4 else None
        weights, fmt = {**quant, "dynamic": False}, "nvfp4-pack-quantized"
    group = {"targets": ["Linear"], "format": fmt, "weights": weights}
    group |= {"input_activations": acts, "output_activations": None}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": list(plan.excluded),
        "kv_cache_scheme": None,
    }


def _modelopt_algo(plan: LayoutPlan) -> str:
    return "NVFP4" if plan.w4a4 else "W4A16_NVFP4"


def hf_quant_config(plan: LayoutPlan) -> dict | None:
    """The ModelOpt `hf_quant_config.json` (None for compressed-tensors)."""
    if plan.layout != "modelopt":
        return None
    quantization = {"quant_algo": _modelopt_algo(plan), "kv_cache_quant_algo": None}
    quantization |= {"group_size": 16, "exclude_modules": modelopt_exclusions(plan)}
    return {"producer": dict(PRODUCER), "quantization": quantization}


def quantization_config(plan: LayoutPlan) -> dict:
    """The `quantization_config` entry of config.json for `plan`."""
    if plan.layout == "compressed-tensors":
        return _ct_scheme(plan)
    quant = {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False}
    group = {"targets": ["Linear"], "weights": quant, "input_activations": None}
    if plan.w4a4:
        group["input_activations"] = dict(quant)
    return {
        "quant_method": "modelopt",
        "quant_algo": _modelopt_algo(plan),
        "kv_cache_quant_algo": None,
        "group_size": 16,
        "exclude_modules": modelopt_exclusions(plan),
        "config_groups": {"group_0": group},
        "ignore": modelopt_exclusions(plan),
        "producer": dict(PRODUCER),
    }
