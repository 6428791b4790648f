"""MXFP4 (spec section 5): block 32 along the last axis, E8M0 power-of-two scales, both rules."""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
from reference import as_bytes

from nvfp4_format import MXFP4Array, dequantize_mxfp4, quantize_mxfp4, unpack_fp4

# Golden blocks, one per row (rest of each row zero). Hand derivation, per row:
#   ocp:  e = floor(log2 amax) - 2;  ceil: smallest e with 6 * 2^e >= amax; byte = e + 127.
#   elements: e2m1(x * 2^-e), RNE, saturating at 6.
GOLDEN_ROWS = [
    # values at the head of the row,  ocp (byte, codes),            ceil (byte, codes)
    # amax 6: floor(log2 6) = 2 -> e = 0; ceil: 6*2^0 = 6 >= 6 -> e = 0
    ([6.0, -6.0, 0.5], (127, [7, 15, 1]), (127, [7, 15, 1])),
    # amax 7: ocp e = 0, 7 clips to 6, 3.5 is a tie -> 4; ceil: 6 < 7 -> e = 1: 3.5 -> 4 (code 6),
    # 1.75 -> 2 (tie, code 4), -0.5 -> code 9
    ([7.0, 3.5, -1.0], (127, [7, 6, 10]), (128, [6, 4, 9])),
    # amax 1: ocp e = 0 - 2 = -2 (x4): 4, 0.5, -0.25 -> tie to -0; ceil: 1.5 >= 1 > 0.75 -> e = -2
    ([1.0, 0.125, -0.0625], (125, [6, 1, 8]), (125, [6, 1, 8])),
    # amax 0.75: floor(log2 .75) = -1 -> e = -3 (x8): 6, -2.5 tie -> -2; ceil: 0.75 >= 0.75 -> e = -3
    ([0.75, -0.3125], (124, [7, 12]), (124, [7, 12])),
    # amax 12: ocp e = 3 - 2 = 1: 12/2 = 6, 5/2 = 2.5 tie -> 2; ceil: 6*2 = 12 >= 12 -> e = 1
    ([12.0, 5.0], (128, [7, 4]), (128, [7, 4])),
    # amax 13: ocp e = 1: 6.5 clips to 6, -1; ceil: 12 < 13 -> e = 2: 3.25 -> 3 (code 5), -0.5
    ([13.0, -2.0], (128, [7, 10]), (129, [5, 9])),
    # all zero: byte 0, codes 0
    ([0.0], (0, [0]), (0, [0])),
    # amax 2^100: ocp e = 98 (x2^-98 -> 4); ceil: 6*2^97 < 2^100 <= 6*2^98 -> e = 98
    ([2.0**100, -(2.0**99)], (225, [6, 12]), (225, [6, 12])),
    # amax 2^-126 (smallest normal): ocp e = -128 and ceil e = -128 both clamp to -127 (byte 0,
    # value 2^-127): 2^-126 * 2^127 = 2 -> code 4
    ([2.0**-126, -(2.0**-127)], (0, [4, 10]), (0, [4, 10])),
    # amax 2^-140: e clamps to -127; 2^-140 * 2^127 = 2^-13 -> 0
    ([2.0**-140], (0, [0]), (0, [0])),
]


def _golden_input() -> np.ndarray:
    x = np.zeros((len(GOLDEN_ROWS), 32), np.float32)
    for i, (head, _, _) in enumerate(GOLDEN_ROWS):
        x[i, : len(head)] = head
    return x


@pytest.mark.parametrize("rule", ["ocp", "ceil"])
def test_golden_blocks(rule):
    a = quantize_mxfp4(_golden_input(), scale_rule=rule)
    col = 1 if rule == "ocp" else 2
    scales = np.asarray(a.scales)
    assert scales.dtype == np.uint8 and scales.shape == (len(GOLDEN_ROWS), 1)
    codes = np.asarray(unpack_fp4(a.packed))
    for i, row in enumerate(GOLDEN_ROWS):
        byte, head = row[col]
        assert scales[i, 0] == byte, f"row {i} ({rule}): scale byte {scales[i, 0]}, expected {byte}"
        assert codes[i, : len(head)].tolist() == head, f"row {i} ({rule})"
        assert not codes[i, len(head) :].any()


def test_golden_packed_bytes_and_dequantize():
    a = quantize_mxfp4(_golden_input(), scale_rule="ceil")
    packed = np.asarray(a.packed)
    assert packed.shape == (len(GOLDEN_ROWS), 16)
    # row 1 (ceil): codes 6, 4, 9, 0 -> bytes 6 | 4<<4 = 0x46, 9 | 0<<4 = 0x09
    assert packed[1, :3].tolist() == [0x46, 0x09, 0x00]
    dq = np.asarray(dequantize_mxfp4(a))
    assert dq.dtype == np.float32
    # row 1: [4, 2, -0.5] * 2^1; row 5: [3, -0.5] * 2^2; row 8: [2, -1] * 2^-127
    assert dq[1, :3].tolist() == [8.0, 4.0, -1.0]
    assert dq[5, :2].tolist() == [12.0, -2.0]
    assert dq[8, :2].tolist() == [2.0**-126, -(2.0**-127)]


