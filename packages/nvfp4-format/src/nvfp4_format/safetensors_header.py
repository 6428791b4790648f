"""A safetensors file's header: dtype tags, tensor entries and a strict, dependency-free reader.

Layout of a file: an 8-byte little-endian unsigned header length N, then N bytes of UTF-8 JSON
(an object mapping each tensor name to ``{"dtype": TAG, "shape": [...], "data_offsets": [begin,
end]}`` plus an optional ``"__metadata__": {str: str}``), then the data buffer. Offsets are
relative to the start of the buffer; tensors tile the buffer without gaps or overlap.

Only the header is read here (the data: `safetensors_file`). Every structural problem raises
``ValueError`` naming the file and what is wrong.

Example:
    >>> header = read_safetensors_header("model.safetensors")  # doctest: +SKIP
    >>> sorted(header.tensors)[:1]  # doctest: +SKIP
    ['lm_head.weight']
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import ml_dtypes
import numpy as np

__all__ = [
    "DTYPE_TAGS",
    "SafetensorsHeader",
    "TensorInfo",
    "read_safetensors_header",
]

# Largest header read: parsing JSON costs ~13x its size in Python objects, so the reference
# implementation's 100 MB ceiling would take over a gigabyte. Real checkpoints' headers are
# ~150 bytes per tensor (a 100k-tensor file: 15 MiB).
MAX_HEADER_BYTES = 16 * 2**20

# safetensors dtype tag -> NumPy dtype of one stored element (little-endian).
# "F4" (FP4 E2M1) is stored two elements per byte, even index in the low nibble; it is read
# back as its packed uint8 bytes (see `safetensors_file.read_tensor`).
DTYPE_TAGS: Mapping[str, np.dtype] = MappingProxyType(
    {
        "F64": np.dtype("<f8"),
        "F32": np.dtype("<f4"),
        "F16": np.dtype("<f2"),
        "BF16": np.dtype(ml_dtypes.bfloat16),
        "I64": np.dtype("<i8"),
        "I32": np.dtype("<i4"),
        "I16": np.dtype("<i2"),
        "I8": np.dtype("i1"),
        "U64": np.dtype("<u8"),
        "U32": np.dtype("<u4"),
        "U16": np.dtype("<u2"),
        "U8": np.dtype("u1"),
        "BOOL": np.dtype("?"),
        "C64": np.dtype("<c8"),
        "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
        "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
        "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
        "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
        "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
        "F4": np.dtype("u1"),
    }
)

PACKED_FP4_TAG = "F4"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry.

    Attributes:
        name: tensor name.
        dtype: safetensors dtype tag, e.g. ``"U8"``, ``"F8_E4M3"``.
        shape: logical shape (for ``"F4"``: FP4 elements, two per byte).
        begin: absolute byte offset of the first data byte in the file.
        end: absolute byte offset one past the last data byte.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        """Stored size in bytes."""
        return self.end - self.begin

    @property
    def numel(self) -> int:
        """Number of logical elements."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsHeader:
    """The parsed, validated header of one safetensors file.

    Attributes:
        path: the file.
        file_bytes: size of the file in bytes.
        data_start: absolute offset of the data buffer (8 + header length).
        tensors: name -> `TensorInfo`, in the order of their data in the file.
        metadata: the ``__metadata__`` string map ({} when absent).
    """

    path: str
    file_bytes: int
    data_start: int
    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str]


def _stored_nbytes(path: str, name: str, tag: str, shape: tuple[int, ...]) -> int:
    numel = math.prod(shape)
    if tag == PACKED_FP4_TAG:
        if numel % 2:
            raise ValueError(
                f"{path}: tensor {name!r} has dtype F4 and an odd element count {numel} "
                f"(shape {list(shape)}); F4 data must fill whole bytes"
            )
        return numel // 2
    return numel * DTYPE_TAGS[tag].itemsize


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dupes = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"duplicate keys in header: {dupes}")
    return dict(pairs)


