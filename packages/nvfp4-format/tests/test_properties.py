"""Hypothesis properties: pack/unpack, quantize -> dequantize invariants, swizzle round trip."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import nvfp4_format as nf

F32 = np.float32
E4M3_MIN_NORMAL = 2.0**-6


def _finite_f32(lo: float = -1e30, hi: float = 1e30):
    return st.floats(
        float(F32(lo)), float(F32(hi)), width=32, allow_nan=False, allow_infinity=False
    )


@st.composite
def tensors(draw, max_rows: int = 4, max_blocks: int = 3, block_rows: int = 1):
    """float32 [rows, 16*blocks]: per-row magnitude scale times values that include edge cases."""
    rows = draw(st.integers(1, max_rows)) * block_rows
    cols = 16 * draw(st.integers(1, max_blocks))
    x = draw(hnp.arrays(F32, (rows, cols), elements=_finite_f32(-8.0, 8.0)))
    exps = draw(hnp.arrays(np.int32, (rows, 1), elements=st.integers(-30, 30)))
    return (x * np.exp2(exps.astype(F32))).astype(F32)


@given(
    hnp.arrays(
        np.uint8,
        st.tuples(st.integers(1, 4), st.integers(1, 20).map(lambda k: 2 * k)),
        elements=st.integers(0, 15),
    )
)
def test_pack_unpack_round_trip(codes):
    packed = np.asarray(nf.pack_fp4(codes))
    assert packed.shape == codes.shape[:-1] + (codes.shape[-1] // 2,)
    np.testing.assert_array_equal(np.asarray(nf.unpack_fp4(packed)), codes)


@given(hnp.arrays(np.uint8, st.tuples(st.integers(1, 3), st.integers(1, 9))))
def test_unpack_pack_round_trip(packed):
    np.testing.assert_array_equal(np.asarray(nf.pack_fp4(nf.unpack_fp4(packed))), packed)


@given(hnp.arrays(F32, st.integers(1, 64), elements=_finite_f32(-3e38, 3e38)))
def test_encode_agrees_with_ml_dtypes(x):
    want = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    np.testing.assert_array_equal(np.asarray(nf.encode_e2m1(x)), want)


def _block_view(a: np.ndarray, block_rows: int) -> np.ndarray:
    """[rows, cols] -> [n_blocks, block_rows * 16] in block order."""
    r, c = a.shape
    return (
        a.reshape(r // block_rows, block_rows, c // 16, 16)
        .transpose(0, 2, 1, 3)
        .reshape(-1, block_rows * 16)
    )


def _half_step(v: np.ndarray) -> np.ndarray:
    """Half the E2M1 grid spacing around a magnitude v in [0, 6]."""
    return np.where(v <= 2, 0.25, np.where(v <= 4, 0.5, 1.0))


@pytest.mark.parametrize("block_shape", [(1, 16), (16, 16)])
@given(data=st.data())
def test_quantize_dequantize_invariants(block_shape, data):
    br = block_shape[0]
    x = data.draw(tensors(max_rows=4 if br == 1 else 2, block_rows=br))
    a = nf.quantize(x, block_shape=block_shape)
    dq = np.asarray(nf.dequantize(a)).astype(np.float64)
    codes = np.asarray(a.codes())
    s_dec = np.asarray(a.global_scale)
    amax = float(np.abs(x).max())
    s_enc = 1.0 if amax == 0 else min(2688.0 / amax, float(np.finfo(F32).max))
    sb = np.asarray(a.block_scales).astype(F32)
    sb = _block_view(np.repeat(sb, 16, axis=1), br)[:, :1]  # one scale per block
    xb, qb, cb = _block_view(x.astype(np.float64), br), _block_view(dq, br), _block_view(codes, br)
    step = (sb * s_dec).astype(np.float64)  # decode scale of each block, as the spec computes it
    flushed = sb[:, 0] == 0
    # flushed blocks: their scaled amax really rounds to E4M3 zero; all codes 0
    assert (np.abs(xb[flushed]).max(axis=1, initial=0) * s_enc / 6 <= 2.0**-10 * (1 + 1e-6)).all()
    assert not cb[flushed].any()
    live = ~flushed
    # sign bit of every code in a live block is the input's sign bit (also -0 and tiny negatives)
    np.testing.assert_array_equal(cb[live] >> 3, np.signbit(xb[live]).astype(np.uint8))
    # |dq| <= 6 * sb * s_dec
    assert (np.abs(qb) <= 6 * step * (1 + 1e-6)).all()
    # where the decode scale is a normal float32 the encode scale is accurate, so:
    ok = live & (step[:, 0] >= 2.0**-126)
    # error bound: half a grid step times the block decode scale (+ saturation excess, + rounding)
    y = np.abs(xb[ok]) / step[ok]
    bound = (_half_step(np.minimum(y, 6)) + np.maximum(y - 6, 0)) * step[ok]
    assert (np.abs(qb[ok] - xb[ok]) <= bound * (1 + 1e-5) + 1e-45).all()
    # with a normal E4M3 scale the block maximum decodes to +-6 (code 7 or 15)
    normal = ok & (sb[:, 0] >= E4M3_MIN_NORMAL)
    top = cb[np.arange(len(cb)), np.abs(xb).argmax(axis=1)]
    assert np.isin(top[normal], [7, 15]).all()


@pytest.mark.parametrize("block_shape", [(1, 16), (16, 16)])
@given(data=st.data())
def test_requantize_is_idempotent(block_shape, data):
    """quantize(dequantize(q), same global amax) == q in every block with a normal E4M3 scale."""
    br = block_shape[0]
    x = data.draw(tensors(max_rows=4 if br == 1 else 2, block_rows=br))
    amax = F32(np.abs(x).max())
    assume(amax == 0 or amax > 1e-30)  # keeps s_dec and the decoded values normal floats
    a = nf.quantize(x, block_shape=block_shape)
    b = nf.quantize(np.asarray(nf.dequantize(a)), block_shape=block_shape, global_amax=amax)
    assert np.asarray(b.global_scale).tobytes() == np.asarray(a.global_scale).tobytes()
    sa = np.asarray(a.block_scales).astype(np.float64)
    sbb = np.asarray(b.block_scales).astype(np.float64)
    keep = (sa >= E4M3_MIN_NORMAL) | (sa == 0)
    np.testing.assert_array_equal(sbb[keep], sa[keep])
    keep_el = np.repeat(keep, 16, axis=1)
    np.testing.assert_array_equal(np.asarray(b.codes())[keep_el], np.asarray(a.codes())[keep_el])


@given(
    hnp.arrays(
        F32,
        st.tuples(st.integers(1, 3), st.integers(1, 3).map(lambda k: 32 * k)),
        elements=_finite_f32(-1e30, 1e30),
    ),
    st.sampled_from(["ocp", "ceil"]),
)
def test_mxfp4_invariants(x, rule):
    a = nf.quantize_mxfp4(x, rule)
    e = np.asarray(a.scales).astype(np.float64) - 127
    amax = np.abs(x.astype(np.float64)).reshape(x.shape[0], -1, 32).max(axis=-1)
    live = amax > 0
    if rule == "ceil":  # never clips (unless e hit the -127 clamp, which only shrinks 2^e)
        assert (amax[live] <= 6 * 2.0 ** e[live]).all()
    else:
        clamp = e == -127
        assert (amax[live & ~clamp] >= 4 * 2.0 ** e[live & ~clamp]).all()
        assert (amax[live & ~clamp] < 8 * 2.0 ** e[live & ~clamp]).all()
    assert (e[~live] == -127).all()
    dq = np.asarray(nf.dequantize_mxfp4(a)).astype(np.float64)
    scale = np.repeat(2.0**e, 32, axis=1)
    y = np.abs(x.astype(np.float64)) / scale
    bound = (_half_step(np.minimum(y, 6)) + np.maximum(y - 6, 0)) * scale
    assert (np.abs(dq - x) <= bound).all()
    codes = np.asarray(nf.unpack_fp4(a.packed))
    np.testing.assert_array_equal(codes >> 3, np.signbit(x).astype(np.uint8))


@given(
    st.tuples(st.integers(1, 2), st.integers(1, 260), st.integers(1, 11)),
    st.sampled_from([np.uint8, ml_dtypes.float8_e4m3fn]),
    st.integers(0, 2**32 - 1),
)
def test_swizzle_round_trip(shape, dt, seed):
    s = np.random.default_rng(seed).integers(0, 256, shape).astype(np.uint8)
    s = s.view(dt)
    out = np.asarray(nf.swizzle_scales(s))
    assert out.shape == (shape[0], -(-shape[1] // 128) * 128, -(-shape[2] // 4) * 4)
    assert out.dtype == s.dtype
    back = np.asarray(nf.unswizzle_scales(out, shape[1], shape[2]))
    np.testing.assert_array_equal(back.view(np.uint8), s.view(np.uint8))
