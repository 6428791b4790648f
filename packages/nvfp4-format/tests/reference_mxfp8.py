"""Plain reference for MXFP8 (OCP Microscaling v1.0, E4M3 elements), written from the formulas.

Independent of the package: per-block Python loops, the block exponent from `math.frexp`, E4M3
rounding from the explicit value table of `reference.e4m3_round` (no dtype cast), all in float64
(every float32 input and every x * 2^-e is exact there). Used only by the tests.

    e    = floor(log2 amax) - 8                 "ocp"  (8 = emax of E4M3, whose max is 448 = 1.75 * 2^8)
    e    = min e with 448 * 2^e >= amax         "ceil"
    e    = clamp(e, -127, 119);  -127 for an all-zero block
    elem = sign(x) * e4m3_rne(min(|x| * 2^-e, 448))   saturating; ties to the even mantissa
    x'   = elem * 2^e
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
from reference import e4m3_round, floor_log2

E4M3_MAX = 448.0
MIN_EXPONENT, MAX_EXPONENT = -127, 119  # 119: 448 * 2^119 is the largest finite float32 decode


def mx8_exponent(amax_block: float, scale_rule: str) -> int:
    """Unbiased E8M0 exponent of a block with (finite) amax `amax_block`."""
    if amax_block == 0.0:
        return MIN_EXPONENT
    if scale_rule == "ocp":
        e = floor_log2(amax_block) - 8
    else:
        e = floor_log2(amax_block) - 9  # 448 * 2^e < 2^(e + 9) <= amax here; step up exactly
        while E4M3_MAX * 2.0**e < amax_block:
            e += 1
    return min(max(e, MIN_EXPONENT), MAX_EXPONENT)


def e4m3_signed(v: float) -> float:
    """Nearest E4M3 value of v (ties to even), saturating at +-448; keeps the sign of zero."""
    r = e4m3_round(min(abs(v), E4M3_MAX))
    return -r if math.copysign(1.0, v) < 0 else r


def quantize_mxfp8(x, scale_rule: str = "ocp") -> tuple[np.ndarray, np.ndarray]:
    """Reference MXFP8: (E4M3 element values as float64 [..., K], scale bytes uint8 [..., K/32])."""
    x64 = np.asarray(x).astype(np.float32).astype(np.float64)
    elems = np.zeros(x64.shape, np.float64)
    scales = np.zeros(x64.shape[:-1] + (x64.shape[-1] // 32,), np.uint8)
    for li in np.ndindex(x64.shape[:-1]):
        for b in range(x64.shape[-1] // 32):
            sl = li + (slice(32 * b, 32 * b + 32),)
            e = mx8_exponent(float(np.max(np.abs(x64[sl]))), scale_rule)
            elems[sl] = [e4m3_signed(v * 2.0**-e) for v in x64[sl].tolist()]
            scales[li + (b,)] = e + 127
    return elems, scales


def e4m3_bytes(elems) -> np.ndarray:
    """The float8_e4m3fn array of E4M3 values (exact: each value is representable)."""
    return np.asarray(elems, np.float32).astype(ml_dtypes.float8_e4m3fn)


def dequantize_mxfp8(elems, scales) -> np.ndarray:
    """elem * 2^(byte - 127), in float64, rounded once to float32."""
    e = np.repeat(np.asarray(scales).astype(np.float64) - 127.0, 32, axis=-1)
    return (np.asarray(elems, np.float64) * 2.0**e).astype(np.float32)
