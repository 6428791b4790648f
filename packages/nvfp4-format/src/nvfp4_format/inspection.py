"""Finds FP4-quantized linears in safetensors checkpoints and measures them.

Three on-disk layouts are recognised (names and dtypes from ``docs/spec/export-formats.md``; the
names are spelled once, in `layout_names`):

| layout | tensors of module ``<m>`` |
|---|---|
| ``modelopt-nvfp4`` | ``<m>.weight`` U8 [out, in/2], ``<m>.weight_scale`` F8_E4M3 [out, in/16], ``<m>.weight_scale_2`` F32 [] decode scale, optional ``<m>.input_scale`` F32 [] |
| ``compressed-tensors-nvfp4`` | ``<m>.weight_packed`` U8 [out, in/2], ``<m>.weight_scale`` F8_E4M3 [out, in/16], ``<m>.weight_global_scale`` F32 [1] ENCODE scale, optional ``<m>.input_global_scale`` |
| ``compressed-tensors-mxfp4`` | ``<m>.weight_packed`` U8 [out, in/2], ``<m>.weight_scale`` U8 E8M0 [out, in/32], no global scale |

Packed weights tagged ``F4`` (logical shape [out, in]) are accepted in place of U8. Detection
(`detect_quantized_modules`) looks at names, dtypes and shapes only; the statistics
(`code_statistics`, `block_scale_statistics`, `inspect_module`) read the data. Everything
returns frozen dataclasses.

Example:
    >>> from nvfp4_format.safetensors_file import read_safetensors_header
    >>> header = read_safetensors_header("model.safetensors")  # doctest: +SKIP
    >>> [m.module for m in detect_quantized_modules(header.tensors)]  # doctest: +SKIP
    ['model.layers.0.mlp.down_proj', ...]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from nvfp4_format.layout_names import (
    CT_MXFP4,
    CT_NVFP4,
    LAYOUT_CT_MXFP4,
    LAYOUT_CT_NVFP4,
    LAYOUT_MODELOPT_NVFP4,
    LAYOUT_NAMES,
    MODELOPT_NVFP4,
)
from nvfp4_format.safetensors_file import TensorInfo

__all__ = [
    "LAYOUT_CT_MXFP4",
    "LAYOUT_CT_NVFP4",
    "LAYOUT_MODELOPT_NVFP4",
    "BlockScaleStats",
    "CodeStats",
    "QuantizedModule",
    "QuantizedTensorReport",
    "block_scale_statistics",
    "code_statistics",
    "detect_quantized_modules",
    "inspect_module",
]

_PACKED_DTYPES = ("U8", "F4")
_E8M0_DTYPES = ("U8", "F8_E8M0")
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ")
_CHUNK_BYTES = 1 << 16  # cache-sized chunks: bounded memory, ~8x faster than 16 MiB ones


@dataclass(frozen=True)
class QuantizedModule:
    """Which tensors make up one FP4-quantized linear (found from the header alone).

    Attributes:
        module: module name, e.g. ``model.layers.0.mlp.down_proj``.
        layout: one of the ``LAYOUT_*`` names.
        packed: name of the packed E2M1 codes tensor.
        block_scales: name of the block-scale tensor, None when missing.
        global_scale: name of the weight global scale tensor (ModelOpt: decode scale,
            compressed-tensors: encode scale); None when missing or not part of the layout.
        input_scale: name of the activation scale tensor, None when absent.
    """

    module: str
    layout: str
    packed: str
    block_scales: str | None
    global_scale: str | None
    input_scale: str | None

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """All tensors that belong to this module."""
        names = (self.packed, self.block_scales, self.global_scale, self.input_scale)
        return tuple(n for n in names if n is not None)


@dataclass(frozen=True)
class CodeStats:
    """Statistics of packed E2M1 codes.

    Attributes:
        count: number of 4-bit codes.
        zero_fraction: fraction of codes 0 or 8 (+0, -0).
        saturated_fraction: fraction of codes 7 or 15 (+6, -6).
        histogram: count of each code 0..15.
    """

    count: int
    zero_fraction: float
    saturated_fraction: float
    histogram: tuple[int, ...]


@dataclass(frozen=True)
class BlockScaleStats:
    """Statistics of block scales (decoded to float).

    Attributes:
        count: number of block scales.
        min_nonzero: smallest nonzero finite |scale|, None if there is none.
        max: largest finite scale, None if there is none.
        zero_fraction: fraction of scales equal to zero (E8M0 has no zero: always 0).
        nan_count: number of NaN scales.
        negative_count: number of scales below zero.
    """

    count: int
    min_nonzero: float | None
    max: float | None
    zero_fraction: float
    nan_count: int
    negative_count: int


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


def _present(tensors: Mapping[str, TensorInfo], name: str) -> str | None:
    return name if name in tensors else None


def _modelopt_module(m: str, tensors: Mapping[str, TensorInfo]) -> QuantizedModule | None:
    names = MODELOPT_NVFP4
    scale, scale_2 = names.tensor(m, names.block_scales), names.tensor(m, names.global_scale)
    if scale not in tensors and scale_2 not in tensors:
        return None
    return QuantizedModule(
        m,
        names.layout,
        names.tensor(m, names.packed),
        _present(tensors, scale),
        _present(tensors, scale_2),
        _present(tensors, names.tensor(m, names.input_scale)),
    )


def _compressed_tensors_module(m: str, tensors: Mapping[str, TensorInfo]) -> QuantizedModule:
    names = CT_NVFP4
    scale = _present(tensors, names.tensor(m, names.block_scales))
    global_scale = _present(tensors, names.tensor(m, names.global_scale))
    input_scale = _present(tensors, names.tensor(m, names.input_scale))
    is_mx = global_scale is None and scale is not None and tensors[scale].dtype in _E8M0_DTYPES
    layout = CT_MXFP4.layout if is_mx else names.layout
    return QuantizedModule(
        m, layout, names.tensor(m, names.packed), scale, global_scale, input_scale
    )


def detect_quantized_modules(
    tensors: Mapping[str, TensorInfo],
) -> tuple[QuantizedModule, ...]:
    """Finds the FP4-quantized linears among a checkpoint's tensors.

    A ``<m>.weight_packed`` tensor of dtype U8 (or F4) starts a compressed-tensors module
    (MXFP4 when it has no global scale and E8M0 block scales, NVFP4 otherwise); a
    ``<m>.weight`` of dtype U8 (or F4) with a ``weight_scale`` or ``weight_scale_2`` sibling
    starts a ModelOpt module. Anything else is not quantized (e.g. compressed-tensors INT4
    ``weight_packed`` is I32 and is left alone).

    Args:
        tensors: tensor name -> `TensorInfo` (one file's header, or all shards merged).

    Returns:
        The modules found, sorted by module name.
    """
    ct_packed, modelopt_packed = "." + CT_NVFP4.packed, "." + MODELOPT_NVFP4.packed
    found = []
    for name, info in tensors.items():
        if info.dtype not in _PACKED_DTYPES:
            continue
        if name.endswith(ct_packed):
            found.append(_compressed_tensors_module(name.removesuffix(ct_packed), tensors))
        elif name.endswith(modelopt_packed):
            module = _modelopt_module(name.removesuffix(modelopt_packed), tensors)
            if module is not None:
                found.append(module)
    return tuple(sorted(found, key=lambda m: m.module))


def byte_counts(chunks: Iterable[np.ndarray]) -> np.ndarray:
    """int64 [256]: how often each byte value occurs in the uint8 `chunks`, a chunk at a time."""
    counts = np.zeros(256, np.int64)
    for chunk in chunks:
        flat = np.asarray(chunk).view(np.uint8).reshape(-1)
        for start in range(0, flat.size, _CHUNK_BYTES):
            counts += np.bincount(flat[start : start + _CHUNK_BYTES], minlength=256)
    return counts


def _array_chunks(array: np.ndarray) -> Iterator[np.ndarray]:
    yield np.asarray(array).reshape(-1)


def code_statistics(packed: np.ndarray) -> CodeStats:
    """Counts zero and saturated E2M1 codes in packed bytes (two codes per byte).

    Args:
        packed: uint8 array of any shape, two 4-bit codes per byte.

    Returns:
        `CodeStats`; fractions are 0.0 for an empty array.

    Raises:
        TypeError: ``packed`` is not uint8.
    """
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise TypeError(f"packed must be uint8, got dtype {packed.dtype}")
    return code_statistics_of_counts(byte_counts(_array_chunks(packed)))


def code_statistics_of_counts(counts: np.ndarray) -> CodeStats:
    """`CodeStats` of packed bytes given as a 256-entry count of each byte value."""
    byte_values = np.arange(256)
    histogram = np.bincount(byte_values & 0xF, weights=counts, minlength=16)
    histogram += np.bincount(byte_values >> 4, weights=counts, minlength=16)
    histogram = histogram.astype(np.int64)
    count = 2 * int(counts.sum())
    zero = int(histogram[0] + histogram[8])
    saturated = int(histogram[7] + histogram[15])
    return CodeStats(
        count=count,
        zero_fraction=zero / count if count else 0.0,
        saturated_fraction=saturated / count if count else 0.0,
        histogram=tuple(int(h) for h in histogram),
    )


def _decode_scales(scales: np.ndarray, e8m0: bool) -> np.ndarray:
    if e8m0:
        exponents = scales.view(np.uint8)
        is_nan = exponents == 255
        values = np.exp2(np.where(is_nan, 127, exponents).astype(np.float32) - 127)
        return np.where(is_nan, np.float32(np.nan), values)
    return scales.astype(np.float32)


def scale_statistics_of_counts(counts: np.ndarray, dtype, e8m0: bool) -> BlockScaleStats:
    """`BlockScaleStats` of one-byte scales given as a 256-entry count of each byte value."""
    codes = np.arange(256, dtype=np.uint8)
    decoded = _decode_scales(codes if e8m0 else codes.view(dtype), e8m0).astype(np.float32)
    return _stats(decoded[counts > 0], counts[counts > 0])


def _float_chunks(values: np.ndarray):
    flat = values.reshape(-1)
    step = max(1, _CHUNK_BYTES // max(1, flat.itemsize))
    for start in range(0, flat.size, step):
        yield flat[start : start + step].astype(np.float32)


def block_scale_statistics(scales: np.ndarray, *, e8m0: bool = False) -> BlockScaleStats:
    """Range, zero fraction and NaN count of block scales, in bounded memory.

    One-byte scales (E4M3, E8M0) are counted by byte value in cache-sized chunks and each of the
    256 values is decoded once, so a multi-gigabyte tensor (memory-mapped) never becomes a float
    copy; wider float scales are read chunk by chunk.

    Args:
        scales: block scales: a float array (float8_e4m3fn for NVFP4), or, with ``e8m0=True``,
            E8M0 exponent bytes (uint8 or float8_e8m0fnu; value 2**(byte - 127), 255 = NaN).
        e8m0: interpret ``scales`` as E8M0 exponent bytes.

    Returns:
        `BlockScaleStats` of the decoded values.
    """
    scales = np.asarray(scales)
    if scales.dtype.itemsize == 1:
        return scale_statistics_of_counts(byte_counts(_array_chunks(scales)), scales.dtype, e8m0)
    parts = [_stats(c, np.ones(c.size, np.int64)) for c in _float_chunks(scales)]
    return _combine(parts) if parts else _stats(np.zeros(0, np.float32), np.zeros(0, np.int64))


def _stats(values: np.ndarray, counts: np.ndarray) -> BlockScaleStats:
    """`BlockScaleStats` of decoded `values` occurring `counts` times each."""
    total = int(counts.sum())
    finite = np.isfinite(values)
    magnitudes = np.abs(values[finite & (values != 0)])
    return BlockScaleStats(
        count=total,
        min_nonzero=float(magnitudes.min()) if magnitudes.size else None,
        max=float(values[finite].max()) if finite.any() else None,
        zero_fraction=float(counts[values == 0].sum()) / total if total else 0.0,
        nan_count=int(counts[np.isnan(values)].sum()),
        negative_count=int(counts[values < 0].sum()),
    )


def _combine(parts: list[BlockScaleStats]) -> BlockScaleStats:
    """The statistics of the concatenation of the chunks `parts` describe."""
    total = sum(p.count for p in parts)
    lows = [p.min_nonzero for p in parts if p.min_nonzero is not None]
    highs = [p.max for p in parts if p.max is not None]
    zeros = sum(p.zero_fraction * p.count for p in parts)
    return BlockScaleStats(
        count=total,
        min_nonzero=min(lows) if lows else None,
        max=max(highs) if highs else None,
        zero_fraction=float(round(zeros)) / total if total else 0.0,
        nan_count=sum(p.nan_count for p in parts),
        negative_count=sum(p.negative_count for p in parts),
    )


def _logical_shape(info: TensorInfo) -> tuple[int, ...]:
    if info.dtype == "F4" or not info.shape:
        return info.shape
    return info.shape[:-1] + (2 * info.shape[-1],)


def _scale_problems(q: QuantizedModule, shape: tuple[int, ...], info: TensorInfo) -> list[str]:
    mx = q.layout == LAYOUT_CT_MXFP4
    block = 32 if mx else 16
    allowed = _E8M0_DTYPES if mx else ("F8_E4M3",)
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
    chunks = read_bytes or (lambda name: _array_chunks(read(name)))
    packed = tensors[q.packed]
    shape = _logical_shape(packed)
    problems: list[str] = []
    block_stats = None
    names = LAYOUT_NAMES[q.layout]
    if q.block_scales is None:
        problems.append(f"missing block scales ({names.tensor(q.module, names.block_scales)})")
    else:
        scale_info = tensors[q.block_scales]
        problems += _scale_problems(q, shape, scale_info)
        e8m0 = q.layout == LAYOUT_CT_MXFP4
        if e8m0 or scale_info.dtype in _FLOAT_DTYPES:
            stored = read(q.block_scales)
            if stored.dtype.itemsize == 1:
                counts = byte_counts(chunks(q.block_scales))
                block_stats = scale_statistics_of_counts(counts, stored.dtype, e8m0)
            else:
                block_stats = block_scale_statistics(stored, e8m0=e8m0)
            if block_stats.nan_count:
                problems.append(f"{block_stats.nan_count} NaN block scales in {q.block_scales}")
            if block_stats.negative_count:
                problems.append(
                    f"{block_stats.negative_count} negative block scales in {q.block_scales}"
                )
    global_decode = None
    encode = names.scales_encode
    if q.global_scale is not None:
        global_decode, found = _scalar_scale(q.global_scale, tensors[q.global_scale], read, encode)
        problems += found
    elif names.global_scale is not None:
        problems.append(f"missing global scale ({names.tensor(q.module, names.global_scale)})")
    input_decode = None
    if q.input_scale is not None:
        input_decode, found = _scalar_scale(q.input_scale, tensors[q.input_scale], read, encode)
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
