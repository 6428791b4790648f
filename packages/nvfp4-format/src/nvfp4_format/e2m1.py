"""FP4 E2M1 elements: encoding (round-to-nearest-even or stochastic) and decoding.

Codes are uint8 values 0..15: bit 3 is the sign, bits 0..2 index the magnitudes
{0, 0.5, 1, 1.5, 2, 3, 4, 6}. Code 8 is -0. No Inf or NaN exists in E2M1.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nvfp4_format._namespace import (
    check_finite,
    check_float,
    check_rounding,
    check_uniform,
    is_jax_array,
    namespace,
)

E2M1_MAX = 6.0
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)
"""float32[16]: the value of each 4-bit code."""

CHUNK_ELEMENTS = 1 << 16
"""NumPy paths work in chunks of this many elements (256 KiB of float32) to stay in cache."""

# Bit patterns of float32 values the integer encoder works with (|x| as uint32 orders like |x|).
_F32_ABS_MASK = 0x7FFFFFFF
_F32_ONE = 0x3F800000  # 1.0
_F32_SIX = 0x40C00000  # 6.0: min(bits, this) saturates, and maps Inf and NaN to 6 like hardware
_F32_TWO_POW_22 = 0x4A800000  # 2^22, whose float32 spacing is 0.5


def _abs_bits(xp: Any, x32: Any) -> tuple[Any, Any]:
    """(min(|x|, 6) as uint32 bits, sign bit moved to bit 3) of a float32 array."""
    bits = x32.view(xp.uint32)
    sign = (bits >> 28) & 8
    return xp.minimum(bits & _F32_ABS_MASK, _F32_SIX), sign


def _magnitude_rne(xp: Any, a_bits: Any) -> Any:
    """uint32 code magnitude 0..7 of |x| <= 6 given as float32 bits; round to nearest, ties to even.

    Integer arithmetic on the bits, one fused pass on XLA and a few cheap passes on NumPy,
    instead of seven threshold comparisons:
    - |x| >= 1 (E2M1 normals 1..6): bits >> 22 keeps the exponent and one mantissa bit, and
      code = (bits >> 22) - 252. Adding 0x1FFFFF plus the kept lowest bit first rounds the 22
      dropped bits to nearest, ties to even; a carry moves into the next binade correctly.
    - |x| < 1 (0, 0.5, 1): |x| + 2^22 rounds |x| to a multiple of 0.5 (the float32 spacing at
      2^22) with the FPU's ties-to-even, and the bits above 2^22's count the halves: 0, 1 or 2.
    The two combine without a select (NumPy's `where` is ~10x slower than these operations):
    `normal` is computed from max(|x|, 1), so it is 2 (the code of 1) below 1, where `halves` is
    at most 2; from 1 up, `normal` is the code and `halves` = round(2|x|) is never smaller.
    """
    at_least_one = xp.maximum(a_bits, _F32_ONE)
    lsb = (at_least_one >> 22) & 1
    normal = ((at_least_one + (0x1FFFFF + lsb)) >> 22) - 252
    halves = (a_bits.view(xp.float32) + xp.float32(2.0**22)).view(xp.uint32) - _F32_TWO_POW_22
    return xp.minimum(normal, halves)


def _magnitude_stochastic(xp: Any, a_bits: Any, uniform: Any) -> Any:
    """uint32 code magnitude of |x| <= 6 (float32 bits) rounded down or up, P(up) = (a - lo) / gap."""
    a = a_bits.view(xp.float32)
    small = a_bits < _F32_ONE  # below 1 the grid is 0, 0.5, 1 with gap 0.5
    half_or_more = a >= 0.5
    # lo (the grid point at or below a) truncates a to one mantissa bit; gap is half of a's
    # power of two. Both exact, from the bits, without a gather.
    lo_code = xp.where(small, half_or_more.astype(xp.uint32), (a_bits >> 22) - 252)
    lo = xp.where(small, xp.where(half_or_more, 0.5, 0.0), (a_bits & 0x7FC00000).view(xp.float32))
    gap_bits = (a_bits & 0x7F800000) - 0x00800000
    gap = xp.where(small, xp.float32(0.5), gap_bits.view(xp.float32))
    p_up = (a - lo.astype(xp.float32)) / gap  # exact: a - lo (Sterbenz), gap a power of two
    return lo_code + (uniform.astype(xp.float32) < p_up).astype(xp.uint32)


def _encode_bits(xp: Any, x32: Any, rounding: str, uniform: Any, sign_mask: Any = 8) -> Any:
    """uint32 E2M1 codes of a float32 array (saturating at +-6). `sign_mask` 0 drops the sign."""
    a_bits, sign = _abs_bits(xp, x32)
    if rounding == "stochastic":
        magnitude = _magnitude_stochastic(xp, a_bits, uniform)
    else:
        magnitude = _magnitude_rne(xp, a_bits)
    return magnitude | (sign & sign_mask)


def encode_e2m1(x: Any, rounding: str = "rne", uniform: Any = None) -> Any:
    """Encode values to E2M1 codes, saturating at +-6 (no scaling is applied).

    Args:
      x: floating array (float16, bfloat16, float32, float64), NumPy or JAX.
      rounding: "rne" (round to nearest, ties to even) or "stochastic" (unbiased for |x| <= 6).
      uniform: for "stochastic", uniform random numbers in [0, 1) with the shape of `x`.

    Returns:
      uint8 codes 0..15 with the shape of `x`. A set sign bit in `x` (negative numbers, -0.0)
      gives a set sign bit in the code, as hardware conversions and `ml_dtypes` do.

    Raises:
      ValueError: NaN or Inf in a NumPy `x` (inside `jax.jit` they cannot be detected here; the
        codes are then unspecified and `quantize` reports them through a NaN global scale).

    Example:
      >>> encode_e2m1(np.array([0.25, 0.75, -2.5, 7.0], np.float32))
      array([ 0,  2, 12,  7], dtype=uint8)
    """
    xp = namespace(x, uniform)
    check_float("x", x)
    check_rounding(rounding)
    check_finite("x", x)
    if rounding == "stochastic":
        check_uniform("uniform", uniform, tuple(x.shape))
    x32 = xp.asarray(x, dtype=xp.float32)
    if xp is not np:
        return _encode_bits(xp, x32, rounding, uniform).astype(xp.uint8)
    # NumPy: chunk by chunk, so the temporaries stay in cache (several times faster).
    flat = x32.reshape(-1)
    flat_u = np.asarray(uniform).reshape(-1) if rounding == "stochastic" else None
    codes = np.empty(flat.shape, np.uint8)
    for start in range(0, flat.size, CHUNK_ELEMENTS):
        sl = slice(start, start + CHUNK_ELEMENTS)
        u = None if flat_u is None else flat_u[sl]
        codes[sl] = _encode_bits(np, flat[sl], rounding, u)
    codes = codes.reshape(x32.shape)
    return codes[()] if codes.ndim == 0 else codes  # a NumPy scalar for 0-d input, as before


def decode_e2m1(codes: Any) -> Any:
    """Decode E2M1 codes (uint8 0..15) to float32 values.

    Example:
      >>> decode_e2m1(np.array([0, 1, 7, 15], np.uint8))
      array([ 0. ,  0.5,  6. , -6. ], dtype=float32)
    """
    xp = namespace(codes)
    _check_codes("codes", codes)
    if is_jax_array(codes):
        table = xp.asarray(E2M1_VALUES)
        return xp.take(table, codes.astype(xp.int32), axis=0, mode="clip")
    return E2M1_VALUES[np.asarray(codes)]


def _check_codes(name: str, codes: Any) -> None:
    if np.dtype(codes.dtype) != np.uint8:
        raise TypeError(f"{name} must be uint8 E2M1 codes, got dtype={np.dtype(codes.dtype)}")
    if not is_jax_array(codes):
        arr = np.asarray(codes)
        if arr.size and arr.max() > 15:
            raise ValueError(f"{name} must be 4-bit codes 0..15, got a value {int(arr.max())}")
