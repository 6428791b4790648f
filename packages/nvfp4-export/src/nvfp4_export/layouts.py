"""What the HF layouts write for a set of exported linears (spec: export-formats.md).

ModelOpt ("modelopt"), compressed-tensors ("compressed-tensors") and the unquantized "bf16"
(every linear `<m>.weight` BF16 [out, in], its master weight rounded; no quantization metadata);
the tensor names of each
(format, layout) come from `formats.FORMATS` (which takes them from `nvfp4_format.layout_names`):
ModelOpt `<m>.weight` U8 packed, `<m>.weight_scale` F8_E4M3, `<m>.weight_scale_2` F32 [] (DECODE
global scale), `<m>.input_scale` F32 [] (W4A4); compressed-tensors `<m>.weight_packed`,
`<m>.weight_scale` (same bytes), `<m>.weight_global_scale` F32 [1] (ENCODE scale, the
reciprocal), `<m>.input_global_scale` F32 [1] (W4A4); MXFP4 linears use "mxfp4-pack-quantized"
(`weight_packed`, `weight_scale` U8 E8M0, no global scale); 8-bit linears beside them
(`eight_bit_formats`) make the export "mixed", whose metadata is `mixed_precision`'s.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

import nvfp4_format
from nvfp4_export.eight_bit_formats import fp8_decode_scale
from nvfp4_export.errors import ExportError
from nvfp4_export.exported_linear import ExportedLinear
from nvfp4_export.formats import (
    BF16,
    BF16_LAYOUT,
    COMPRESSED_TENSORS,
    FORMATS,
    FP4_FORMATS,
    LAYOUTS,
    MIXED,
    MODELOPT,
    ExportFormat,
    layout_names,
)
from nvfp4_export.mixed_precision import (
    mixed_ct_scheme,
    mixed_hf_quant_config,
    mixed_modelopt_config,
)
from nvfp4_format.layout_names import WEIGHT, LayoutNames

PRODUCER = {"name": "nvfp4-export", "version": "0.1.0"}


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
    """What a layout writes for a set of exported linears.

    Attributes:
        layout: "modelopt", "compressed-tensors" or "bf16".
        fmt: "nvfp4" or "mxfp4" (the quantized linears' format; "bf16" when none is quantized;
            "mixed" when 8-bit linears are stored beside them, `formats`).
        w4a4: input (activation) scales are written.
        excluded: HF module names kept in BF16 (lm_head first).
        moe: the model has Mixture-of-Experts blocks.
        modules: (HF module, stored format) of every quantized linear, in model order.
    """

    layout: str
    fmt: str
    w4a4: bool
    excluded: tuple[str, ...]
    moe: bool = False
    modules: tuple[tuple[str, str], ...] = ()

    @property
    def formats(self) -> tuple[str, ...]:
        """The stored formats of the quantized linears, sorted."""
        return tuple(sorted({fmt for _, fmt in self.modules}))


def plan_layout(
    layout: str,
    linears: list[ExportedLinear],
    *,
    weight_only: bool,
    always_bf16: tuple[str, ...] = (),
) -> LayoutPlan:
    """Checks that `linears` fit `layout` and decides W4A4 vs weight-only.

    `always_bf16` names the linear modules that are never quantized and are not among
    `linears` (MoE routers, Qwen2-MoE's shared-expert gate): they are excluded like `lm_head`.

    W4A4 needs an `input_amax` on every linear whose format takes a calibrated input scale
    (NVFP4, FP8); MXFP4 and MXFP8 activations are scaled per block at run time and need none
    (`ExportFormat.calibrated_input`). 8-bit linears may sit beside the one FP4 format: the
    plan is then "mixed".

    Raises:
        ExportError: unknown layout, NVFP4 and MXFP4 linears mixed, a format without that layout
            (MXFP4 with "modelopt"), a quantized linear in the "bf16" layout.
    """
    if layout not in LAYOUTS:
        raise ExportError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    fmts = sorted({m.fmt for m in linears} - {BF16})
    if layout == BF16_LAYOUT and fmts:
        raise ExportError(f"the {BF16_LAYOUT} layout holds BF16 linears only, got {fmts} ones")
    fp4 = [f for f in fmts if f in FP4_FORMATS]
    if len(fp4) > 1:
        raise ExportError(f"one export holds one FP4 format; this model mixes {fp4}")
    for f in (FORMATS[name] for name in fmts):
        if layout not in f.layouts:
            raise ExportError(
                f"{f.label}-trained linears are exported in the {' or '.join(f.layouts)} layout "
                f"('{f.ct_format}'); use --layout {' or --layout '.join(f.layouts)}, got "
                f"--layout {layout}"
            )
    fmt = fmts[0] if len(fmts) == 1 else (MIXED if fmts else BF16)
    quantized = [m for m in linears if m.fmt != BF16]
    calibrated = [m for m in quantized if FORMATS[m.fmt].calibrated_input]
    has_amax = bool(calibrated) and all(m.input_amax is not None for m in calibrated)
    w4a4 = not weight_only and (has_amax or (bool(quantized) and not calibrated))
    excluded = ("lm_head", *always_bf16, *[m.name for m in linears if m.fmt == BF16])
    moe = any(".experts." in m.name for m in linears)
    modules = tuple((m.name, m.fmt) for m in quantized)
    return LayoutPlan(layout, fmt, w4a4, excluded, moe, modules)


def refuse_bf16_options(layout: str, **options: object) -> None:
    """The options about input scales and FP4 modes (`weight_only`, `calibrate_n`,
    `calibration_text`) mean nothing for the unquantized "bf16" layout: an error if one is set.

    Raises:
        ExportError: naming the first option given and its command-line spelling.
    """
    if layout != BF16_LAYOUT:
        return
    for name, value in options.items():
        if value not in (None, False):
            flag = {"calibrate_n": "calibrate"}.get(name, name).replace("_", "-")
            raise ExportError(
                f"--{flag} does not apply to --layout {BF16_LAYOUT}: it writes every linear "
                f"unquantized, with no input scales (got {name}={value!r})"
            )


FUSED_MODULES = (
    ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("mixer.qkv_proj", ("mixer.q_proj", "mixer.k_proj", "mixer.v_proj")),
    ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
    (
        "mlp.shared_expert.gate_up_proj",
        ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
    ),
)
"""The modules servers fuse (their name, then the checkpoint modules they load into them)."""


def fused_exclusions(excluded: tuple[str, ...]) -> tuple[str, ...]:
    """The fused module names (`model.layers.<i>.self_attn.qkv_proj`, `...mlp.gate_up_proj`)
    whose every part is in `excluded`.

    Several loaders match the exclusion list against the fused layers they build, by name:
    SGLang's ModelOpt path (regex fullmatch, no fused-module mapping for Llama), vLLM releases
    before its fused-aware `is_layer_skipped`, SGLang's compressed-tensors `should_ignore_layer`
    when the config carries no `packed_modules_mapping`, and TensorRT-LLM (compressed-tensors
    `ignore` becomes `exclude_modules`, fnmatch'ed against `qkv_proj` / `gate_up_proj`; releases
    before its per-shard candidates only that name). Listing only `q_proj`, `k_proj`, `v_proj`
    makes them build an NVFP4 `qkv_proj` and fail on (or misread) the BF16 weights. The same goes
    for an MoE block's experts: vLLM's ModelOpt `is_layer_excluded` and SGLang's match the fused
    MoE layer's own name (`model.layers.<i>.mlp.experts`), so a BF16 block's per-expert names are
    followed by it (vLLM's compressed-tensors path asks for expert 0's per-expert names,
    `CompressedTensorsMoEMethod.get_moe_method`, which are listed too). The fused
    names are added only for groups whose every part is BF16, so vLLM's fused-aware rule, which
    raises on "some but not all shards", still sees whole groups (and takes a listed fused name
    as it is). Exact names only: a wildcard such as `model.layers.1*` would also match layers 10
    to 19.
    """
    names, fused = set(excluded), []
    for module in excluded:
        for fused_name, parts in FUSED_MODULES:
            if module.endswith("." + parts[0]):
                prefix = module[: -len(parts[0])]
                if all(prefix + part in names for part in parts):
                    fused.append(prefix + fused_name)
        experts = _EXPERT_MODULE.match(module)
        if experts and experts.group(1) not in fused:
            fused.append(experts.group(1))
    return tuple(fused)


_EXPERT_MODULE = re.compile(
    r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.\d+\.[^.]+$"
)
"""A routed expert's module; group 1 is the fused MoE layer servers build for its block
(`model.layers.{i}.mlp.experts`). A block's experts are BF16 all together or not at all
(`expert_scales.refuse_mixed_experts`), so one excluded expert module means the whole layer."""


def fused_formats(plan: LayoutPlan) -> dict[str, str]:
    """Fused layer name -> format, for every fused group (`FUSED_MODULES`) whose parts are all
    quantized in one format (the mixed layouts list the fused name too)."""
    formats, out = dict(plan.modules), {}
    for module, fmt in plan.modules:
        for fused_name, parts in FUSED_MODULES:
            if module.endswith("." + parts[0]):
                prefix = module[: -len(parts[0])]
                if all(formats.get(prefix + part) == fmt for part in parts):
                    out[prefix + fused_name] = fmt
    return out


def excluded_modules(plan: LayoutPlan) -> list[str]:
    """ModelOpt's `exclude_modules` and compressed-tensors' `ignore`: the BF16 modules, then the
    fused names of fully BF16 groups (`fused_exclusions`)."""
    return [*plan.excluded, *fused_exclusions(plan.excluded)]


def _scalar(x: float, shape: tuple[int, ...]) -> np.ndarray:
    return np.full(shape, x, dtype=np.float32)


def scale_of_amax(amax: np.float32, names: LayoutNames, fmt: str = "nvfp4") -> np.float32:
    """The layout's global (or input) scale of `amax`: ENCODE (6 * 448 / amax) or DECODE (its
    reciprocal); FP8 per tensor (`fmt` "fp8"): the DECODE scale amax / 448."""
    if fmt == "fp8":
        return fp8_decode_scale(amax)
    if names.scales_encode:
        return nvfp4_format.global_encode_scale(amax)
    return nvfp4_format.global_decode_scale(amax)


def linear_tensors(m: ExportedLinear, plan: LayoutPlan) -> dict[str, np.ndarray]:
    """The safetensors entries of one module in `plan`'s layout."""
    if m.fmt == BF16:
        return {LayoutNames.tensor(m.name, WEIGHT): m.weight}
    names = layout_names(m.fmt, plan.layout)
    out = {names.tensor(m.name, names.packed): m.packed}
    if names.block_scales is not None:
        out[names.tensor(m.name, names.block_scales)] = m.scales
    if names.global_scale is not None:
        value = m.global_encode_scale if names.scales_encode else m.global_decode_scale
        out[names.tensor(m.name, names.global_scale)] = _scalar(value, names.scalar_shape)
    if plan.w4a4 and names.input_scale is not None:
        value = scale_of_amax(np.float32(m.input_amax), names, m.fmt)
        out[names.tensor(m.name, names.input_scale)] = _scalar(value, names.scalar_shape)
    return out


