"""Two E2M1 codes per byte: the even index in the low nibble, the odd index in the high nibble.

Every consumer agrees on this order (TransformerEngine, ModelOpt, compressed-tensors, vLLM, ONNX).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nvfp4_format._namespace import is_jax_array, namespace
from nvfp4_format.e2m1 import _check_codes


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
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] & 0x0F) | (pairs[..., 1] << 4)


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
