"""Safetensors shards written one tensor at a time, in any order, with bounded memory.

The files are the ones `safetensors.numpy.save_file` writes for the same tensors, byte for byte:
an 8-byte little-endian header length, the JSON header (`__metadata__` first, then the tensors
sorted by dtype, widest first, then by name; compact separators; padded with spaces to a multiple
of 8) and the tensors' bytes in header order. Since the header needs only names, dtypes and shapes,
it is written first from a `TensorSlot` list; each tensor's bytes then go to their offset when the
tensor is produced (`os.pwrite`), so a shard never has to be held in memory. The sharding rule is
the in-memory writer's it replaced: tensors in the given order, a new shard when the next one
would pass `max_shard_bytes`; one shard is `model.safetensors`, several are `model-0000K-of-0000N.safetensors`
plus `model.safetensors.index.json`, written when every tensor is in place.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from nvfp4_export.errors import ExportError
from nvfp4_export.json_files import write_json
from nvfp4_format.safetensors_header import DTYPE_TAGS, PACKED_FP4_TAG

DTYPE_TAG = {dtype: tag for tag, dtype in DTYPE_TAGS.items() if tag != PACKED_FP4_TAG}
"""NumPy dtype -> safetensors dtype tag (uint8 is "U8": packed codes are stored as bytes)."""
SAFETENSORS_METADATA = {"format": "pt"}
"""Every weight file's header metadata (transformers refuses files without it)."""
SINGLE_FILE = "model.safetensors"
"""The weight file of an unsharded export."""
INDEX_FILE = "model.safetensors.index.json"
"""The index of a sharded export's weight files (tensor name -> file)."""
FILE_ORDER = {"F32": 5, "BF16": 4, "F16": 3, "F8_E4M3": 2, "U8": 1}
"""The tags an export writes -> their rank in the safetensors library's file order (higher
first, then by name)."""


@dataclasses.dataclass(frozen=True)
class TensorSlot:
    """One tensor an export will write: name, NumPy dtype and shape (no data)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def _tag(dtype: np.dtype) -> tuple[str, int]:
    """(safetensors tag, file-order rank) of `dtype`."""
    tag = DTYPE_TAG.get(np.dtype(dtype))
    if tag not in FILE_ORDER:
        raise ExportError(
            f"dtype {np.dtype(dtype).name} has no safetensors tag here; expected one of "
            f"{[DTYPE_TAGS[t].name for t in FILE_ORDER]}"
        )
    return tag, FILE_ORDER[tag]


def safetensors_header(
    slots: Sequence[TensorSlot], metadata: dict[str, str]
) -> tuple[bytes, dict[str, int]]:
    """(the file's first bytes up to the data, name -> offset of its data in the file)."""
    ordered = sorted(slots, key=lambda s: (-_tag(s.dtype)[1], s.name))
    header: dict = {"__metadata__": metadata}
    start, offsets = 0, {}
    for s in ordered:
        header[s.name] = {
            "dtype": _tag(s.dtype)[0],
            "shape": list(s.shape),
            "data_offsets": [start, start + s.nbytes],
        }
        offsets[s.name] = start
        start += s.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    return head, {name: len(head) + off for name, off in offsets.items()}


def shard_slots(slots: Sequence[TensorSlot], max_shard_bytes: int) -> list[list[TensorSlot]]:
    """`slots` cut in order into shards of at most `max_shard_bytes` (one tensor at least)."""
    if max_shard_bytes < 1:
        raise ExportError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    shards: list[list[TensorSlot]] = [[]]
    size = 0
    for s in slots:
        if shards[-1] and size + s.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class ShardWriter:
    """Writes the weight files of `slots` into `out_dir` as tensors arrive, in any order.

    Use as a context manager; `write(name, array)` puts one tensor's bytes in place; on normal
    exit every slot must have been written, and the index (several shards) is written last.

    Example:
        >>> slots = [TensorSlot("w", np.dtype(np.float32), (2, 2))]
        >>> with ShardWriter(tmp_path, slots, 4 * 1024**3) as w:  # doctest: +SKIP
        ...     w.write("w", np.ones((2, 2), np.float32))
    """

    def __init__(self, out_dir: Path, slots: Sequence[TensorSlot], max_shard_bytes: int) -> None:
        shards = shard_slots(slots, max_shard_bytes)
        n = len(shards)
        self.files = [SINGLE_FILE] if n == 1 else [
            f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)
        ]  # fmt: skip
        self._out_dir = out_dir
        self._slots = {s.name: s for s in slots}
        self._where: dict[str, tuple[int, int]] = {}  # name -> (file index, offset)
        self._heads, self._sizes = [], []
        for k, shard in enumerate(shards):
            head, offsets = safetensors_header(shard, SAFETENSORS_METADATA)
            self._heads.append(head)
            self._sizes.append(len(head) + sum(s.nbytes for s in shard))
            self._where.update({name: (k, off) for name, off in offsets.items()})
        self._fds: list[int] = []
        self._written: set[str] = set()
        self.bytes_written = 0

    @property
    def total_bytes(self) -> int:
        """Bytes of all the tensors (the index's `total_size`)."""
        return sum(s.nbytes for s in self._slots.values())

    def __enter__(self) -> ShardWriter:
        for file, head, size in zip(self.files, self._heads, self._sizes, strict=True):
            fd = os.open(self._out_dir / file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            self._fds.append(fd)
            _pwrite_all(fd, memoryview(head), 0)
            os.ftruncate(fd, size)
        return self

    def write(self, name: str, array: np.ndarray) -> None:
        """Puts tensor `name` (of the dtype and shape its slot says) in its file."""
        slot = self._slots.get(name)
        if slot is None or name in self._written:
            what = "was already written" if slot is not None else "has no slot"
            raise ExportError(f"tensor {name!r} {what} in this export's weight files")
        if np.dtype(array.dtype) != np.dtype(slot.dtype) or tuple(array.shape) != slot.shape:
            raise ExportError(
                f"tensor {name!r} must be {np.dtype(slot.dtype).name} {slot.shape}, got "
                f"{np.dtype(array.dtype).name} {tuple(array.shape)}"
            )
        k, offset = self._where[name]
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        _pwrite_all(self._fds[k], memoryview(data), offset)
        self._written.add(name)
        self.bytes_written += slot.nbytes

    def __exit__(self, exc_type, exc, tb) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        if exc_type is not None:
            return
        missing = [name for name in self._slots if name not in self._written]
        if missing:
            raise ExportError(f"export wrote no data for {missing[:4]} ({len(missing)} tensors)")
        if len(self.files) > 1:
            self._write_index()

    def _write_index(self) -> None:
        weight_map = {s.name: self.files[self._where[s.name][0]] for s in self._slots.values()}
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        write_json(self._out_dir / INDEX_FILE, index)
        self.files = [*self.files, INDEX_FILE]