def _ct_scheme(plan: LayoutPlan) -> dict:
    if plan.fmt == MIXED:
        return mixed_ct_scheme(plan, excluded_modules(plan), fused_formats(plan))
    f = FORMATS[plan.fmt]
    quant = dict(f.ct_args)
    acts = {**quant, "dynamic": f.ct_input_dynamic} if plan.w4a4 else None
    weights = {**quant, "dynamic": False}
    group = {"targets": ["Linear"], "format": f.ct_format, "weights": weights}
    group |= {"input_activations": acts, "output_activations": None}
    return {
        "quant_method": "compressed-tensors",
        "format": f.ct_format,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": excluded_modules(plan),
        "kv_cache_scheme": None,
    }


def _modelopt_algo(f: ExportFormat, plan: LayoutPlan) -> str:
    w4a4, weight_only = f.modelopt_algos
    return w4a4 if plan.w4a4 else weight_only


def hf_quant_config(plan: LayoutPlan) -> dict | None:
    """The ModelOpt `hf_quant_config.json` (None for compressed-tensors)."""
    if plan.layout != MODELOPT:
        return None
    if plan.fmt == MIXED:
        return mixed_hf_quant_config(plan, excluded_modules(plan), fused_formats(plan), PRODUCER)
    f = FORMATS[plan.fmt]
    quantization = {"quant_algo": _modelopt_algo(f, plan), "kv_cache_quant_algo": None}
    quantization |= {"group_size": f.block_size or None, "exclude_modules": excluded_modules(plan)}
    return {"producer": dict(PRODUCER), "quantization": quantization}


