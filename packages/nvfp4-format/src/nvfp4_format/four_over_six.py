"""Four Over Six (4/6): per NVFP4 block, the better of two block scales, amax -> 6 or amax -> 4.

Cook et al., "Four Over Six: More Accurate NVFP4 Quantization with Adaptive Block Scaling"
(arXiv 2512.02010; reference code github.com/mit-han-lab/fouroversix). E2M1's grid is coarsest at
the top (4 -> 6 is a step of 2), so the largest values of a block carry the most error. Mapping
the block amax to 4 instead of 6 (a 1.5x larger block scale) leaves the finer grid 0, 0.5, 1, 1.5,
2, 3, 4 for the block's values; for some blocks that is closer, for others not, so each block
keeps whichever of the two encodings dequantizes closer to x. In float32, in this order:

    s_enc  = min(6 * 256 / amax, FLT_MAX)         1.0 when amax == 0; s_dec = 1 / s_enc
    sb6    = e4m3(clip(amax_block * (s_enc * (1/6)), 0, 448))    the standard candidate
    sb4    = e4m3(clip(amax_block * (s_enc * (1/4)), 0, 448))    block amax -> 4
    q_c    = e2m1_rne(clip(x * enc_c, -6, 6))     enc_c from sb_c exactly as standard NVFP4
    x'_c   = (e2m1_value(q_c) * sb_c) * s_dec     the candidate's dequantized value
    err_c  = sum over the block of (x - x'_c)^2   ("mse"; "l1": sum |x - x'_c|; "max_abs": max)
    sb     = sb4 where err4 < err6, else sb6      (ties keep the standard sb6)

The tensor scale uses 256 where standard NVFP4 uses 448 (the paper's choice, as in its code:
`E4M3_MAX_FOUROVERSIX = 256`): with 448 the block holding the tensor amax would need
sb4 = 1.5 * 448 = 672, beyond E4M3's 448; with 256 the largest sb6 is 256 and the largest sb4
is 384, both representable.

The errors compare x with the candidate's dequantized value x' exactly as `dequantize` computes
it ((e2m1_value * sb) * s_dec in float32). |x| - |x'| is exact in float32 (Sterbenz: x' lies
within a factor 2 of x unless the block clipped), so "max_abs" compares exact errors; they are
scaled by a power of two near 1 / s_dec (exact) so that squares neither overflow nor underflow
for tensors with huge or tiny amax. Sums run in one fixed pairwise order (`_pairwise_sum`), and
products that feed an addition are held apart from it (`_unfused`) because XLA on CPU contracts
`a * b + c` into one fused multiply-add (rounded once) where NumPy rounds twice. So NumPy and JAX
choose bit-identically. A tie is a tie of these float32 errors: the per-element errors are
exact, but the "mse" and "l1" sums are rounded, so two candidates whose exact errors are equal or
within float32 resolution (~1e-7 relative; exact "l1" ties are not rare, as per-element
differences often cancel) may be decided by the last bit of the sums, as in the paper's float32
kernels. Either choice then has the same error to that resolution.

The chosen scale then encodes the block like any NVFP4 block, with RNE or stochastic rounding, so
`dequantize` of the result is exactly the chosen candidate's dequantization.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nvfp4_format._block_scaling import (
    BLOCK_SIZE,
    block_encode_scales,
    e4m3_block_scales,
    row_chunks,
)
from nvfp4_format._namespace import is_jax_array
from nvfp4_format.e2m1 import _encode_bits

BLOCK_SCALE_RULES = ("max", "4over6")
ERROR_METRICS = ("mse", "l1", "max_abs")
FOUR_OVER_SIX_E4M3_MAX = 256.0
"""The E4M3 value the tensor amax's block scale maps to under Four Over Six (448 in standard NVFP4)."""

_F32_MAX_BITS = 0x7F7FFFFF


def check_block_scale_rule(block_scale_rule: str, error_metric: str = "mse") -> None:
    """ValueError for an unknown rule or metric, or a metric other than "mse" without "4over6"."""
    if block_scale_rule not in BLOCK_SCALE_RULES:
        raise ValueError(
            f"block_scale_rule must be one of {BLOCK_SCALE_RULES}, got {block_scale_rule!r}"
        )
    if error_metric not in ERROR_METRICS:
        raise ValueError(f"error_metric must be one of {ERROR_METRICS}, got {error_metric!r}")
    if block_scale_rule != "4over6" and error_metric != "mse":
        raise ValueError(
            f"error_metric={error_metric!r} only applies to block_scale_rule='4over6', "
            f"got block_scale_rule={block_scale_rule!r}"
        )


