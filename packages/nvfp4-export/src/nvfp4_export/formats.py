"""The quantized weight formats an export writes: one `ExportFormat` per format, in `FORMATS`.

Everything that differs between NVFP4 and MXFP4 (how a weight is quantized and dequantized, how
a linear's input is quantized, block size and scale dtype, the HF layouts that hold it and their
tensor names from `nvfp4_format.layout_names`, the compressed-tensors scheme, the ModelOpt
`quant_algo`, the ONNX scale table) is an entry of this table, and the other modules look it up
instead of branching on the format's name. Adding a format means one entry here (and the
training recipes that produce it in `policy.RECIPE_WEIGHT_FORMATS`). "bf16" (`BF16`) is not a
format of this table: it means "not quantized". The 8-bit formats (MXFP8 as trained, FP8 per
tensor as its stand-in where a layout lacks MXFP8) are `eight_bit_formats`'; an export holds one
FP4 format, possibly with 8-bit linears beside it (`MIXED`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType

import ml_dtypes
import numpy as np

import nvfp4_export.eight_bit_formats as eight_bit
import nvfp4_format
from nvfp4_export.errors import ExportError
from nvfp4_export.exported_linear import ExportedLinear
from nvfp4_format.layout_names import CT_MXFP4, CT_NVFP4, MODELOPT_NVFP4, LayoutNames

BF16 = "bf16"
"""The "format" of a linear kept in BF16 (not quantized)."""
MODELOPT = "modelopt"
COMPRESSED_TENSORS = "compressed-tensors"
BF16_LAYOUT = "bf16"
"""The unquantized layout: every linear's float32 master weight rounded to bfloat16."""
LAYOUTS = (MODELOPT, COMPRESSED_TENSORS, BF16_LAYOUT)
"""The Hugging Face layouts (`export_hf(layout=...)`)."""
MIXED = "mixed"
"""The `LayoutPlan.fmt` of an export whose quantized linears have several formats."""
MXFP4_SCALE_RULE = "ocp"
"""The rule training's MXFP4 recipe uses (X = 2^(floor(log2 amax_block) - 2))."""

Quantized = tuple[np.ndarray, np.ndarray, np.float32 | None]
"""(packed uint8 [out, in/2], block scales [out, in/block], weight amax or None)."""


@dataclasses.dataclass(frozen=True)
class ExportFormat:
    """What the export needs to know about one quantized weight format.

    Attributes:
        name: the format's name in recipes, plans and provenance ("nvfp4").
        label: its name in messages ("NVFP4").
        block_size: elements per block scale along a linear's input.
        scale_dtype: NumPy dtype name of the stored block scales.
        global_scale: a per-tensor global scale is stored next to the block scales.
        calibrated_input: W4A4 quantizes a linear's input with a calibrated per-tensor amax
            (the exported input scale), so W4A4 needs activation amax; False: the input is
            scaled per block at run time and needs none.
        layouts: HF layout ("modelopt", "compressed-tensors") -> its tensor names.
        ct_args: compressed-tensors quantization args of the weights (without "dynamic").
        ct_format: the compressed-tensors `format`.
        ct_input_dynamic: compressed-tensors `dynamic` of the input activations (W4A4).
        modelopt_algos: ModelOpt `quant_algo` (W4A4, weight-only), None without that layout.
        onnx_dq: the ONNX "dq" form (opset 23 DequantizeLinear) can hold it.
        nan_scale_byte: a block-scale byte that means NaN (E8M0 255), None if none.
        quantize: (W^T float32 [out, in], NVFP4 block shape or None, block scale rule "max" or
            NVFP4's "4over6") -> `Quantized`.
        dequantize: `ExportedLinear` -> float32 [out, in].
        quantize_input: (x float32 [N, K], fixed amax or None) -> x quantized and dequantized.
        scale_values: () -> float32 [256], the value of each block-scale byte.
        standins: HF layout -> the format written instead in a layout that lacks this one
            (MXFP8 -> FP8 per tensor in ModelOpt).
        elements_per_byte: 2 for the packed FP4 formats, 1 for the 8-bit ones.
    """

    name: str
    label: str
    block_size: int
    scale_dtype: str
    global_scale: bool
    calibrated_input: bool
    layouts: Mapping[str, LayoutNames]
    ct_args: Mapping[str, object]
    ct_format: str
    ct_input_dynamic: object
    modelopt_algos: tuple[str, str] | None
    onnx_dq: bool
    nan_scale_byte: int | None
    quantize: Callable[[np.ndarray, tuple[int, int] | None, str], Quantized]
    dequantize: Callable[[ExportedLinear], np.ndarray]
    quantize_input: Callable[[np.ndarray, np.float32 | None], np.ndarray]
    scale_values: Callable[[], np.ndarray]
    standins: Mapping[str, str] = dataclasses.field(default_factory=dict)
    elements_per_byte: int = 2