def _modelopt_config(plan: LayoutPlan) -> dict:
    if plan.fmt == MIXED:
        return mixed_modelopt_config(plan, excluded_modules(plan), fused_formats(plan), PRODUCER)
    f = FORMATS[plan.fmt]
    quant = {"num_bits": f.ct_args["num_bits"], "type": f.ct_args["type"]}
    quant |= {"group_size": f.block_size, "dynamic": False} if f.block_size else {"dynamic": False}
    group = {"targets": ["Linear"], "weights": quant, "input_activations": None}
    if plan.w4a4:
        group["input_activations"] = dict(quant)
    return {
        "quant_method": "modelopt",
        "quant_algo": _modelopt_algo(f, plan),
        "kv_cache_quant_algo": None,
        "group_size": f.block_size or None,
        "exclude_modules": excluded_modules(plan),
        "config_groups": {"group_0": group},
        "ignore": excluded_modules(plan),
        "producer": dict(PRODUCER),
    }


QUANTIZATION_CONFIGS = {MODELOPT: _modelopt_config, COMPRESSED_TENSORS: _ct_scheme}
"""Layout -> the writer of its config.json `quantization_config`."""


def quantization_config(plan: LayoutPlan) -> dict:
    """The `quantization_config` entry of config.json for `plan` (a quantized format)."""
    return QUANTIZATION_CONFIGS[plan.layout](plan)