def _read_header_json(path: str, file_bytes: int) -> tuple[dict, int]:
    if file_bytes < 8:
        raise ValueError(
            f"{path}: not a safetensors file: {file_bytes} bytes, shorter than the 8-byte "
            f"header length"
        )
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        if header_len > MAX_HEADER_BYTES:
            raise ValueError(
                f"{path}: header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte "
                f"limit this reader holds in memory (not a safetensors file? real headers are "
                f"~150 bytes per tensor)"
            )
        if 8 + header_len > file_bytes:
            raise ValueError(
                f"{path}: header length {header_len} runs past the end of the "
                f"{file_bytes}-byte file (truncated or not a safetensors file)"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: header is not valid UTF-8 ({e})") from None
    except ValueError as e:  # json.JSONDecodeError and duplicate keys
        raise ValueError(f"{path}: header is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{path}: header is not a safetensors header: nested too deeply") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    return header, 8 + header_len


def _parse_metadata(path: str, raw: object) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw.items()
    ):
        raise ValueError(f"{path}: __metadata__ must be an object of strings, got {raw!r}")
    return dict(raw)


def is_nonnegative_int(v: object) -> bool:
    """True for an int (not a bool) >= 0: what a shape entry, offset or size must be."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _parse_entry(path: str, name: str, entry: object, data_start: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: tensor {name!r}: entry must be an object, got {entry!r}")
    missing = {"dtype", "shape", "data_offsets"} - entry.keys()
    if missing:
        raise ValueError(f"{path}: tensor {name!r}: missing keys {sorted(missing)}")
    tag, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(tag, str) or tag not in DTYPE_TAGS:
        raise ValueError(
            f"{path}: tensor {name!r}: unknown dtype tag {tag!r}; supported: "
            f"{', '.join(DTYPE_TAGS)}"
        )
    if not isinstance(shape, list) or not all(is_nonnegative_int(d) for d in shape):
        raise ValueError(
            f"{path}: tensor {name!r}: shape must be a list of non-negative integers, got {shape!r}"
        )
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(is_nonnegative_int(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise ValueError(
            f"{path}: tensor {name!r}: data_offsets must be [begin, end] with "
            f"0 <= begin <= end, got {offsets!r}"
        )
    expected = _stored_nbytes(path, name, tag, tuple(shape))
    if offsets[1] - offsets[0] != expected:
        raise ValueError(
            f"{path}: tensor {name!r}: dtype {tag} shape {shape} needs {expected} bytes but "
            f"data_offsets {offsets} span {offsets[1] - offsets[0]}"
        )
    return TensorInfo(name, tag, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def _check_tiling(path: str, infos: list[TensorInfo], data_start: int, file_bytes: int) -> None:
    buffer_bytes = file_bytes - data_start
    position = data_start
    for info in infos:
        if info.begin < position:
            raise ValueError(
                f"{path}: tensor {info.name!r}: data_offsets "
                f"[{info.begin - data_start}, {info.end - data_start}] overlap the previous "
                f"tensor (which ends at {position - data_start})"
            )
        if info.begin > position:
            raise ValueError(
                f"{path}: gap of {info.begin - position} bytes in the data buffer before "
                f"tensor {info.name!r} (offsets must tile the buffer)"
            )
        if info.end > file_bytes:
            raise ValueError(
                f"{path}: tensor {info.name!r}: data ends at buffer offset "
                f"{info.end - data_start} but the buffer holds only {buffer_bytes} bytes "
                f"(file truncated?)"
            )
        position = info.end
    if position != file_bytes:
        raise ValueError(
            f"{path}: {file_bytes - position} trailing bytes after the last tensor "
            f"(the header's offsets cover {position - data_start} of {buffer_bytes} buffer bytes)"
        )


def read_safetensors_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Reads and validates the header of a safetensors file (no tensor data is read).

    Args:
        path: the ``.safetensors`` file.

    Returns:
        The validated `SafetensorsHeader`.

    Raises:
        ValueError: the file is too short, its header length runs past the end, the header is
            not a JSON object, a dtype tag is unknown, a shape does not match its offsets, or
            the offsets overlap, leave gaps or run past the end of the file (truncated data).
        OSError: the file cannot be opened.
    """
    path = os.fspath(path)
    file_bytes = os.stat(path).st_size
    header, data_start = _read_header_json(path, file_bytes)
    metadata = _parse_metadata(path, header.pop("__metadata__", None))
    infos = [_parse_entry(path, name, entry, data_start) for name, entry in header.items()]
    infos.sort(key=lambda i: (i.begin, i.end))
    _check_tiling(path, infos, data_start, file_bytes)
    return SafetensorsHeader(
        path=path,
        file_bytes=file_bytes,
        data_start=data_start,
        tensors=MappingProxyType({i.name: i for i in infos}),
        metadata=MappingProxyType(metadata),
    )