def _quantize_nvfp4(
    w_t: np.ndarray, block_shape: tuple[int, int] | None, block_scale_rule: str
) -> Quantized:
    amax = np.float32(np.max(np.abs(w_t))) if w_t.size else np.float32(0)
    q = nvfp4_format.quantize(w_t, block_shape, global_amax=amax, block_scale_rule=block_scale_rule)
    return q.packed, q.block_scales, amax


def _quantize_mxfp4(
    w_t: np.ndarray, block_shape: tuple[int, int] | None, block_scale_rule: str
) -> Quantized:
    if block_scale_rule != "max":
        raise ValueError(f"MXFP4 has no block_scale_rule {block_scale_rule!r}")
    q = nvfp4_format.quantize_mxfp4(w_t, MXFP4_SCALE_RULE)
    return q.packed, q.scales, None


def _dequantize_nvfp4(m: ExportedLinear) -> np.ndarray:
    a = nvfp4_format.NVFP4Array(m.packed, m.scales, m.global_decode_scale, m.shape)
    return nvfp4_format.dequantize(a)


def _dequantize_mxfp4(m: ExportedLinear) -> np.ndarray:
    a = nvfp4_format.MXFP4Array(m.packed, m.scales, m.shape, MXFP4_SCALE_RULE)
    return nvfp4_format.dequantize_mxfp4(a)


def _nvfp4_input(x_NxK: np.ndarray, amax: np.float32 | None) -> np.ndarray:
    return nvfp4_format.dequantize(nvfp4_format.quantize(x_NxK, (1, 16), global_amax=amax))


def _mxfp4_input(x_NxK: np.ndarray, amax: np.float32 | None) -> np.ndarray:
    return nvfp4_format.dequantize_mxfp4(nvfp4_format.quantize_mxfp4(x_NxK, MXFP4_SCALE_RULE))


def _e4m3_values() -> np.ndarray:
    return np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _e8m0_values() -> np.ndarray:
    with np.errstate(over="ignore"):  # byte 255 (2^128) overflows; it is NaN anyway
        table = np.ldexp(np.float32(1.0), np.arange(256) - 127).astype(np.float32)
    table[255] = np.nan
    return table


def _ct_args(strategy: str, group_size: int, bits: int = 4) -> Mapping[str, object]:
    args = {"num_bits": bits, "type": "float", "symmetric": True, "strategy": strategy}
    return MappingProxyType(args | {"group_size": group_size, "observer": "minmax"})


NVFP4 = ExportFormat(
    name="nvfp4", label="NVFP4", block_size=16, scale_dtype="float8_e4m3fn", global_scale=True,
    calibrated_input=True,
    layouts=MappingProxyType({MODELOPT: MODELOPT_NVFP4, COMPRESSED_TENSORS: CT_NVFP4}),
    ct_args=_ct_args("tensor_group", 16), ct_format="nvfp4-pack-quantized",
    ct_input_dynamic="local", modelopt_algos=("NVFP4", "W4A16_NVFP4"), onnx_dq=True,
    nan_scale_byte=None, quantize=_quantize_nvfp4, dequantize=_dequantize_nvfp4,
    quantize_input=_nvfp4_input, scale_values=_e4m3_values,
)  # fmt: skip
MXFP4 = ExportFormat(
    name="mxfp4", label="MXFP4", block_size=32, scale_dtype="uint8", global_scale=False,
    calibrated_input=False, layouts=MappingProxyType({COMPRESSED_TENSORS: CT_MXFP4}),
    ct_args=_ct_args("group", 32), ct_format="mxfp4-pack-quantized", ct_input_dynamic=True,
    modelopt_algos=None, onnx_dq=False, nan_scale_byte=255, quantize=_quantize_mxfp4,
    dequantize=_dequantize_mxfp4, quantize_input=_mxfp4_input, scale_values=_e8m0_values,
)  # fmt: skip

