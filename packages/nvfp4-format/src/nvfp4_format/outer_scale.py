"""NVFP4's outer (FP32) scale: one per tensor, or one per row (`quantize(outer_scale=...)`).

    amax  = max|x|                         per tensor (shape ()), or per row over the last axis
    s_enc = min(6 * 448 / amax, FLT_MAX)   1.0 when amax == 0 (6 * 256 under Four Over Six)
    s_dec = 1 / s_enc                      stored as `NVFP4Array.global_scale`, () or [..., 1]

A per-row outer scale (1x16 blocks only; "per token" for activations) is the per-tensor rule
applied to each row on its own. See `nvfp4_format.nvfp4` for where it enters quantization.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nvfp4_format._block_scaling import E4M3_MAX, FLT_MAX
from nvfp4_format._namespace import is_jax_array, namespace
from nvfp4_format.e2m1 import E2M1_MAX
from nvfp4_format.four_over_six import FOUR_OVER_SIX_E4M3_MAX, check_block_scale_rule

OUTER_SCALES = ("tensor", "row")
"""`quantize(outer_scale=...)`: one FP32 decode scale per tensor, or one per row [..., 1]."""


def global_encode_scale(amax: Any, *, block_scale_rule: str = "max") -> Any:
    """s_enc = min(6 * 448 / amax, FLT_MAX) in float32; 1.0 where amax is 0 or not finite.

    With `block_scale_rule="4over6"` the constant is 6 * 256 = 1536 instead of 6 * 448 = 2688
    (Four Over Six keeps 1.5x headroom so that a block scale amax_block / 4 still fits E4M3).
    """
    check_block_scale_rule(block_scale_rule)
    e4m3_max = FOUR_OVER_SIX_E4M3_MAX if block_scale_rule == "4over6" else E4M3_MAX
    xp = namespace(amax)
    amax = xp.asarray(amax, dtype=xp.float32)
    usable = (amax > 0) & xp.isfinite(amax)
    safe = xp.where(usable, amax, xp.float32(1.0))
    s_enc = xp.minimum(xp.float32(E2M1_MAX * e4m3_max) / safe, xp.float32(FLT_MAX))
    return xp.where(usable, s_enc, xp.float32(1.0)).astype(xp.float32)


def global_decode_scale(amax: Any, *, block_scale_rule: str = "max") -> Any:
    """s_dec = 1 / s_enc in float32 (the value stored as `NVFP4Array.global_scale`)."""
    xp = namespace(amax)
    s_enc = global_encode_scale(amax, block_scale_rule=block_scale_rule)
    return (xp.float32(1.0) / s_enc).astype(xp.float32)


def check_outer_scale(outer_scale: str, block_shape: tuple[int, int]) -> None:
    """ValueError unless `outer_scale` is one of `OUTER_SCALES`, and "row" only with 1x16 blocks."""
    if outer_scale not in OUTER_SCALES:
        raise ValueError(f"outer_scale must be one of {OUTER_SCALES}, got {outer_scale!r}")
    if outer_scale == "row" and block_shape != (1, 16):
        raise ValueError(
            "outer_scale='row' needs block_shape=(1, 16): a 16x16 tile spans 16 rows, each with "
            f"its own outer scale, got block_shape={block_shape}"
        )


def outer_amax(xp: Any, block_amax: Any, global_amax: Any, outer_scale: str) -> Any:
    """max|x| (shape ()) or per row (1x16 blocks [..., K/16] -> [..., 1]) as the max of the
    block amaxes (exact, and one pass less), or the caller's."""
    row = outer_scale == "row"
    if global_amax is None:
        if row:
            return xp.max(block_amax, axis=-1, keepdims=True)
        return xp.max(block_amax) if block_amax.size else xp.float32(0.0)
    amax = xp.asarray(global_amax, dtype=xp.float32)
    if not row and amax.ndim != 0:
        raise ValueError(f"global_amax must be a scalar, got shape {tuple(amax.shape)}")
    if row:
        lead = tuple(block_amax.shape[:-1])
        if tuple(amax.shape) == lead:
            amax = amax[..., None]
        if tuple(amax.shape) != (*lead, 1):
            raise ValueError(
                f"global_amax with outer_scale='row' must hold one amax per row, shape "
                f"{(*lead, 1)} or {lead}, got shape {tuple(amax.shape)}"
            )
    if not is_jax_array(amax) and not (np.isfinite(amax).all() and (amax >= 0).all()):
        bad = amax if amax.ndim == 0 else amax[~(np.isfinite(amax) & (amax >= 0))][0]
        raise ValueError(f"global_amax must be finite and >= 0, got {float(bad)}")
    return amax
