"""The 8-bit weight formats an export writes: MXFP8 (as trained by the `mxfp8` recipe) and FP8
per tensor (the stand-in for MXFP8 where a layout has no MXFP8), their tensor names, and how a
loaded export's 8-bit modules are found.

| layout | tensors of module `<m>` |
|---|---|
| compressed-tensors `mxfp8-quantized` | `<m>.weight` F8_E4M3 [out, in], `<m>.weight_scale` U8 E8M0 [out, in/32] |
| ModelOpt `FP8` (per tensor, static) | `<m>.weight` F8_E4M3 [out, in], `<m>.weight_scale` F32 [] DECODE = amax / 448, `<m>.input_scale` F32 [] = act_amax / 448 |

MXFP8 is the recipe's forward format (E4M3 elements in 1x32 blocks along the input, E8M0
scales by the "ceil" rule of nvfp4-ops, `nvfp4_format.quantize_mxfp8`): the compressed-tensors
layout holds it bit for bit (vLLM: `CompressedTensorsW8A8Mxfp8`, vllm/model_executor/layers/
quantization/compressed_tensors/schemes/compressed_tensors_w8a8_mxfp8.py). ModelOpt's
MIXED_PRECISION has no MXFP8 in vLLM (`ModelOptMixedPrecisionConfig.get_quant_method` builds
FP8, NVFP4 and W4A16_NVFP4 layers; another `quant_algo` is left unquantized, vllm/model_executor/
layers/quantization/modelopt.py), in SGLang (python/sglang/srt/layers/quantization/modelopt/
schemes/modelopt_mixed_precision.py: FP8 and NVFP4) or TensorRT-LLM (`QuantAlgo` has no MXFP8,
tensorrt_llm/quantization/mode.py): there an MXFP8 linear is stored as FP8 per tensor, its
trained MXFP8 values re-quantized with one scale (`fp8_of_mxfp8`), and the error that adds is
measured (`standin_error`) and printed.

Example:
    >>> w = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
    >>> data, scales, _ = quantize_mxfp8(w, None, "max")
    >>> data.dtype.name, scales.shape
    ('float8_e4m3fn', (2, 1))
"""

from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np

import nvfp4_format
from nvfp4_format.layout_detection import QuantizedModule
from nvfp4_format.layout_names import INPUT_SCALE, WEIGHT, WEIGHT_SCALE, LayoutNames
from nvfp4_format.safetensors_header import TensorInfo

MXFP8_SCALE_RULE = "ceil"
"""The block-exponent rule of training's MXFP8 recipe (nvfp4_ops.formats.MXFP8_SCALE_RULE)."""
E4M3_MAX = np.float32(448.0)
LAYOUT_CT_MXFP8 = "compressed-tensors-mxfp8"
LAYOUT_MODELOPT_FP8 = "modelopt-fp8"
CT_MXFP8 = LayoutNames(LAYOUT_CT_MXFP8, WEIGHT, WEIGHT_SCALE, None, None, True, (1,))
"""compressed-tensors MXFP8: the E4M3 weight under `weight`, E8M0 block scales; no global or
input scale (activations are quantized per block at run time)."""
MODELOPT_FP8 = LayoutNames(LAYOUT_MODELOPT_FP8, WEIGHT, None, WEIGHT_SCALE, INPUT_SCALE, False, ())
"""ModelOpt FP8: the E4M3 weight under `weight`, no block scales, the per-tensor DECODE scale
under `weight_scale` and the static input DECODE scale under `input_scale`."""

Quantized = tuple[np.ndarray, np.ndarray | None, np.float32 | None]


def quantize_mxfp8(w_t: np.ndarray, block_shape, block_scale_rule: str) -> Quantized:
    """(E4M3 elements [out, in], E8M0 scale bytes [out, in/32], None) of W^T as training's
    MXFP8 recipe quantizes its forward weight."""
    if block_scale_rule != "max":
        raise ValueError(f"MXFP8 has no block_scale_rule {block_scale_rule!r}")
    q = nvfp4_format.quantize_mxfp8(w_t, MXFP8_SCALE_RULE)
    return np.asarray(q.data), np.asarray(q.scales), None


