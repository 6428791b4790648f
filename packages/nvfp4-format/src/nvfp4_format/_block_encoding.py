"""NVFP4's two passes over x, for both block-scale rules: the block amaxes, then the packed codes.

    amax_block = max|x| per 1x16 block (per 16x16 tile)            pass 1
    q          = e2m1(clip(x * enc_b, -6, 6)), two codes per byte   pass 2

Both run on NumPy (by cache-sized row chunks) and on JAX (one fused loop under `jax.jit`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nvfp4_format._block_scaling import BLOCK_SIZE, block_encode_scales, row_chunks
from nvfp4_format._namespace import is_jax_array
from nvfp4_format.e2m1 import _encode_bits
from nvfp4_format.packing import pack_pairs


def _blocks(x: Any, block_shape: tuple[int, int]) -> Any:
    """View [..., K] as [..., K/16, 16] blocks, or [..., M/16, 16, K/16, 16] tiles."""
    *lead, k = x.shape
    if block_shape == (1, 16):
        return x.reshape(*lead, k // BLOCK_SIZE, BLOCK_SIZE)
    m = lead.pop()
    return x.reshape(*lead, m // BLOCK_SIZE, BLOCK_SIZE, k // BLOCK_SIZE, BLOCK_SIZE)


def per_block_amax(xp: Any, x: Any, block_shape: tuple[int, int]) -> Any:
    """float32 max|x| per block [..., K/16] (per tile [..., M/16, K/16] for 16x16).

    The maximum is exact, so the two namespaces may reduce differently with identical results:
    - XLA: one reduction with the reducer max(|a|, |b|), which its CPU backend runs as a single
      fused pass over x (max(abs(x)) first materialises |x|; max and -min take two passes).
    - NumPy, by row chunks: a max over a short contiguous axis is slow (~10x), so each chunk is
      copied with the block's own axes first and reduced over whole rows.
    """
    tile_rows = block_shape[0]
    if is_jax_array(x):
        from jax import lax

        axes = (x.ndim,) if tile_rows == 1 else (x.ndim - 1, x.ndim + 1)
        blocks = _blocks(xp.asarray(x, dtype=xp.float32), block_shape)
        abs_max = lambda u, v: xp.maximum(xp.abs(u), xp.abs(v))  # noqa: E731
        return lax.reduce(blocks, xp.float32(0.0), abs_max, axes)
    *lead, k = x.shape
    rows = np.asarray(x).reshape(-1, k)
    out = np.empty((rows.shape[0] // tile_rows, k // BLOCK_SIZE), np.float32)
    for sl in row_chunks(rows.shape[0], k, tile_rows):
        tiles = rows[sl].reshape(-1, tile_rows, k // BLOCK_SIZE, BLOCK_SIZE)
        # A float32 copy with the within-block axes first: the max then runs over whole rows.
        values = tiles.transpose(1, 3, 0, 2).astype(np.float32, order="C")
        values = np.abs(values, out=values).reshape(tile_rows * BLOCK_SIZE, -1)
        block_max = values.max(axis=0).reshape(-1, k // BLOCK_SIZE)
        out[sl.start // tile_rows : sl.stop // tile_rows] = block_max
    return (
        out.reshape(*lead[:-1], -1, k // BLOCK_SIZE)
        if tile_rows > 1
        else out.reshape(*lead, k // BLOCK_SIZE)
    )


def encode_blocks(
    xp: Any,
    x: Any,
    scales: Any,
    s_dec: Any,
    block_shape: tuple[int, int],
    rounding: str,
    uniform: Any,
) -> Any:
    """Packed uint8 codes [..., K/2] of e2m1(clip(x * enc_b, -6, 6)), enc_b from the block scales.

    A block with scale 0 gets enc_b = 0 and its sign bits masked, so all its codes are +0.
    """
    enc = block_encode_scales(xp, scales, s_dec)
    if block_shape == (16, 16):  # a tile encodes like 16 rows of 1x16 blocks with its scale
        enc = xp.repeat(enc, BLOCK_SIZE, axis=-2)
    k = x.shape[-1]
    enc = enc.reshape(-1, k // BLOCK_SIZE)
    x_rows = x.reshape(-1, k)
    u_rows = uniform.reshape(-1, k) if rounding == "stochastic" else None
    if xp is not np:
        packed = _encode_rows(xp, x_rows, enc, u_rows, rounding)
    else:
        packed = np.empty((x_rows.shape[0], k // 2), np.uint8)
        for sl in row_chunks(x_rows.shape[0], k):
            u_chunk = None if u_rows is None else u_rows[sl]
            packed[sl] = _encode_rows(np, x_rows[sl], enc[sl], u_chunk, rounding)
    return packed.reshape(*x.shape[:-1], k // 2)


def _encode_rows(xp: Any, x: Any, enc: Any, uniform: Any, rounding: str) -> Any:
    """Packed codes [n, K/2] of rows x [n, K] with per-block encode scales enc [n, K/16]."""
    n, k = x.shape
    scaled = (
        xp.asarray(x, dtype=xp.float32).reshape(n, k // BLOCK_SIZE, BLOCK_SIZE) * enc[..., None]
    )
    if uniform is not None:
        uniform = uniform.reshape(n, k // BLOCK_SIZE, BLOCK_SIZE)
    sign_mask = (enc > 0).astype(xp.uint32)[..., None] << 3  # zero blocks: no -0 codes
    codes = _encode_bits(xp, scaled, rounding, uniform, sign_mask)
    return pack_pairs(xp, codes.astype(xp.uint8).reshape(n, k))
