"""Two E2M1 codes per byte: the even index in the low nibble, the odd index in the high nibble.

Every consumer agrees on this order (TransformerEngine, ModelOpt, compressed-tensors, vLLM, ONNX).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nvfp4_format._namespace import is_jax_array, namespace
from nvfp4_format.e2m1 import _check_codes, decode_e2m1


def pack_fp4(codes: Any) -> Any:
    """Pack uint8 codes [..., K] (K even) into bytes [..., K/2]: byte j = c[2j] | c[2j+1] << 4.

    Example:
      >>> pack_fp4(np.array([1, 2, 15, 0], np.uint8))
      array([33, 15], dtype=uint8)
    """
    _check_codes("codes", codes)
    if codes.ndim == 0 or codes.shape[-1] % 2:
        raise ValueError(
            f"codes must have an even last dimension to pack two per byte, got shape {tuple(codes.shape)}"
        )
    return pack_pairs(namespace(codes), codes & 0x0F)


def pack_pairs(xp: Any, codes: Any) -> Any:
    """Pack uint8 codes 0..15 [..., K] (K even, unchecked) into bytes [..., K/2].

    Each pair of codes is read as one little-endian uint16 w = c[2j] | c[2j+1] << 8, and
    (w | w >> 4) keeps c[2j] | c[2j+1] << 4 in its low byte. This avoids stride-2 reads, which
    stop XLA's CPU loops from vectorising (3-4x slower) and cost NumPy two strided passes.
    """
    if is_jax_array(codes):
        words = codes.view(xp.uint16)  # XLA bitcasts in memory order; its targets are little-endian
    else:
        words = np.ascontiguousarray(codes).view("<u2")
    return (words | (words >> 4)).astype(xp.uint8)


def unpack_fp4(packed: Any) -> Any:
    """Unpack bytes [..., K/2] into uint8 codes [..., K] (the inverse of `pack_fp4`)."""
    xp = namespace(packed)
    if np.dtype(packed.dtype) != np.uint8:
        raise TypeError(f"packed must be uint8, got dtype={np.dtype(packed.dtype)}")
    if packed.ndim == 0:
        raise ValueError("packed must have at least one dimension, got a scalar")
    low = packed & 0x0F
    high = packed >> 4
    pairs = xp.stack([low, high], axis=-1)
    out = pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return out if is_jax_array(out) else np.ascontiguousarray(out)


def decode_packed(packed: Any) -> Any:
    """Packed E2M1 bytes [..., K/2] -> float32 values [..., K] (= decode_e2m1(unpack_fp4(packed))).

    On JAX the bytes are bitcast to XLA's native `float4_e2m1fn` (two elements per byte, the low
    nibble first: NVFP4's packing order) and converted: no table gather, which XLA on CPU runs
    2-3x slower once fused after a quantization. NumPy uses the code table.
    """
    if np.dtype(packed.dtype) != np.uint8:
        raise TypeError(f"packed must be uint8, got dtype={np.dtype(packed.dtype)}")
    if not is_jax_array(packed):
        return decode_e2m1(unpack_fp4(packed))
    import jax  # only reached with JAX arrays, so JAX is already imported

    f4 = jax.lax.bitcast_convert_type(packed, jax.numpy.float4_e2m1fn)
    return f4.reshape(*packed.shape[:-1], -1).astype(jax.numpy.float32)