def select_block_scales(
    xp: Any,
    x: Any,
    block_amax: Any,
    s_enc: Any,
    s_dec: Any,
    block_shape: tuple[int, int],
    error_metric: str,
) -> Any:
    """float8_e4m3fn block scales, per block the better of sb6 and sb4 (shape of `block_amax`).

    Args:
      xp: the array namespace.
      x: floating [..., K] input (validated by the caller).
      block_amax: float32 per-block amax, [..., K/16] or per 16x16 tile [..., M/16, K/16].
      s_enc, s_dec: the tensor's encode / decode scales from the 6 * 256 rule: scalars, or
        one per row [..., 1] (1x16 blocks, `quantize(outer_scale="row")`).
      block_shape: (1, 16) or (16, 16).
      error_metric: "mse", "l1" or "max_abs".
    """
    sb6 = e4m3_block_scales(xp, block_amax, s_enc, 6.0)
    sb4 = e4m3_block_scales(xp, block_amax, s_enc, 4.0)
    k = x.shape[-1]
    tile_rows = block_shape[0]
    x_rows = x.reshape(-1, k)
    sb6_rows, sb4_rows = sb6.reshape(-1, k // BLOCK_SIZE), sb4.reshape(-1, k // BLOCK_SIZE)
    per_row = s_dec.ndim > 0  # one decode scale per row (1x16 blocks): [n, 1] like x_rows
    s_dec_rows = s_dec.reshape(-1, 1) if per_row else s_dec
    if is_jax_array(x_rows):
        err6 = _block_errors(xp, x_rows, sb6_rows, s_dec_rows, tile_rows, error_metric)
        err4 = _block_errors(xp, x_rows, sb4_rows, s_dec_rows, tile_rows, error_metric)
        choose4 = err4 < err6
    else:  # NumPy: by row chunks, so temporaries stay in cache
        choose4 = np.empty(sb6_rows.shape, bool)
        for sl in row_chunks(x_rows.shape[0], k, tile_rows):
            rows = slice(sl.start // tile_rows, sl.stop // tile_rows)
            x_chunk, s_dec_chunk = x_rows[sl], s_dec_rows[sl] if per_row else s_dec
            err6 = _block_errors(np, x_chunk, sb6_rows[rows], s_dec_chunk, tile_rows, error_metric)
            err4 = _block_errors(np, x_chunk, sb4_rows[rows], s_dec_chunk, tile_rows, error_metric)
            choose4[rows] = err4 < err6
    return xp.where(choose4, sb4_rows, sb6_rows).reshape(sb6.shape)


def _block_errors(
    xp: Any, x: Any, scales: Any, s_dec: Any, tile_rows: int, error_metric: str
) -> Any:
    """float32 error per block [n / tile_rows, K/16] of the RNE encoding with `scales`.

    x is [n, K]; scales [n / tile_rows, K/16] (one per 1x16 block or 16x16 tile); s_dec a scalar
    or, for 1x16 blocks, one per row [n, 1].
    """
    n, k = x.shape
    x32 = xp.asarray(x, dtype=xp.float32).reshape(n // tile_rows, tile_rows, k // BLOCK_SIZE, -1)
    enc = block_encode_scales(xp, scales, s_dec)[:, None, :, None]
    if s_dec.ndim > 0:
        s_dec = s_dec[:, None, :, None]  # [n, 1, 1, 1] against the blocks [n, 1, K/16, 16]
    magnitude = _encode_bits(xp, x32 * enc, "rne", None, 0)  # codes 0..7 (sign dropped)
    # 2 * e2m1_value: codes 0..4 -> 0..4 (values 0..2), 5 -> 6, 6 -> 8, 7 -> 12 (values 3, 4, 6).
    twice = magnitude + (xp.maximum(magnitude, 4) - 4) + 2 * (xp.maximum(magnitude, 6) - 6)
    half_scale = scales.astype(xp.float32) * xp.float32(0.5)
    in_block_units = twice.astype(xp.float32) * half_scale[:, None, :, None]  # exact: <= 6 bits
    # |x'| exactly as `dequantize` computes it: (e2m1_value * sb) * s_dec, rounded once.
    decoded = _unfused(xp, in_block_units * s_dec)
    # Codes carry the sign of x (zero-scale blocks decode to 0), so |x - x'| = ||x| - |x'||; the
    # subtraction is exact wherever |x'| lies within a factor 2 of |x| (Sterbenz), i.e. always
    # unless the block clipped at 6. Scaled by a power of two ~ 1 / s_dec (exact) so that the
    # squares neither overflow nor underflow.
    error = xp.abs(xp.abs(x32) - decoded) * _power_of_two_near_reciprocal(xp, s_dec)
    if error_metric == "max_abs":
        return xp.max(error, axis=(1, 3))
    if error_metric == "mse":
        error = _unfused(xp, error * error)
    return _pairwise_sum(_pairwise_sum(error, 3), 1)


def _power_of_two_near_reciprocal(xp: Any, s_dec: Any) -> Any:
    """float32 2^(1 - e) for s_dec = m * 2^e (m in [0.5, 1)): within a factor 2 of 1 / s_dec."""
    _, e = xp.frexp(xp.asarray(s_dec, dtype=xp.float32))
    return xp.ldexp(xp.float32(1.0), 1 - e.astype(xp.int32)).astype(xp.float32)


def _unfused(xp: Any, v: Any) -> Any:
    """`v` (>= 0) unchanged up to FLT_MAX, behind an integer min that no compiler folds away.

    XLA on CPU fuses `a * b + c` into one fused multiply-add, which rounds once where NumPy
    rounds twice; an integer operation between the product and the sum keeps them apart, so both
    namespaces compute the same float32 values. (+Inf and NaN become FLT_MAX: only non-finite
    input, whose tensor is marked by a NaN global scale anyway, produces them.)
    """
    return xp.minimum(v.view(xp.uint32), _F32_MAX_BITS).view(xp.float32)


def _pairwise_sum(v: Any, axis: int) -> Any:
    """Sum over `axis` (length a power of two) by halving: the same additions on NumPy and XLA."""
    lower = [slice(None)] * v.ndim
    upper = [slice(None)] * v.ndim
    while v.shape[axis] > 1:
        half = v.shape[axis] // 2
        lower[axis], upper[axis] = slice(0, half), slice(half, None)
        v = v[tuple(lower)] + v[tuple(upper)]
    lower[axis] = 0
    return v[tuple(lower)]
