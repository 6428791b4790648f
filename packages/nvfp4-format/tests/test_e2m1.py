"""E2M1 element encode/decode (spec section 1): codes, ties, saturation, sign, ml_dtypes agreement."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import reference as ref

from nvfp4_format import E2M1_VALUES, decode_e2m1, encode_e2m1

# code -> value straight from the spec's table
SPEC_TABLE = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]

# (input, expected code): every RNE tie of spec section 1 and its negative
TIES = [
    (0.25, 0),  # 0 | 0.5 -> even mantissa: 0
    (0.75, 2),  # 0.5 | 1 -> 1
    (1.25, 2),  # 1 | 1.5 -> 1
    (1.75, 4),  # 1.5 | 2 -> 2
    (2.5, 4),  # 2 | 3 -> 2
    (3.5, 6),  # 3 | 4 -> 4
    (5.0, 6),  # 4 | 6 -> 4
]
TIES += [(-x, c | 8) for x, c in TIES]


def test_values_table_matches_spec():
    assert E2M1_VALUES.dtype == np.float32
    assert E2M1_VALUES.shape == (16,)
    np.testing.assert_array_equal(E2M1_VALUES, np.array(SPEC_TABLE, np.float32))
    assert np.signbit(E2M1_VALUES[8]) and not np.signbit(E2M1_VALUES[0])


def test_decode_all_codes():
    codes = np.arange(16, dtype=np.uint8)
    out = np.asarray(decode_e2m1(codes))
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, np.array(SPEC_TABLE, np.float32))
    np.testing.assert_array_equal(np.signbit(out), np.arange(16) >= 8)


def test_decode_keeps_shape():
    codes = np.random.default_rng(0).integers(0, 16, (3, 4, 8)).astype(np.uint8)
    out = np.asarray(decode_e2m1(codes))
    assert out.shape == (3, 4, 8)
    np.testing.assert_array_equal(out, ref.decode_e2m1(codes))


def test_every_code_round_trips(dtype):
    codes = np.arange(16, dtype=np.uint8)
    x = np.array(SPEC_TABLE, np.float32).astype(dtype)
    got = np.asarray(encode_e2m1(x))
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, codes)
    np.testing.assert_array_equal(np.asarray(encode_e2m1(np.asarray(decode_e2m1(codes)))), codes)


@pytest.mark.parametrize(("x", "code"), TIES)
def test_ties_go_to_even(x, code, dtype):
    got = np.asarray(encode_e2m1(np.array([x], dtype)))
    assert got.tolist() == [code], f"tie {x} -> {SPEC_TABLE[got[0]]}, spec says {SPEC_TABLE[code]}"


@pytest.mark.parametrize("mid", [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
def test_one_ulp_either_side_of_each_tie(mid):
    """One float32 ulp off a tie rounds to the nearer neighbour (no double rounding)."""
    below = np.nextafter(np.float32(mid), np.float32(0))
    above = np.nextafter(np.float32(mid), np.float32(10))
    x = np.array([below, above, -below, -above], np.float32)
    got = np.asarray(encode_e2m1(x))
    lo_code = max(i for i in range(8) if SPEC_TABLE[i] < mid)
    assert got.tolist() == [lo_code, lo_code + 1, lo_code | 8, (lo_code + 1) | 8]


@pytest.mark.parametrize(
    ("x", "code"),
    [(6.0, 7), (6.5, 7), (7.0, 7), (100.0, 7), (3.0e38, 7), (-6.0, 15), (-6.01, 15), (-1e30, 15)],
)
def test_saturates_at_six(x, code):
    assert np.asarray(encode_e2m1(np.array([x], np.float32))).tolist() == [code]


@pytest.mark.parametrize(
    ("x", "code"),
    [(0.0, 0), (-0.0, 8), (-1e-30, 8), (-1e-45, 8), (-0.25, 8), (1e-30, 0), (0.25, 0)],
)
def test_sign_bit_kept_for_values_rounding_to_zero(x, code):
    """Sign bit set in the input -> sign bit in the code, also for -0 (matches ml_dtypes)."""
    assert np.asarray(encode_e2m1(np.array([x], np.float32))).tolist() == [code]


def _ml_dtypes_codes(x) -> np.ndarray:
    return np.asarray(x).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)


def test_agrees_with_ml_dtypes_on_every_float16_and_bfloat16():
    """Exhaustive: all 2^16 bit patterns of float16 and bfloat16 (non-finite ones removed)."""
    bits = np.arange(2**16, dtype=np.uint16)
    for dt in (np.float16, ml_dtypes.bfloat16):
        x = bits.view(dt)
        x = x[np.isfinite(x.astype(np.float32))]
        got = np.asarray(encode_e2m1(x))
        np.testing.assert_array_equal(got, _ml_dtypes_codes(x), err_msg=str(dt))
        np.testing.assert_array_equal(got, ref.encode_e2m1(x), err_msg=str(dt))


def test_agrees_with_ml_dtypes_and_reference_on_random_float32(dist):
    x = ref.sample(dist, (64, 64), np.float32, seed=11) * np.float32(1e30 if dist == "tiny" else 1)
    x = np.clip(x, -1e38, 1e38).astype(np.float32)
    got = np.asarray(encode_e2m1(x))
    np.testing.assert_array_equal(got, _ml_dtypes_codes(x))
    np.testing.assert_array_equal(got, ref.encode_e2m1(x))


def test_agrees_on_dense_grid_around_the_thresholds():
    """All float32 values within 64 ulps of every threshold and grid point, both signs."""
    pts = np.array([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6], np.float32)
    bits = pts.view(np.int32)[:, None] + np.arange(-64, 65, dtype=np.int32)[None, :]
    x = bits[bits >= 0].view(np.float32)
    x = np.concatenate([x, -x])
    got = np.asarray(encode_e2m1(x))
    np.testing.assert_array_equal(got, _ml_dtypes_codes(x))
    np.testing.assert_array_equal(got, ref.encode_e2m1(x))
