"""Plain reference for Four Over Six (arXiv 2512.02010) on NVFP4, written from the formulas.

Independent of the package: per-block loops over float32 scalars in the order of spec section 2,
the E4M3 table and E2M1 thresholds of `reference.py`, and each candidate's error computed in
float64 in the ORIGINAL domain from its float32 dequantized values, exactly what a user would
compute (the package measures it in the scaled domain in float32; the two rank the candidates the
same except at near-ties far below float32 resolution, which these tests' inputs avoid):

    s_enc = min(6 * 256 / amax, FLT_MAX)   (1 if amax == 0);  s_dec = 1 / s_enc
    sb_m  = e4m3(clip(amax_block * (s_enc * (1/m)), 0, 448))  for m = 6 and m = 4
    q_m   = e2m1(clip(x * min(1 / (sb_m * s_dec), FLT_MAX), -6, 6))   (all 0 if sb_m == 0)
    x'_m  = (e2m1_value(q_m) * sb_m) * s_dec      float32, as `dequantize` computes it
    keep m = 4 iff err(x'_4) < err(x'_6): "mse" sum (x - x')^2, "l1" sum |x - x'|, "max_abs" max
"""

from __future__ import annotations

import numpy as np
import reference as ref

F32 = np.float32
FOUR_OVER_SIX_E4M3_MAX = 256.0


def global_scales(amax) -> tuple[np.float32, np.float32]:
    """(s_enc, s_dec) with 6 * 256 = 1536 in place of 2688."""
    amax = F32(amax)
    if amax == 0 or np.isinf(amax):
        s_enc = F32(1.0)
    else:
        with np.errstate(over="ignore"):
            s_enc = F32(min(F32(1536.0) / amax, ref.FLT_MAX))
    return s_enc, F32(F32(1.0) / s_enc)


def block_scale(amax_block, s_enc, m: int) -> float:
    """e4m3(clip(amax_block * (s_enc * (1/m)), 0, 448)); 1/m the float32 constant."""
    scaled = F32(F32(amax_block) * F32(s_enc * (F32(1.0) / F32(m))))
    return ref.e4m3_round(float(min(max(scaled, F32(0.0)), F32(ref.E4M3_MAX))))


def candidate(xb32, amax_block, s_enc, s_dec, m: int, rounding="rne", ub=None):
    """(codes, sb, dequantized float32 values) of one block (any shape) for the m-candidate."""
    sb = block_scale(amax_block, s_enc, m)
    if sb == 0.0:
        codes = np.zeros(xb32.shape, np.uint8)
    else:
        enc = ref.block_encode_scale(sb, s_dec)
        with np.errstate(over="ignore"):
            y = np.clip((xb32 * enc).astype(F32), F32(-6.0), F32(6.0))
        codes = ref.encode_e2m1(y, rounding, ub)
    deq = (ref.decode_e2m1(codes) * F32(sb)).astype(F32) * F32(s_dec)
    return codes, sb, deq.astype(F32)


def block_error(xb, deq, metric: str) -> float:
    d = np.asarray(xb, np.float64) - np.asarray(deq, np.float64)
    if metric == "mse":
        return float(np.sum(d * d))
    if metric == "l1":
        return float(np.sum(np.abs(d)))
    return float(np.max(np.abs(d)))


def quantize(x, block_shape=(1, 16), global_amax=None, metric="mse", rounding="rne", uniform=None):
    """Reference 4/6 NVFP4: (codes uint8 [..., K], scales float32 [..., K/16], s_dec, chose4).

    `chose4` is a bool per block ([..., K/16], tile flags repeated over the tile's rows).
    Stochastic rounding: the choice is made on the RNE candidates, then the chosen scale encodes
    with `uniform`.
    """
    x32 = np.asarray(x).astype(F32)
    amax = F32(np.max(np.abs(x32))) if global_amax is None else F32(global_amax)
    s_enc, s_dec = global_scales(amax)
    codes = np.zeros(x32.shape, np.uint8)
    scales = np.zeros(x32.shape[:-1] + (x32.shape[-1] // 16,), F32)
    chose4 = np.zeros(scales.shape, bool)
    u = None if uniform is None else np.asarray(uniform, F32)
    rows = block_shape[0]
    lead = x32.shape[:-2] if rows == 16 else x32.shape[:-1]
    for li in np.ndindex(lead):
        for r0 in range(0, x32.shape[-2] if rows == 16 else 1, rows):
            for c0 in range(0, x32.shape[-1], 16):
                sl = li + ((slice(r0, r0 + 16),) if rows == 16 else ()) + (slice(c0, c0 + 16),)
                xb = x32[sl]
                amax_b = F32(np.max(np.abs(xb)))
                c6, sb6, d6 = candidate(xb, amax_b, s_enc, s_dec, 6)
                c4, sb4, d4 = candidate(xb, amax_b, s_enc, s_dec, 4)
                four = block_error(xb, d4, metric) < block_error(xb, d6, metric)
                m, sb, c = (4, sb4, c4) if four else (6, sb6, c6)
                if rounding == "stochastic":
                    c, _, _ = candidate(xb, amax_b, s_enc, s_dec, m, "stochastic", u[sl])
                codes[sl] = c
                ssl = sl[:-1] + (c0 // 16,)
                scales[ssl] = sb
                chose4[ssl] = four
    return codes, scales, s_dec, chose4


def candidates_dequantized(x, m: int, global_amax=None, block_shape=(1, 16)) -> np.ndarray:
    """float32 dequantization of x with every block forced to the m-candidate (same s_enc)."""
    x32 = np.asarray(x).astype(F32)
    amax = F32(np.max(np.abs(x32))) if global_amax is None else F32(global_amax)
    s_enc, s_dec = global_scales(amax)
    out = np.zeros(x32.shape, F32)
    rows = block_shape[0]
    lead = x32.shape[:-2] if rows == 16 else x32.shape[:-1]
    for li in np.ndindex(lead):
        for r0 in range(0, x32.shape[-2] if rows == 16 else 1, rows):
            for c0 in range(0, x32.shape[-1], 16):
                sl = li + ((slice(r0, r0 + 16),) if rows == 16 else ()) + (slice(c0, c0 + 16),)
                xb = x32[sl]
                out[sl] = candidate(xb, F32(np.max(np.abs(xb))), s_enc, s_dec, m)[2]
    return out
