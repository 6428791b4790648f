"""Quantize each trained linear exactly as its forward pass did, then split fused outputs for HF.

Training computes a quantized linear as x @ Q(W) with W = float32 master kernel [in, out] cast to
the compute dtype, and Q quantizing W^T [out, in] along `in` with the recipe's block shape (16x16
tiles for the paper's recipe) and ONE global amax over the whole fused tensor (q|k|v, gate|up).
Doing the same here (through `nvfp4_format`) reproduces the model's codes and scales bit for bit;
splitting rows afterwards keeps them (block scales are stored per row, a 16x16 tile's scale repeated
over its rows) and the shared global scale is what servers require for fused q/k/v and gate/up.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from nvfp4_export.bfloat16 import bfloat16_values_transposed, transposed
from nvfp4_export.eight_bit_formats import fp8_of_mxfp8
from nvfp4_export.errors import ExportError
from nvfp4_export.exported_linear import ExportedLinear
from nvfp4_export.formats import BF16, BF16_LAYOUT, FORMATS, stored_format
from nvfp4_export.hybrid_names import hybrid_hf_modules, hybrid_in_features
from nvfp4_export.model_spec import LlamaSpec
from nvfp4_export.moe_spec import SHARED_LINEARS, expert_modules, is_expert_linear, shared_modules
from nvfp4_export.policy import WeightFormat, weight_format

_NP_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def hf_modules(spec: LlamaSpec, source: str, expert: int | None = None) -> list[tuple[str, int]]:
    """(HF module name, output rows) in the order the fused output of `source` holds them; for a
    routed experts' linear (`mlp.experts.gate_up`) every expert's modules in expert order, or
    only those of `expert`."""
    if spec.hybrid:
        return hybrid_hf_modules(spec, source)
    prefix, kind = source.split(".", 2)[:2], source.split(".", 2)[2]
    layer = int(prefix[1])
    if is_expert_linear(source):
        rows = spec.expert_mlp_dim if kind.endswith("gate_up") else spec.d_model
        experts = range(spec.num_experts) if expert is None else [expert]
        arch = spec.architecture
        return [(n, rows) for e in experts for n in expert_modules(arch, layer, kind, e)]
    if kind in SHARED_LINEARS:
        rows = spec.shared_mlp_dim if kind.endswith("gate_up") else spec.d_model
        return [(n, rows) for n in shared_modules(spec.architecture, layer, kind)]
    base = f"model.{prefix[0]}.{prefix[1]}."
    q, k, v = spec.qkv_split
    table = {
        "attn.qkv": [("self_attn.q_proj", q), ("self_attn.k_proj", k), ("self_attn.v_proj", v)],
        "attn.o": [("self_attn.o_proj", spec.d_model)],
        "mlp.gate_up": [("mlp.gate_proj", spec.mlp_dim), ("mlp.up_proj", spec.mlp_dim)],
        "mlp.down": [("mlp.down_proj", spec.d_model)],
    }
    return [(base + name, rows) for name, rows in table[kind]]


def in_features(spec: LlamaSpec, source: str) -> int:
    """The input width of training linear `source` (of each expert's, for the experts)."""
    if spec.hybrid:
        return hybrid_in_features(spec, source)
    kind = source.split(".", 2)[2]
    widths = {"attn.o": spec.num_heads * spec.head_dim, "mlp.down": spec.mlp_dim,
              "mlp.experts.down": spec.expert_mlp_dim, "mlp.shared.down": spec.shared_mlp_dim}  # fmt: skip
    return widths.get(kind, spec.d_model)


def compute_weight_t(kernel_IxO: np.ndarray, dtype: str) -> np.ndarray:
    """W^T [out, in] as float32 holding the compute-dtype values the model multiplied with."""
    if dtype == "bfloat16":
        return bfloat16_values_transposed(kernel_IxO)
    if dtype == "float32":
        return transposed(np.asarray(kernel_IxO, np.float32))
    return np.ascontiguousarray(kernel_IxO.astype(_NP_DTYPES[dtype]).astype(np.float32).T)


def _split_rows(rows: list[tuple[str, int]]) -> list[tuple[str, slice]]:
    out, start = [], 0
    for name, n in rows:
        out.append((name, slice(start, start + n)))
        start += n
    return out


def _quantized_parts(
    w_t: np.ndarray, wf: WeightFormat, source: str
) -> tuple[np.ndarray, np.ndarray, np.float32 | None]:
    try:
        return FORMATS[wf.fmt].quantize(w_t, wf.block_shape, wf.block_scale_rule)
    except ValueError as err:
        raise ExportError(
            f"linear {source!r} [out, in]={w_t.shape} cannot be quantized: {err}"
        ) from err


def _per_expert(input_amax, count: int) -> list:
    """One input amax per expert: the list given, or `input_amax` (None) for each."""
    if isinstance(input_amax, (list, tuple)):
        return list(input_amax)
    return [input_amax] * count


def export_linear(
    spec: LlamaSpec, source: str, kernel_IxO: np.ndarray, recipe: str, input_amax
) -> list[ExportedLinear]:
    """The HF modules of training linear `source` (fused outputs split), quantized per `recipe`.

    A routed experts' linear (kernel [E, in, out], `input_amax` a list of one amax per expert or
    None) is quantized expert by expert, each with its own global amax over its gate | up (as
    training's grouped GEMM does), so gate and up share one global scale by construction.

    Example:
        >>> spec = LlamaSpec(vocab_size=32, d_model=32, num_layers=1, num_heads=2,
        ...                  num_kv_heads=1, head_dim=16, mlp_dim=32)
        >>> k = np.random.default_rng(0).normal(size=(32, 64)).astype(np.float32)
        >>> [m.packed.shape for m in export_linear(spec, "layers.0.attn.qkv", k, "nvfp4", None)]
        [(32, 16), (16, 16), (16, 16)]
    """
    if is_expert_linear(source):
        amax = _per_expert(input_amax, spec.num_experts)
        return [
            m
            for e in range(spec.num_experts)
            for m in _export_one(spec, source, kernel_IxO[e], recipe, amax[e], e)
        ]
    return _export_one(spec, source, kernel_IxO, recipe, input_amax, None)


def master_bf16_linear(
    spec: LlamaSpec, source: str, kernel_IxO: np.ndarray
) -> list[ExportedLinear]:
    """The HF modules of training linear `source` (fused outputs split) holding its float32 master
    weight rounded to bfloat16 (round to nearest even), whatever its recipe and the run's compute
    dtype: the `bf16` layout's linears. (`export_linear` of a BF16 recipe on a float32-compute
    spec, whose W^T is the master itself.)"""
    master = dataclasses.replace(spec, dtype="float32")
    return export_linear(master, source, kernel_IxO, BF16, None)


def layout_linear(
    spec: LlamaSpec, source: str, kernel_IxO: np.ndarray, recipe: str, input_amax, layout: str
) -> list[ExportedLinear]:
    """The HF modules an export in `layout` stores for `source`: its master weight in BF16 for
    the `bf16` layout (`master_bf16_linear`), the FP8 stand-in of an MXFP8 linear in a layout
    without MXFP8 (`fp8_standin_linear`), else `export_linear` (quantized as trained)."""
    if layout == BF16_LAYOUT:
        return master_bf16_linear(spec, source, kernel_IxO)
    if stored_format(weight_format(recipe, source).fmt, layout) == "fp8":
        return fp8_standin_linear(spec, source, kernel_IxO, input_amax)
    return export_linear(spec, source, kernel_IxO, recipe, input_amax)


def fp8_standin_linear(
    spec: LlamaSpec, source: str, kernel_IxO: np.ndarray, input_amax
) -> list[ExportedLinear]:
    """The HF modules of MXFP8-trained linear `source` as FP8 per tensor (the ModelOpt layout
    has no MXFP8 a server loads, `eight_bit_formats`): its trained MXFP8 values re-quantized with
    one scale over the whole fused tensor (shared by q/k/v), each module carrying the error that
    adds (`ExportedLinear.standin_error`)."""
    w_t = compute_weight_t(kernel_IxO, spec.dtype)
    data, scale, error = fp8_of_mxfp8(w_t)
    amax = None if input_amax is None else float(input_amax)
    return [
        ExportedLinear(name, source, "fp8", packed=np.ascontiguousarray(data[rows]),
                       stored_decode_scale=scale, input_amax=amax, standin_error=error)
        for name, rows in _split_rows(hf_modules(spec, source))
    ]  # fmt: skip


def _export_one(spec, source, kernel_IxO, recipe, input_amax, expert) -> list[ExportedLinear]:
    wf = weight_format(recipe, source)
    w_t = compute_weight_t(kernel_IxO, spec.dtype)
    parts = _split_rows(hf_modules(spec, source, expert))
    if wf.fmt == BF16:
        w_bf16 = w_t.astype(ml_dtypes.bfloat16)
        return [ExportedLinear(n, source, BF16, weight=w_bf16[rows]) for n, rows in parts]
    packed, scales, weight_amax = _quantized_parts(w_t, wf, source)
    amax = None if input_amax is None else float(input_amax)
    return [
        ExportedLinear(
            name,
            source,
            wf.fmt,
            packed=np.ascontiguousarray(packed[rows]),
            scales=np.ascontiguousarray(scales[rows]),
            weight_amax=weight_amax,
            input_amax=amax,
            block_scale_rule=wf.block_scale_rule,
        )
        for name, rows in parts
    ]


def _placeholder(dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A read-only array of `dtype` and `shape` that takes no memory (for planning)."""
    return np.broadcast_to(np.zeros((), dtype), shape)


def planned_linear(
    spec: LlamaSpec, source: str, in_features: int, recipe: str, input_amax, layout: str = ""
) -> list[ExportedLinear]:
    """The HF modules `layout_linear` gives for `source` in `layout` (a quantized layout, or
    "" for `export_linear`'s), with placeholder data: right names, formats, dtypes and shapes,
    no values (what the layout and the weight files' headers need before any weight is read)."""
    if is_expert_linear(source):
        amax = _per_expert(input_amax, spec.num_experts)
        return [
            m
            for e in range(spec.num_experts)
            for m in _planned_one(spec, source, in_features, recipe, amax[e], e, layout)
        ]
    return _planned_one(spec, source, in_features, recipe, input_amax, None, layout)


def _planned_one(spec, source, in_features, recipe, input_amax, expert, layout):
    wf = weight_format(recipe, source)
    parts = hf_modules(spec, source, expert)
    amax = None if input_amax is None else float(input_amax)
    if layout and stored_format(wf.fmt, layout) == "fp8":
        return [ExportedLinear(n, source, "fp8", input_amax=amax, stored_decode_scale=np.float32(1),
                               packed=_placeholder(ml_dtypes.float8_e4m3fn, (r, in_features)))
                for n, r in parts]  # fmt: skip
    if wf.fmt == BF16:
        return [
            ExportedLinear(
                n, source, BF16, weight=_placeholder(ml_dtypes.bfloat16, (r, in_features))
            )
            for n, r in parts
        ]
    f = FORMATS[wf.fmt]
    scale_dtype = getattr(ml_dtypes, f.scale_dtype, None) or np.dtype(f.scale_dtype)
    packed_dtype = np.uint8 if f.elements_per_byte == 2 else ml_dtypes.float8_e4m3fn
    return [
        ExportedLinear(
            n,
            source,
            wf.fmt,
            packed=_placeholder(packed_dtype, (r, in_features // f.elements_per_byte)),
            scales=_placeholder(scale_dtype, (r, in_features // f.block_size)),
            weight_amax=np.float32(1.0),
            input_amax=amax,
            block_scale_rule=wf.block_scale_rule,
        )  # fmt: skip
        for n, r in parts
    ]


def dequantize_linear(m: ExportedLinear) -> np.ndarray:
    """float32 [out, in] values of an exported module (what a server computes with)."""
    if m.fmt == BF16:
        return m.weight.astype(np.float32)
    return FORMATS[m.fmt].dequantize(m)
