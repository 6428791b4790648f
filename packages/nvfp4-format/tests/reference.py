"""Plain NumPy reference for NVFP4 / MXFP4, written from docs spec sections 1, 2, 4, 5 and 6.

Deliberately naive and independent of the package: scalar thresholds taken verbatim from the
spec, an explicit E4M3 value table instead of a dtype cast, per-block Python loops and the
swizzle offset formula applied element by element. Used only by the tests.

Arithmetic that the spec puts in float32 is done with float32 scalars, in the spec's order;
everything else (comparisons against grid thresholds, exact powers of two) is done in float64,
where every float32 / bfloat16 / float16 input is exactly representable.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
ONE_SIXTH = F32(1.0) / F32(6.0)  # the float32 constant 1/6 of spec section 2
E4M3_MAX = 448.0
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_TABLE = np.array(FP4_MAGNITUDES + tuple(-m for m in FP4_MAGNITUDES), dtype=np.float32)


# ----------------------------------------------------------------------------- E2M1 (section 1)
def e2m1_magnitude_code_rne(a: float) -> int:
    """Code 0..7 of a magnitude a >= 0 by the spec's threshold list (ties to even, saturating)."""
    if a <= 0.25:
        return 0
    if a < 0.75:
        return 1
    if a <= 1.25:
        return 2
    if a < 1.75:
        return 3
    if a <= 2.5:
        return 4
    if a < 3.5:
        return 5
    if a <= 5.0:
        return 6
    return 7


def e2m1_magnitude_code_sr(a: float, u: float) -> int:
    """Stochastic rounding of a magnitude: up to the next grid point iff u < (a - lo)/(hi - lo)."""
    if a >= 6.0:
        return 7
    lo_code = max(i for i, m in enumerate(FP4_MAGNITUDES) if m <= a)
    lo, hi = FP4_MAGNITUDES[lo_code], FP4_MAGNITUDES[lo_code + 1]
    return lo_code + 1 if u < (a - lo) / (hi - lo) else lo_code


def encode_e2m1(x, rounding: str = "rne", uniform=None) -> np.ndarray:
    """Element-wise E2M1 codes (uint8) of a float array; sign bit copied from x (so -0.0 -> 8)."""
    x64 = np.asarray(x).astype(np.float64)
    xs = x64.ravel().tolist()
    if rounding == "rne":
        mags = [e2m1_magnitude_code_rne(abs(v)) for v in xs]
    else:
        us = np.asarray(uniform).astype(np.float64).ravel().tolist()
        mags = [e2m1_magnitude_code_sr(abs(v), u) for v, u in zip(xs, us, strict=True)]
    codes = [m | (8 if math.copysign(1.0, v) < 0 else 0) for m, v in zip(mags, xs, strict=True)]
    return np.array(codes, dtype=np.uint8).reshape(x64.shape)


def decode_e2m1(codes) -> np.ndarray:
    """float32 values of E2M1 codes."""
    return E2M1_TABLE[np.asarray(codes).astype(np.int64)]


