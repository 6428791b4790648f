"""Reads the tensor data of a safetensors file, given its validated header (`safetensors_header`).

Tensor data is memory-mapped (``np.memmap``) and returned as read-only views, so inspecting a
multi-gigabyte checkpoint reads only the bytes that are actually used; `read_tensor_bytes` reads
stored bytes in chunks with nothing left mapped.

Example:
    >>> header = read_safetensors_header("model.safetensors")  # doctest: +SKIP
    >>> read_tensor(header, "lm_head.weight").dtype  # doctest: +SKIP
    dtype(bfloat16)
    >>> tensors, metadata = load_safetensors("model.safetensors")  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from nvfp4_format.safetensors_header import (
    DTYPE_TAGS,
    PACKED_FP4_TAG,
    SafetensorsHeader,
    read_safetensors_header,
)

__all__ = ["load_safetensors", "read_tensor", "read_tensor_bytes"]


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
    if info.dtype == PACKED_FP4_TAG:
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
