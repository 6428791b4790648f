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

# RNE decision points between neighbouring magnitudes. A tie goes to the even mantissa, so the
# comparison is `>` where the lower neighbour is even (0, 1, 2, 4) and `>=` where it is odd.
_RNE_STRICT = (0.25, 1.25, 2.5, 5.0)  # ties round down (to 0, 1, 2, 4)
_RNE_INCLUSIVE = (0.75, 1.75, 3.5)  # ties round up (to 1, 2, 4)
_GRID = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes 1..7


def _magnitude_rne(xp: Any, a: Any) -> Any:
    """Code magnitude 0..7 of |x| = `a` (float32, >= 0), round to nearest, ties to even."""
    code = xp.zeros(a.shape, dtype=xp.uint8)
    for t in _RNE_STRICT:
        code = code + (a > t).astype(xp.uint8)
    for t in _RNE_INCLUSIVE:
        code = code + (a >= t).astype(xp.uint8)
    return code


def _magnitude_stochastic(xp: Any, a: Any, uniform: Any) -> Any:
    """Code magnitude of `a` rounded down or up with P(up) = (a - lo) / (hi - lo)."""
    lo_code = xp.zeros(a.shape, dtype=xp.uint8)
    for t in _GRID:
        lo_code = lo_code + (a >= t).astype(xp.uint8)
    # lo and the gap to the next grid point, both exact in float32, selected without a gather.
    lo = xp.where(a < 2.0, xp.floor(a * 2.0) * 0.5, xp.where(a < 4.0, xp.floor(a), 4.0))
    lo = xp.where(a >= 6.0, 6.0, lo).astype(xp.float32)
    gap = xp.where(a < 2.0, 0.5, xp.where(a < 4.0, 1.0, 2.0)).astype(xp.float32)
    p_up = (a - lo) / gap  # exact: a - lo is exact (Sterbenz) and gap is a power of two
    return lo_code + (uniform.astype(xp.float32) < p_up).astype(xp.uint8)


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
    x = xp.asarray(x, dtype=xp.float32)
    a = xp.minimum(xp.abs(x), E2M1_MAX)
    if rounding == "stochastic":
        check_uniform("uniform", uniform, tuple(x.shape))
        magnitude = _magnitude_stochastic(xp, a, uniform)
    else:
        magnitude = _magnitude_rne(xp, a)
    sign = xp.signbit(x).astype(xp.uint8) << 3
    return magnitude | sign


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
