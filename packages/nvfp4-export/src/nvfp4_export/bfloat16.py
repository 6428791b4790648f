"""float32 -> bfloat16 rounding and large-matrix transposes, fast on a CPU.

`to_bfloat16` gives the bits `x.astype(ml_dtypes.bfloat16)` gives (round to nearest even; NaN
stays NaN, with its sign), with three integer operations instead of ml_dtypes' per-element
conversion. `transposed` copies a 2-D array's transpose tile by tile, so that reads and writes
both stay in cache (NumPy's plain `ascontiguousarray(x.T)` strides through memory on one side).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

TILE = 64
"""Tile edge of `transposed` (64 x 64 elements fit in L1 at 2 or 4 bytes each)."""


def to_bfloat16(x: np.ndarray) -> np.ndarray:
    """`x` (float32) rounded to bfloat16 (round to nearest even), bit-identical to
    `x.astype(ml_dtypes.bfloat16)`, same shape, C-contiguous.

    Example:
        >>> to_bfloat16(np.float32([1.0, 1.00390625, 3e38])).astype(np.float32)
        array([1.0000000e+00, 1.0000000e+00, 2.9907589e+38], dtype=float32)
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    t = u >> np.uint32(16)  # one temporary, updated in place (fresh pages cost more than math)
    t &= np.uint32(1)
    t += np.uint32(0x7FFF)
    t += u
    t >>= np.uint32(16)
    bits = t.astype(np.uint16)
    del t
    nan = np.isnan(x)
    if nan.any():  # a NaN whose payload is only in the low bits would round to Inf
        bits[nan] = (u[nan] >> np.uint32(16)).astype(np.uint16) | np.uint16(0x0040)
    return bits.view(ml_dtypes.bfloat16)


def transposed(x: np.ndarray, tile: int = TILE) -> np.ndarray:
    """`np.ascontiguousarray(x.T)` for a 2-D `x`, copied in `tile` x `tile` blocks."""
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D, got shape {x.shape}")
    rows, cols = x.shape
    if rows * cols < tile * tile * 16:
        return np.ascontiguousarray(x.T)
    out = np.empty((cols, rows), x.dtype)
    for i in range(0, rows, tile):
        for j in range(0, cols, tile):
            out[j : j + tile, i : i + tile] = x[i : i + tile, j : j + tile].T
    return out


def bfloat16_values_transposed(kernel_IxO: np.ndarray) -> np.ndarray:
    """float32 [out, in]: the transpose of `kernel_IxO` rounded to bfloat16 (the values a
    bfloat16 matmul with it computes with), transposed as 2-byte bfloat16 (half the memory
    traffic of a float32 transpose)."""
    bits_OxI = transposed(to_bfloat16(kernel_IxO).view(np.uint16))
    return (bits_OxI.astype(np.uint32) << np.uint32(16)).view(np.float32)