MXFP8 = ExportFormat(
    name="mxfp8", label="MXFP8", block_size=32, scale_dtype="uint8", global_scale=False,
    calibrated_input=False, layouts=MappingProxyType({COMPRESSED_TENSORS: eight_bit.CT_MXFP8}),
    ct_args=_ct_args("group", 32, bits=8), ct_format="mxfp8-quantized", ct_input_dynamic=True,
    modelopt_algos=None, onnx_dq=False, nan_scale_byte=255, quantize=eight_bit.quantize_mxfp8,
    dequantize=lambda m: eight_bit.dequantize_mxfp8(m.packed, m.scales),
    quantize_input=eight_bit.mxfp8_input, scale_values=_e8m0_values,
    standins=MappingProxyType({MODELOPT: "fp8"}), elements_per_byte=1,
)  # fmt: skip
FP8 = ExportFormat(
    name="fp8", label="FP8 (per tensor)", block_size=0, scale_dtype="float32", global_scale=True,
    calibrated_input=True, layouts=MappingProxyType({MODELOPT: eight_bit.MODELOPT_FP8}),
    ct_args=MappingProxyType({"num_bits": 8, "type": "float"}), ct_format="",
    ct_input_dynamic=False, modelopt_algos=("FP8", "FP8"), onnx_dq=False, nan_scale_byte=None,
    quantize=lambda w_t, block_shape, rule: eight_bit.quantize_fp8_tensor(w_t),
    dequantize=lambda m: m.packed.astype(np.float32) * m.global_decode_scale,
    quantize_input=eight_bit.fp8_input, scale_values=_e4m3_values, elements_per_byte=1,
)  # fmt: skip
"""FP8 per tensor: no recipe trains it; it stands in for MXFP8 in the ModelOpt layout."""

FORMATS: Mapping[str, ExportFormat] = MappingProxyType(
    {f.name: f for f in (NVFP4, MXFP4, MXFP8, FP8)}
)
FP4_FORMATS = (NVFP4.name, MXFP4.name)
"""The packed 4-bit formats: one export holds at most one of them."""
"""Format name -> `ExportFormat`: every quantized format the export writes."""

FORMAT_OF_LAYOUT: Mapping[str, str] = MappingProxyType(
    {names.layout: f.name for f in FORMATS.values() for names in f.layouts.values()}
)
"""`nvfp4_format.layout_detection` layout name ("modelopt-nvfp4", ...) -> format name."""


LAYOUT_NAMES: Mapping[str, LayoutNames] = MappingProxyType(
    {names.layout: names for f in FORMATS.values() for names in f.layouts.values()}
)
"""Layout name ("modelopt-nvfp4", "modelopt-fp8", ...) -> its tensor names."""


def stored_format(fmt: str, layout: str) -> str:
    """The format a linear trained in `fmt` is stored with in `layout`: its stand-in there
    (MXFP8 -> "fp8" in ModelOpt), "bf16" for every linear of `BF16_LAYOUT`, else `fmt` itself
    (`layouts.plan_layout` refuses a format its layout cannot hold).

    Example:
        >>> stored_format("mxfp8", "modelopt"), stored_format("mxfp8", "compressed-tensors")
        ('fp8', 'mxfp8')
    """
    if layout == BF16_LAYOUT or fmt == BF16:
        return BF16
    return FORMATS[fmt].standins.get(layout, fmt)


def layout_names(fmt: str, layout: str) -> LayoutNames:
    """The tensor names of format `fmt` in HF layout `layout`.

    Raises:
        ExportError: `fmt` is not written in `layout`.
    """
    f = FORMATS.get(fmt)
    if f is None or layout not in f.layouts:
        held = sorted(f.layouts) if f is not None else []
        raise ExportError(f"format {fmt!r} is written in the layouts {held}, got {layout!r}")
    return f.layouts[layout]


def calibrated_input(fmt: str) -> bool:
    """Format `fmt` (a format name or "bf16") takes fixed input scales from activation amax."""
    f = FORMATS.get(fmt)
    return f is not None and f.calibrated_input


def stored_recipes(layout: str, recipes: Mapping[str, str]) -> dict[str, str]:
    """The recipe each linear's tensors are stored with in `layout`: the trained one (`recipes`,
    the manifest's), or "bf16" for every linear in the unquantized `BF16_LAYOUT`.

    Example:
        >>> stored_recipes("bf16", {"layers.0.attn.qkv": "nvfp4"})
        {'layers.0.attn.qkv': 'bf16'}
    """
    if layout == BF16_LAYOUT:
        return dict.fromkeys(recipes, BF16)
    return dict(recipes)