def pack_fp4(codes) -> np.ndarray:
    """Two codes per byte, even index in the low nibble: byte[j] = c[2j] | c[2j+1] << 4."""
    c = np.asarray(codes).astype(np.uint8)
    out = np.zeros(c.shape[:-1] + (c.shape[-1] // 2,), dtype=np.uint8)
    for j in range(out.shape[-1]):
        out[..., j] = c[..., 2 * j] | (c[..., 2 * j + 1] << 4)
    return out


def unpack_fp4(packed) -> np.ndarray:
    p = np.asarray(packed).astype(np.uint8)
    out = np.zeros(p.shape[:-1] + (2 * p.shape[-1],), dtype=np.uint8)
    out[..., 0::2] = p & 0x0F
    out[..., 1::2] = p >> 4
    return out


# ----------------------------------------------------------------------------- E4M3 by table
def e4m3_positive_values() -> np.ndarray:
    """All finite non-negative float8_e4m3fn values, ascending (bias 7, no inf, S.1111.111 NaN)."""
    vals = [m / 8.0 * 2.0**-6 for m in range(8)]  # subnormals (and zero)
    for e in range(1, 16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            vals.append((1.0 + m / 8.0) * 2.0 ** (e - 7))
    return np.array(vals, dtype=np.float64)


E4M3_POS = e4m3_positive_values()


def e4m3_round(v: float) -> float:
    """Round a value in [0, 448] to the nearest E4M3 value, ties to the even mantissa."""
    if not 0.0 <= v <= E4M3_MAX:
        raise ValueError(f"e4m3_round expects a clipped value in [0, 448], got {v}")
    k = int(np.searchsorted(E4M3_POS, v))  # E4M3_POS[k-1] < v <= E4M3_POS[k]
    if E4M3_POS[k] == v:
        return v
    lo, hi = E4M3_POS[k - 1], E4M3_POS[k]
    if v - lo < hi - v:
        return float(lo)
    if hi - v < v - lo:
        return float(hi)
    return float(lo if (k - 1) % 2 == 0 else hi)  # index parity == mantissa parity


# ----------------------------------------------------------------------------- NVFP4 (section 2)
def global_scales(amax: np.float32) -> tuple[np.float32, np.float32]:
    """(s_enc, s_dec) in float32: s_enc = min(2688/amax, FLT_MAX) (1.0 if amax == 0), s_dec = 1/s_enc."""
    amax = F32(amax)
    if amax == 0 or np.isinf(amax):
        s_enc = F32(1.0)
    else:
        with np.errstate(over="ignore"):
            s_enc = F32(min(F32(2688.0) / amax, FLT_MAX))
    return s_enc, F32(F32(1.0) / s_enc)


def block_scale(amax_block: np.float32, s_enc: np.float32) -> float:
    """sb = e4m3(clip(amax_block * (s_enc * (1/6)), 0, 448)) as a float."""
    scaled = F32(F32(amax_block) * F32(s_enc * ONE_SIXTH))
    return e4m3_round(float(min(max(scaled, F32(0.0)), F32(E4M3_MAX))))


def block_encode_scale(sb: float, s_dec: np.float32) -> np.float32:
    with np.errstate(divide="ignore", over="ignore"):
        return F32(min(F32(1.0) / F32(F32(sb) * s_dec), FLT_MAX))


def quantize_block(xb32: np.ndarray, amax_block, s_enc, s_dec, rounding, ub):
    """Codes and scale for one block (any shape) of float32 values."""
    sb = block_scale(amax_block, s_enc)
    if sb == 0.0:  # the project's documented deviation: flushed blocks get code 0 everywhere
        return np.zeros(xb32.shape, np.uint8), sb
    enc = block_encode_scale(sb, s_dec)
    with np.errstate(over="ignore"):
        y = np.clip((xb32 * enc).astype(np.float32), F32(-6.0), F32(6.0))
    return encode_e2m1(y, rounding, ub), sb


def quantize(x, block_shape=(1, 16), global_amax=None, rounding="rne", uniform=None):
    """Reference NVFP4 quantize: returns (codes uint8[..., K], scales float32[..., K/16], s_dec)."""
    x32 = np.asarray(x).astype(np.float32)
    amax = F32(np.max(np.abs(x32))) if global_amax is None else F32(global_amax)
    s_enc, s_dec = global_scales(amax)
    codes = np.zeros(x32.shape, np.uint8)
    scales = np.zeros(x32.shape[:-1] + (x32.shape[-1] // 16,), np.float32)
    u = None if uniform is None else np.asarray(uniform, dtype=np.float32)
    rows = block_shape[0]
    lead = x32.shape[:-2] if rows == 16 else x32.shape[:-1]
    for li in np.ndindex(lead):
        for r0 in range(0, x32.shape[-2] if rows == 16 else 1, rows):
            for c0 in range(0, x32.shape[-1], 16):
                sl = li + ((slice(r0, r0 + 16),) if rows == 16 else ()) + (slice(c0, c0 + 16),)
                xb = x32[sl]
                ub = None if u is None else u[sl]
                amax_b = F32(np.max(np.abs(xb)))
                codes[sl], sb = quantize_block(xb, amax_b, s_enc, s_dec, rounding, ub)
                ssl = sl[:-1] + (c0 // 16,)
                scales[ssl] = sb
    return codes, scales, s_dec


def dequantize(codes, scales, s_dec) -> np.ndarray:
    """(decode(code) * float32(sb)) * s_dec in float32."""
    sb = np.repeat(np.asarray(scales, np.float32), 16, axis=-1)
    return (decode_e2m1(codes) * sb).astype(np.float32) * F32(s_dec)


# ----------------------------------------------------------------------------- MXFP4 (section 5)
def floor_log2(a: float) -> int:
    """Exact floor(log2(a)) of a positive float (frexp is exact, also for subnormals)."""
    m, e = math.frexp(a)  # a = m * 2**e, 0.5 <= m < 1
    return e - 1


def mx_exponent(amax_block: float, scale_rule: str) -> int:
    """E8M0 exponent e of a block: ocp floor(log2 amax) - 2; ceil min e with 6*2^e >= amax."""
    if amax_block == 0.0:
        return -127
    if scale_rule == "ocp":
        e = floor_log2(amax_block) - 2
    else:
        e = floor_log2(amax_block) - 3  # 6*2^e < amax here; step up exactly
        while 6.0 * 2.0**e < amax_block:
            e += 1
    return min(max(e, -127), 125)  # capped so 6 * 2^e is finite in float32 (see nvfp4_format.mxfp4)


def quantize_mxfp4(x, scale_rule="ocp", rounding="rne", uniform=None):
    """Reference MXFP4: returns (codes uint8[..., K], scale bytes uint8[..., K/32])."""
    x64 = np.asarray(x).astype(np.float32).astype(np.float64)
    u = None if uniform is None else np.asarray(uniform, dtype=np.float32)
    codes = np.zeros(x64.shape, np.uint8)
    scales = np.zeros(x64.shape[:-1] + (x64.shape[-1] // 32,), np.uint8)
    for li in np.ndindex(x64.shape[:-1]):
        for b in range(x64.shape[-1] // 32):
            sl = li + (slice(32 * b, 32 * b + 32),)
            e = mx_exponent(float(np.max(np.abs(x64[sl]))), scale_rule)
            y = np.clip(x64[sl] * 2.0**-e, -6.0, 6.0)  # exact: multiply by a power of two
            codes[sl] = encode_e2m1(y, rounding, None if u is None else u[sl])
            scales[li + (b,)] = e + 127
    return codes, scales


def dequantize_mxfp4(codes, scales) -> np.ndarray:
    e = np.repeat(np.asarray(scales).astype(np.float64) - 127.0, 32, axis=-1)
    return (decode_e2m1(codes).astype(np.float64) * 2.0**e).astype(np.float32)


# ----------------------------------------------------------------------------- swizzle (section 6)
def swizzle_offset(r: int, c: int, cpad: int) -> int:
    rt, ct = r // 128, c // 4
    return (rt * (cpad // 4) + ct) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)


def swizzle_scales(s) -> np.ndarray:
    """[..., rows, cols] -> [..., Rpad, Cpad] whose row-major flattening is the 128x4 layout."""
    s = np.asarray(s)
    rows, cols = s.shape[-2:]
    rpad, cpad = -(-rows // 128) * 128, -(-cols // 4) * 4
    flat = np.zeros(s.shape[:-2] + (rpad * cpad,), dtype=s.dtype)
    for r in range(rows):
        for c in range(cols):
            flat[..., swizzle_offset(r, c, cpad)] = s[..., r, c]
    return flat.reshape(s.shape[:-2] + (rpad, cpad))


# ----------------------------------------------------------------------------- test inputs
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
DISTRIBUTIONS = ("normal", "student_t", "cauchy", "tiny", "huge", "mixed")


def sample(dist: str, shape: tuple[int, ...], dtype, seed: int) -> np.ndarray:
    """Fresh random input of a named distribution, cast to `dtype` (finite in that dtype).

    tiny / huge are ~1e-30 / ~1e30 for float32 and bfloat16, and ~1e-6 (subnormal) / ~1e4 for
    float16, whose range is narrower.
    """
    rng = np.random.default_rng(seed)
    f16 = dtype is np.float16
    if dist == "normal":
        x = rng.standard_normal(shape)
    elif dist == "student_t":
        x = rng.standard_t(3, shape)
    elif dist == "cauchy":
        x = rng.standard_cauchy(shape)
    elif dist == "tiny":
        x = rng.standard_normal(shape) * (1e-6 if f16 else 1e-30)
    elif dist == "huge":
        x = rng.standard_normal(shape) * (1e4 if f16 else 1e30)
    elif dist == "mixed":
        # per-row magnitudes spread over 2^-12 .. 2^12, exact zeros, -0.0 and on-grid values
        x = rng.standard_normal(shape) * np.exp2(rng.integers(-12, 12, shape[:-1] + (1,)))
        x[..., ::7] = 0.0
        x[..., 3::11] = rng.choice([0.5, 1.5, 3.0, -6.0, -0.0], x[..., 3::11].shape)
    else:
        raise ValueError(f"unknown distribution {dist!r}")
    lim = float(ml_dtypes.finfo(dtype).max)
    return np.clip(x, -lim, lim).astype(dtype)


def as_bytes(a) -> np.ndarray:
    """The raw bytes of an array (NumPy or JAX) as flat uint8, so float8 and NaN compare exactly."""
    return np.ascontiguousarray(np.asarray(a)).reshape(-1).view(np.uint8)