def test_container_fields():
    x = ref.sample("normal", (2, 3, 64), np.float32, 1)
    a = quantize_mxfp4(x, scale_rule="ceil")
    assert isinstance(a, MXFP4Array)
    assert tuple(a.shape) == (2, 3, 64)
    assert a.scale_rule == "ceil"
    assert np.asarray(a.packed).shape == (2, 3, 32)
    assert np.asarray(a.scales).shape == (2, 3, 2)


@pytest.mark.parametrize("rule", ["ocp", "ceil"])
def test_matches_reference(dist, dtype, rule):
    x = ref.sample(dist, (3, 4, 64), dtype, 17)
    a = quantize_mxfp4(x, scale_rule=rule)
    codes, scales = ref.quantize_mxfp4(x, rule)
    np.testing.assert_array_equal(np.asarray(a.scales), scales, err_msg="scale bytes")
    np.testing.assert_array_equal(np.asarray(a.packed), ref.pack_fp4(codes), err_msg="packed")
    dq = np.asarray(dequantize_mxfp4(a))
    np.testing.assert_array_equal(as_bytes(dq), as_bytes(ref.dequantize_mxfp4(codes, scales)))


@pytest.mark.parametrize("rule", ["ocp", "ceil"])
def test_stochastic_matches_reference(rule):
    x = ref.sample("student_t", (8, 96), np.float32, 18)
    u = np.random.default_rng(19).random(x.shape, dtype=np.float32)
    a = quantize_mxfp4(x, scale_rule=rule, rounding="stochastic", uniform=u)
    codes, scales = ref.quantize_mxfp4(x, rule, "stochastic", u)
    np.testing.assert_array_equal(np.asarray(a.scales), scales)
    np.testing.assert_array_equal(np.asarray(a.packed), ref.pack_fp4(codes))


@pytest.mark.parametrize("k", range(-20, 21, 3))
def test_ceil_rule_boundary_is_exact(k):
    """amax = 6*2^k exactly -> e = k; one float32 ulp above -> e = k + 1 (computed exactly)."""
    at = np.float32(6 * 2.0**k)
    above = np.nextafter(at, np.float32(np.inf))
    x = np.zeros((2, 32), np.float32)
    x[0, 0], x[1, 0] = at, above
    got = np.asarray(quantize_mxfp4(x, scale_rule="ceil").scales)[:, 0].tolist()
    assert got == [k + 127, k + 128]


@pytest.mark.parametrize("k", range(-20, 21, 3))
def test_ocp_rule_boundary_is_exact(k):
    """amax = 2^k -> e = k - 2; one ulp below -> e = k - 3."""
    at = np.float32(2.0**k)
    below = np.nextafter(at, np.float32(0))
    x = np.zeros((2, 32), np.float32)
    x[0, 5], x[1, 5] = -at, below
    got = np.asarray(quantize_mxfp4(x, scale_rule="ocp").scales)[:, 0].tolist()
    assert got == [k - 2 + 127, k - 3 + 127]


def test_ceil_never_clips_and_ocp_lands_in_four_to_eight():
    x = ref.sample("cauchy", (64, 128), np.float32, 23)
    amax = np.abs(x).reshape(64, 4, 32).max(axis=-1).astype(np.float64)
    e_ceil = np.asarray(quantize_mxfp4(x, scale_rule="ceil").scales).astype(np.float64) - 127
    e_ocp = np.asarray(quantize_mxfp4(x, scale_rule="ocp").scales).astype(np.float64) - 127
    assert (amax <= 6 * 2.0**e_ceil).all() and (amax > 3 * 2.0**e_ceil).all()
    assert (amax >= 4 * 2.0**e_ocp).all() and (amax < 8 * 2.0**e_ocp).all()


@pytest.mark.parametrize("out_dtype", [np.float32, np.float16])
def test_dequantize_dtype(out_dtype):
    x = ref.sample("normal", (2, 64), np.float32, 29)
    a = quantize_mxfp4(x, "ceil")
    codes, scales = ref.quantize_mxfp4(x, "ceil")
    dq = np.asarray(dequantize_mxfp4(a, dtype=out_dtype))
    assert dq.dtype == np.dtype(out_dtype)
    expect = ref.dequantize_mxfp4(codes, scales).astype(out_dtype)
    np.testing.assert_array_equal(as_bytes(dq), as_bytes(expect))


@pytest.mark.parametrize("rule", ["ocp", "ceil"])
def test_huge_blocks_decode_finite(rule):
    """The exponent is capped at 125 so 6 * 2^e stays finite: a block near FLT_MAX clips, never Inf."""
    x = np.zeros((1, 32), np.float32)
    x[0, :2] = [3e38, -3.3e38]
    q = quantize_mxfp4(x, rule)
    assert int(q.scales[0, 0]) - 127 == 125
    out = dequantize_mxfp4(q)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[0, :2], np.float32([6 * 2.0**125, -6 * 2.0**125]))