def dequantize_mxfp8(data: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [out, in] of MXFP8 elements and scale bytes."""
    a = nvfp4_format.MXFP8Array(data, scales, tuple(data.shape), MXFP8_SCALE_RULE)
    return nvfp4_format.dequantize_mxfp8(a)


def mxfp8_input(x_NxK: np.ndarray, amax) -> np.ndarray:
    """x quantized to MXFP8 and back (1x32 blocks, the recipe's rule), as training's forward."""
    q = nvfp4_format.quantize_mxfp8(np.asarray(x_NxK, np.float32), MXFP8_SCALE_RULE)
    return nvfp4_format.dequantize_mxfp8(q)


def fp8_decode_scale(amax) -> np.float32:
    """The FP8 per-tensor DECODE scale amax / 448 (1.0 for a zero or non-finite amax)."""
    amax = np.float32(amax)
    if not (np.isfinite(amax) and amax > 0):
        return np.float32(1.0)
    return np.float32(amax / E4M3_MAX)


def quantize_fp8(w_t: np.ndarray, decode_scale: np.float32) -> np.ndarray:
    """E4M3 elements of `w_t / decode_scale`, clipped to +-448 (round to nearest even)."""
    scaled = np.clip(np.asarray(w_t, np.float32) / np.float32(decode_scale), -E4M3_MAX, E4M3_MAX)
    return scaled.astype(ml_dtypes.float8_e4m3fn)


def quantize_fp8_tensor(w_t: np.ndarray) -> Quantized:
    """(E4M3 [out, in], None, amax): `w_t` in FP8 with one scale amax / 448."""
    amax = np.float32(np.max(np.abs(w_t))) if w_t.size else np.float32(0)
    return quantize_fp8(w_t, fp8_decode_scale(amax)), None, amax


def fp8_input(x_NxK: np.ndarray, amax) -> np.ndarray:
    """x quantized to FP8 per tensor and back, with the fixed `amax` (static input scale) or,
    when None, its own."""
    x = np.asarray(x_NxK, np.float32)
    scale = fp8_decode_scale(np.max(np.abs(x)) if amax is None and x.size else amax or 0.0)
    return quantize_fp8(x, scale).astype(np.float32) * scale


def fp8_of_mxfp8(w_t: np.ndarray) -> tuple[np.ndarray, np.float32, float]:
    """The FP8 per-tensor stand-in of an MXFP8-trained weight: (E4M3 [out, in], its decode
    scale, the added error). W^T is quantized to MXFP8 as training did, those values are
    re-quantized with one scale amax / 448, and the error is max |FP8 - MXFP8| / max |MXFP8|."""
    data, scales, _ = quantize_mxfp8(w_t, None, "max")
    trained = dequantize_mxfp8(data, scales)
    scale = fp8_decode_scale(np.max(np.abs(trained)) if trained.size else 0.0)
    fp8 = quantize_fp8(trained, scale)
    return fp8, scale, standin_error(fp8.astype(np.float32) * scale, trained)


def standin_error(stored: np.ndarray, trained: np.ndarray) -> float:
    """max |stored - trained| / max |trained| (0 for an all-zero weight)."""
    top = float(np.max(np.abs(trained))) if trained.size else 0.0
    return float(np.max(np.abs(stored - trained))) / top if top > 0 else 0.0


def detect_eight_bit_modules(tensors: Mapping[str, TensorInfo]) -> tuple[QuantizedModule, ...]:
    """The 8-bit modules among a loaded export's tensors: a `<m>.weight` of dtype F8_E4M3 with
    a U8 `weight_scale` [out, in/32] (compressed-tensors MXFP8) or a scalar F32 `weight_scale`
    (ModelOpt FP8, with its `input_scale` when present)."""
    found = []
    for name, info in tensors.items():
        if info.dtype != "F8_E4M3" or not name.endswith("." + WEIGHT):
            continue
        module = name.removesuffix("." + WEIGHT)
        scale = tensors.get(f"{module}.{WEIGHT_SCALE}")
        if scale is None:
            continue
        if scale.dtype == "U8":
            found.append(QuantizedModule(module, LAYOUT_CT_MXFP8, name, scale.name, None, None))
        else:
            inp = f"{module}.{INPUT_SCALE}"
            found.append(QuantizedModule(module, LAYOUT_MODELOPT_FP8, name, None, scale.name,
                                         inp if inp in tensors else None))  # fmt: skip
    return tuple(found)
