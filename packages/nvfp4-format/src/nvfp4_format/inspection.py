"""Checks the FP4-quantized linears of safetensors checkpoints for consistency and measures them.

`layout_detection.detect_quantized_modules` finds the linears and their layouts from the header
alone (the layouts, names and dtypes are tabled there); `inspect_module` reads one module's data:
the shapes and dtypes of its block scales, its global and input scales, and the statistics of its
codes and block scales (`block_statistics`). Everything returns frozen dataclasses.

Example:
    >>> from nvfp4_format.layout_detection import detect_quantized_modules
    >>> from nvfp4_format.safetensors_file import read_tensor
    >>> from nvfp4_format.safetensors_header import read_safetensors_header
    >>> header = read_safetensors_header("model.safetensors")  # doctest: +SKIP
    >>> q = detect_quantized_modules(header.tensors)[0]  # doctest: +SKIP
    >>> read = lambda name: read_tensor(header, name)  # doctest: +SKIP
    >>> inspect_module(q, header.tensors, read).problems  # doctest: +SKIP
    ()
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from nvfp4_format.block_statistics import (
    BlockScaleStats,
    CodeStats,
    array_chunks,
    block_scale_statistics,
    byte_counts,
    code_statistics_of_counts,
    scale_statistics_of_counts,
)
from nvfp4_format.layout_detection import E8M0_DTYPES, QuantizedModule
from nvfp4_format.layout_names import (
    LAYOUT_CT_MXFP4,
    LAYOUT_CT_NVFP4,
    LAYOUT_MODELOPT_NVFP4,
    LAYOUT_NAMES,
)
from nvfp4_format.safetensors_header import TensorInfo

__all__ = [
    "LAYOUT_CT_MXFP4",
    "LAYOUT_CT_NVFP4",
    "LAYOUT_MODELOPT_NVFP4",
    "QuantizedTensorReport",
    "inspect_module",
]

_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ")


@dataclass(frozen=True)
class QuantizedTensorReport:
    """Everything measured about one quantized linear.

    Attributes:
        module: module name.
        layout: one of the ``LAYOUT_*`` names.
        shape: logical weight shape [..., out, in].
        tensors: names of the tensors that make up the module.
        weight_bytes: stored bytes of the weight (codes + block scales + global scale).
        storage_bytes: stored bytes of all the module's tensors (adds the input scale).
        bf16_bytes: bytes of the same weight as BF16 (2 * elements).
        bits_per_element: 8 * weight_bytes / logical elements (NVFP4 ~4.5, MXFP4 ~4.25).
        block_scales: statistics of the block scales, None if missing or unreadable.
        global_decode_scale: weight decode scale (ModelOpt ``weight_scale_2``, or
            1 / compressed-tensors ``weight_global_scale``), None if absent.
        input_decode_scale: activation decode scale, None if absent.
        codes: statistics of the E2M1 codes.
        problems: consistency problems found (empty when the module is well formed).
    """

    module: str
    layout: str
    shape: tuple[int, ...]
    tensors: tuple[str, ...]
    weight_bytes: int
    storage_bytes: int
    bf16_bytes: int
    bits_per_element: float
    block_scales: BlockScaleStats | None
    global_decode_scale: float | None
    input_decode_scale: float | None
    codes: CodeStats
    problems: tuple[str, ...]


def _logical_shape(info: TensorInfo) -> tuple[int, ...]:
    if info.dtype == "F4" or not info.shape:
        return info.shape
    return info.shape[:-1] + (2 * info.shape[-1],)


def _scale_problems(q: QuantizedModule, shape: tuple[int, ...], info: TensorInfo) -> list[str]:
    mx = q.layout == LAYOUT_CT_MXFP4
    block = 32 if mx else 16
    allowed = E8M0_DTYPES if mx else ("F8_E4M3",)
    problems = []
    if info.dtype not in allowed:
        problems.append(
            f"block scales {q.block_scales} have dtype {info.dtype}, expected {allowed[0]}"
        )
    if not shape or shape[-1] % block:
        problems.append(
            f"in={shape[-1] if shape else None} is not a multiple of the block size {block}"
        )
    elif info.shape != shape[:-1] + (shape[-1] // block,):
        expected = list(shape[:-1] + (shape[-1] // block,))
        problems.append(
            f"block scales {q.block_scales} have shape {list(info.shape)}, expected "
            f"{expected} (in/{block}) for logical weight {list(shape)} (packed in/2)"
        )
    return problems


def _scalar_scale(
    name: str, info: TensorInfo, read: Callable[[str], np.ndarray], encode: bool
) -> tuple[float | None, list[str]]:
    """Reads a tensor-wide scale; returns (decode scale, problems)."""
    problems = []
    if info.dtype != "F32":
        problems.append(f"{name} has dtype {info.dtype}, expected F32")
    if info.numel != 1:
        problems.append(f"{name} has shape {list(info.shape)}, expected one element")
        return None, problems
    if info.dtype not in _FLOAT_DTYPES:
        return None, problems
    value = float(np.asarray(read(name), np.float32).reshape(-1)[0])
    if not (math.isfinite(value) and value > 0):
        problems.append(f"{name} = {value} is not a positive finite scale")
        return None, problems
    return (1.0 / value if encode else value), problems


def _block_scale_findings(
    q: QuantizedModule,
    tensors: Mapping[str, TensorInfo],
    shape: tuple[int, ...],
    read: Callable[[str], np.ndarray],
    chunks: Callable[[str], Iterable[np.ndarray]],
) -> tuple[BlockScaleStats | None, list[str]]:
    """Checks and measures the block scales; returns (their statistics or None, problems).

    No statistics when they are missing or stored in a dtype that is not a float (nor E8M0).
    """
    names = LAYOUT_NAMES[q.layout]
    if q.block_scales is None:
        return None, [f"missing block scales ({names.tensor(q.module, names.block_scales)})"]
    scale_info = tensors[q.block_scales]
    problems = _scale_problems(q, shape, scale_info)
    e8m0 = q.layout == LAYOUT_CT_MXFP4
    if not (e8m0 or scale_info.dtype in _FLOAT_DTYPES):
        return None, problems
    stored = read(q.block_scales)
    if stored.dtype.itemsize == 1:
        counts = byte_counts(chunks(q.block_scales))
        block_stats = scale_statistics_of_counts(counts, stored.dtype, e8m0)
    else:
        block_stats = block_scale_statistics(stored, e8m0=e8m0)
    if block_stats.nan_count:
        problems.append(f"{block_stats.nan_count} NaN block scales in {q.block_scales}")
    if block_stats.negative_count:
        problems.append(f"{block_stats.negative_count} negative block scales in {q.block_scales}")
    return block_stats, problems


def _tensor_scale_findings(
    q: QuantizedModule, tensors: Mapping[str, TensorInfo], read: Callable[[str], np.ndarray]
) -> tuple[float | None, float | None, list[str]]:
    """Reads the tensor-wide scales; returns (global decode scale, input decode scale, problems).

    A layout that names a global scale but lacks it is a problem; the input scale is optional.
    """
    names = LAYOUT_NAMES[q.layout]
    encode = names.scales_encode
    problems: list[str] = []
    global_decode = None
    if q.global_scale is not None:
        global_decode, found = _scalar_scale(q.global_scale, tensors[q.global_scale], read, encode)
        problems += found
    elif names.global_scale is not None:
        problems.append(f"missing global scale ({names.tensor(q.module, names.global_scale)})")
    input_decode = None
    if q.input_scale is not None:
        input_decode, found = _scalar_scale(q.input_scale, tensors[q.input_scale], read, encode)
        problems += found
    return global_decode, input_decode, problems


def inspect_module(
    q: QuantizedModule,
    tensors: Mapping[str, TensorInfo],
    read: Callable[[str], np.ndarray],
    read_bytes: Callable[[str], Iterable[np.ndarray]] | None = None,
) -> QuantizedTensorReport:
    """Checks one quantized linear for consistency and measures its codes and scales.

    Args:
        q: from `detect_quantized_modules`.
        tensors: tensor name -> `TensorInfo` (must contain ``q.tensor_names``).
        read: tensor name -> array (e.g. ``functools.partial(read_tensor, header)``).
        read_bytes: tensor name -> its stored bytes as uint8 chunks (e.g.
            ``functools.partial(read_tensor_bytes, header)``), used for the packed codes and the
            block scales so that memory stays bounded; default: the chunks of ``read(name)``.

    Returns:
        The `QuantizedTensorReport`; problems (wrong scale shape or dtype, NaN or negative
        scales, missing or non-positive global scale) are listed, never raised.
    """
    chunks = read_bytes or (lambda name: array_chunks(read(name)))
    shape = _logical_shape(tensors[q.packed])
    block_stats, problems = _block_scale_findings(q, tensors, shape, read, chunks)
    global_decode, input_decode, found = _tensor_scale_findings(q, tensors, read)
    problems += found
    codes = code_statistics_of_counts(byte_counts(chunks(q.packed)))
    weight_names = (q.packed, q.block_scales, q.global_scale)
    weight_bytes = sum(tensors[n].nbytes for n in weight_names if n is not None)
    numel = math.prod(shape)
    return QuantizedTensorReport(
        module=q.module,
        layout=q.layout,
        shape=shape,
        tensors=q.tensor_names,
        weight_bytes=weight_bytes,
        storage_bytes=sum(tensors[n].nbytes for n in q.tensor_names),
        bf16_bytes=2 * numel,
        bits_per_element=8 * weight_bytes / numel if numel else 0.0,
        block_scales=block_stats,
        global_decode_scale=global_decode,
        input_decode_scale=input_decode,
        codes=codes,
        problems=tuple(problems),
    )
