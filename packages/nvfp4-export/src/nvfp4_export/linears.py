"""Quantize each trained linear exactly as its forward pass did, then split fused outputs for HF.

Training computes a quantized linear as x @ Q(W) with W = float32 master kernel [in, out] cast to
the compute dtype, and Q quantizing W^T [out, in] along `in` with the recipe's block shape (16x16
tiles for the paper's recipe) and ONE global amax over the whole fused tensor (q|k|v, gate|up).
Doing the same here (through `nvfp4_format`) reproduces the model's codes and scales bit for bit;
splitting rows afterwards keeps them (block scales are stored per row, a 16x16 tile's scale repeated
over its rows) and the shared global scale is what servers require for fused q/k/v and gate/up.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from nvfp4_export.bfloat16 import bfloat16_values_transposed, transposed
from nvfp4_export.errors import ExportError
from nvfp4_export.exported_linear import ExportedLinear
from nvfp4_export.formats import BF16, FORMATS
from nvfp4_export.model_spec import LlamaSpec
from nvfp4_export.policy import WeightFormat, weight_format

_NP_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def hf_modules(spec: LlamaSpec, source: str) -> list[tuple[str, int]]:
    """(HF module name, output rows) in the order the fused output of `source` holds them."""
    prefix, kind = source.split(".", 2)[:2], source.split(".", 2)[2]
    base = f"model.{prefix[0]}.{prefix[1]}."
    q, k, v = spec.qkv_split
    table = {
        "attn.qkv": [("self_attn.q_proj", q), ("self_attn.k_proj", k), ("self_attn.v_proj", v)],
        "attn.o": [("self_attn.o_proj", spec.d_model)],
        "mlp.gate_up": [("mlp.gate_proj", spec.mlp_dim), ("mlp.up_proj", spec.mlp_dim)],
        "mlp.down": [("mlp.down_proj", spec.d_model)],
    }
    return [(base + name, rows) for name, rows in table[kind]]


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


def export_linear(
    spec: LlamaSpec, source: str, kernel_IxO: np.ndarray, recipe: str, input_amax: float | None
) -> list[ExportedLinear]:
    """The HF modules of training linear `source` (fused outputs split), quantized per `recipe`.

    Example:
        >>> spec = LlamaSpec(vocab_size=32, d_model=32, num_layers=1, num_heads=2,
        ...                  num_kv_heads=1, head_dim=16, mlp_dim=32)
        >>> k = np.random.default_rng(0).normal(size=(32, 64)).astype(np.float32)
        >>> [m.packed.shape for m in export_linear(spec, "layers.0.attn.qkv", k, "nvfp4", None)]
        [(32, 16), (16, 16), (16, 16)]
    """
    wf = weight_format(recipe, source)
    w_t = compute_weight_t(kernel_IxO, spec.dtype)
    parts = _split_rows(hf_modules(spec, source))
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
    spec: LlamaSpec, source: str, in_features: int, recipe: str, input_amax: float | None
) -> list[ExportedLinear]:
    """The HF modules `export_linear` gives for `source`, with placeholder data: right names,
    formats, dtypes and shapes, no values (what the layout and the weight files' headers need
    before any weight is read)."""
    wf = weight_format(recipe, source)
    parts = hf_modules(spec, source)
    if wf.fmt == BF16:
        return [
            ExportedLinear(
                n, source, BF16, weight=_placeholder(ml_dtypes.bfloat16, (r, in_features))
            )
            for n, r in parts
        ]
    f = FORMATS[wf.fmt]
    scale_dtype = getattr(ml_dtypes, f.scale_dtype, None) or np.dtype(f.scale_dtype)
    amax = None if input_amax is None else float(input_amax)
    return [
        ExportedLinear(
            n,
            source,
            wf.fmt,
            packed=_placeholder(np.uint8, (r, in_features // 2)),
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
