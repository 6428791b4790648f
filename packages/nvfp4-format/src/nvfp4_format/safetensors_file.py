"""A strict, dependency-free reader for the safetensors file format.

Layout of a file: an 8-byte little-endian unsigned header length N, then N bytes of UTF-8 JSON
(an object mapping each tensor name to ``{"dtype": TAG, "shape": [...], "data_offsets": [begin,
end]}`` plus an optional ``"__metadata__": {str: str}``), then the data buffer. Offsets are
relative to the start of the buffer; tensors tile the buffer without gaps or overlap.

Tensor data is memory-mapped (``np.memmap``) and returned as read-only views, so inspecting a
multi-gigabyte checkpoint reads only the bytes that are actually used. Every structural problem
raises ``ValueError`` naming the file and what is wrong.

Example:
    >>> header = read_safetensors_header("model.safetensors")  # doctest: +SKIP
    >>> sorted(header.tensors)[:1]  # doctest: +SKIP
    ['lm_head.weight']
    >>> tensors, metadata = load_safetensors("model.safetensors")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import ml_dtypes
import numpy as np

__all__ = [
    "DTYPE_TAGS",
    "SafetensorsHeader",
    "SafetensorsIndex",
    "TensorInfo",
    "load_safetensors",
    "read_safetensors_header",
    "read_safetensors_index",
    "read_tensor",
    "read_tensor_bytes",
]

# Largest header read: parsing JSON costs ~13x its size in Python objects, so the reference
# implementation's 100 MB ceiling would take over a gigabyte. Real checkpoints' headers are
# ~150 bytes per tensor (a 100k-tensor file: 15 MiB).
MAX_HEADER_BYTES = 16 * 2**20

# safetensors dtype tag -> NumPy dtype of one stored element (little-endian).
# "F4" (FP4 E2M1) is stored two elements per byte, even index in the low nibble; it is read
# back as its packed uint8 bytes (see `read_tensor`).
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

_PACKED_FP4_TAG = "F4"


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
    if tag == _PACKED_FP4_TAG:
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


def _is_int(v: object) -> bool:
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
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise ValueError(
            f"{path}: tensor {name!r}: shape must be a list of non-negative integers, got {shape!r}"
        )
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
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


def read_tensor(header: SafetensorsHeader, name: str) -> np.ndarray:
    """Returns one tensor as a read-only, memory-mapped NumPy array.

    Args:
        header: from `read_safetensors_header`.
        name: the tensor's name.

    Returns:
        An array of the tag's dtype (ml_dtypes types for BF16 and F8 tags) and the header's
        shape. ``F4`` tensors come back as their packed uint8 bytes, shape
        ``shape[:-1] + (shape[-1] // 2,)`` (a 0-d or odd-last-dim F4 tensor comes back flat).

    Raises:
        KeyError: no tensor of that name.
    """
    if name not in header.tensors:
        raise KeyError(f"{header.path}: no tensor named {name!r}")
    info = header.tensors[name]
    dtype = DTYPE_TAGS[info.dtype]
    shape = info.shape
    if info.dtype == _PACKED_FP4_TAG:
        even_last = len(shape) > 0 and shape[-1] % 2 == 0
        shape = shape[:-1] + (shape[-1] // 2,) if even_last else (info.nbytes,)
    if info.nbytes == 0:
        empty = np.zeros(shape, dtype)
        empty.setflags(write=False)
        return empty
    raw = np.memmap(header.path, dtype=np.uint8, mode="r", offset=info.begin, shape=info.nbytes)
    return np.asarray(raw).view(dtype).reshape(shape)


def read_tensor_bytes(
    header: SafetensorsHeader, name: str, chunk_bytes: int = 1 << 20
) -> Iterator[np.ndarray]:
    """The stored bytes of one tensor as uint8 chunks of at most `chunk_bytes`, read with pread.

    Unlike `read_tensor`'s memory map, nothing stays mapped: statistics over a multi-gigabyte
    tensor need one chunk of memory.

    Raises:
        KeyError: no tensor of that name.
    """
    if name not in header.tensors:
        raise KeyError(f"{header.path}: no tensor named {name!r}")
    info = header.tensors[name]
    fd = os.open(header.path, os.O_RDONLY)
    try:
        for start in range(info.begin, info.end, chunk_bytes):
            size = min(chunk_bytes, info.end - start)
            data = os.pread(fd, size, start)
            if len(data) != size:
                raise ValueError(f"{header.path}: tensor {name!r} is truncated (short read)")
            yield np.frombuffer(data, np.uint8)
    finally:
        os.close(fd)


def load_safetensors(
    path: str | os.PathLike,
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Reads every tensor of a safetensors file.

    Args:
        path: the ``.safetensors`` file.

    Returns:
        ``(tensors, metadata)``: name -> read-only memory-mapped array (see `read_tensor`),
        and the ``__metadata__`` string map.

    Raises:
        ValueError: the file is not a valid safetensors file (see `read_safetensors_header`).
    """
    header = read_safetensors_header(path)
    tensors = {name: read_tensor(header, name) for name in header.tensors}
    return tensors, dict(header.metadata)


@dataclass(frozen=True)
class SafetensorsIndex:
    """A sharded checkpoint's ``model.safetensors.index.json``.

    Attributes:
        path: the index file.
        weight_map: tensor name -> shard file name (a bare name in the index's directory).
        total_size: the declared ``metadata.total_size`` in bytes, None when absent.
    """

    path: str
    weight_map: Mapping[str, str]
    total_size: int | None

    @property
    def shard_files(self) -> tuple[str, ...]:
        """Paths of the shards named by the index, sorted, each once."""
        directory = os.path.dirname(self.path)
        return tuple(os.path.join(directory, f) for f in sorted(set(self.weight_map.values())))


def read_safetensors_index(path: str | os.PathLike) -> SafetensorsIndex:
    """Reads and validates a ``model.safetensors.index.json``.

    Args:
        path: the index file.

    Returns:
        The `SafetensorsIndex`.

    Raises:
        ValueError: not a JSON object with a ``weight_map`` of tensor name -> bare file name,
            or a ``metadata.total_size`` that is not a non-negative integer.
    """
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a valid JSON index: {e}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ValueError(f"{path}: expected an object with a 'weight_map' of strings")
    for shard in set(weight_map.values()):
        if shard != os.path.basename(shard) or shard in ("", ".", ".."):
            raise ValueError(
                f"{path}: weight_map names shard {shard!r}; expected a file name in the "
                f"index's directory"
            )
    metadata = index.get("metadata") or {}
    total_size = metadata.get("total_size") if isinstance(metadata, dict) else None
    if total_size is not None and not _is_int(total_size):
        raise ValueError(f"{path}: metadata.total_size must be a non-negative integer")
    return SafetensorsIndex(path, MappingProxyType(dict(weight_map)), total_size)
