"""MXFP8 (OCP MX v1.0): E4M3 elements, blocks of 32 along the last axis, E8M0 scales, both rules."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
import reference as ref
import reference_mxfp8 as ref8
from reference import as_bytes

from nvfp4_format import MXFP8Array, dequantize_mxfp8, quantize_mxfp8

E4M3 = ml_dtypes.float8_e4m3fn
FINITE_CODES = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)  # 0x7F/0xFF NaN
FINITE_VALUES = FINITE_CODES.view(E4M3).astype(np.float32)

# Golden blocks, one per row (rest of each row zero). Hand derivation, per row:
#   ocp:  e = floor(log2 amax) - 8;  ceil: smallest e with 448 * 2^e >= amax;  byte = e + 127,
#   e clamped to [-127, 119].  Elements: e4m3(x * 2^-e), RNE, saturating at 448.
#   E4M3 spacing: 2^-9 below 2^-6 (subnormals), then 2^(E-3) in [2^E, 2^(E+1)): 2 in [16, 32),
#   8 in [64, 128), 16 in [128, 256), 32 in [256, 448].
GOLDEN_ROWS = [
    # values at the head of the row,     ocp (byte, elements),        ceil (byte, elements)
    # amax 448: floor(log2 448) = 8 -> e = 0; ceil: 448 * 2^0 >= 448 -> e = 0
    ([448.0, -448.0, 1.0], (127, [448, -448, 1]), (127, [448, -448, 1])),
    # amax 500: ocp e = 0: 500 SATURATES to 448; 250 -> neighbours 240 / 256 -> 256; -3 exact.
    #   ceil: 448 < 500 <= 896 -> e = 1: 250 -> 256; 125 -> 120 / 128 -> 128; -1.5 exact
    ([500.0, 250.0, -3.0], (127, [448, 256, -3]), (128, [256, 128, -1.5])),
    # amax 1: ocp e = 0 - 8 = -8 (x256): 256, 16, -0.5; ceil: 0.875 < 1 <= 1.75 -> e = -8
    ([1.0, 0.0625, -(2.0**-9)], (119, [256, 16, -0.5]), (119, [256, 16, -0.5])),
    # amax 448, e = 0, ties: 17 -> 16 (even mantissa .000), 19 -> 20 (.010); 1.5 * 2^-9 -> 2^-8
    #   (subnormal mantissas 1 | 2 -> 2); 2^-10 -> 0 and -2^-10 -> -0 (mantissas 0 | 1 -> 0)
    (
        [448.0, 17.0, 19.0, 1.5 * 2.0**-9, 2.0**-10, -(2.0**-10)],
        (127, [448, 16, 20, 2.0**-8, 0, -0.0]),
        (127, [448, 16, 20, 2.0**-8, 0, -0.0]),
    ),
    # amax 480: ocp e = 0 -> saturates to 448, 300 -> 288 / 320 -> 288; ceil e = 1 -> 240 exact,
    #   150 -> 144 / 160 -> 144
    ([480.0, 300.0], (127, [448, 288]), (128, [240, 144])),
    # all zero: byte 0 (e = -127), elements 0
    ([0.0], (0, [0]), (0, [0])),
    # amax 2^-126: ocp e = -134 and ceil e = -134 both clamp to -127 (byte 0): x * 2^127 = 2, -1
    ([2.0**-126, -(2.0**-127)], (0, [2, -1]), (0, [2, -1])),
    # amax 2^-140: e clamps to -127; 2^-140 * 2^127 = 2^-13 < 2^-10 -> 0
    ([2.0**-140], (0, [0]), (0, [0])),
    # amax 3e38: ocp e = 127 - 8 = 119 (byte 246); ceil would be 120 -> capped at 119:
    #   3e38 / 2^119 = 451.4 -> saturates to 448 (decodes to 448 * 2^119 = 2.98e38, finite)
    ([3e38, -(2.0**119)], (246, [448, -1]), (246, [448, -1])),
    # amax 3: ocp e = 1 - 8 = -7 (x128): 384, -64; ceil: 1.75 < 3 <= 3.5 -> e = -7
    ([3.0, -0.5], (120, [384, -64]), (120, [384, -64])),
]


def _golden_input() -> np.ndarray:
    x = np.zeros((len(GOLDEN_ROWS), 32), np.float32)
    for i, (head, _, _) in enumerate(GOLDEN_ROWS):
        x[i, : len(head)] = head
    return x


@pytest.mark.parametrize("rule", ["ocp", "ceil"])
def test_golden_blocks(rule):
    a = quantize_mxfp8(_golden_input(), scale_rule=rule)
    col = 1 if rule == "ocp" else 2
    scales, data = np.asarray(a.scales), np.asarray(a.data)
    assert scales.dtype == np.uint8 and scales.shape == (len(GOLDEN_ROWS), 1)
    assert data.dtype == E4M3 and data.shape == (len(GOLDEN_ROWS), 32)
    dq = np.asarray(dequantize_mxfp8(a))
    for i, row in enumerate(GOLDEN_ROWS):
        byte, head = row[col]
        assert scales[i, 0] == byte, f"row {i} ({rule}): scale byte {scales[i, 0]}, expected {byte}"
        got = data[i, : len(head)].astype(np.float32)
        want = np.array(head, np.float32)
        np.testing.assert_array_equal(as_bytes(got), as_bytes(want), err_msg=f"row {i} ({rule})")
        assert not data[i, len(head) :].astype(np.float32).any()
        expect_dq = (want.astype(np.float64) * 2.0 ** (byte - 127)).astype(np.float32)
        np.testing.assert_array_equal(as_bytes(dq[i, : len(head)]), as_bytes(expect_dq))
    assert np.isfinite(dq).all()


@pytest.mark.parametrize("rule", ["ocp", "ceil"])
def test_matches_reference(dist, dtype, rule):
    x = ref.sample(dist, (3, 2, 96), dtype, 31)
    a = quantize_mxfp8(x, scale_rule=rule)
    elems, scales = ref8.quantize_mxfp8(x, rule)
    np.testing.assert_array_equal(np.asarray(a.scales), scales, err_msg="scale bytes")
    np.testing.assert_array_equal(as_bytes(a.data), as_bytes(ref8.e4m3_bytes(elems)), "elements")
    dq = np.asarray(dequantize_mxfp8(a))
    np.testing.assert_array_equal(as_bytes(dq), as_bytes(ref8.dequantize_mxfp8(elems, scales)))


# ----------------------------------------------------------------------------- E4M3 exhaustive
def _all_codes_input() -> tuple[np.ndarray, np.ndarray]:
    """Rows of 32: 448 first (so e = 0 under both rules), then 31 finite E4M3 values in turn."""
    rows = -(-FINITE_CODES.size // 31)
    codes = np.zeros((rows, 32), np.uint8)
    codes[:, 0] = 0x7E  # 448
    codes[:, 1:].reshape(-1)[: FINITE_CODES.size] = FINITE_CODES
    return codes.view(E4M3).astype(np.float32), codes


@pytest.mark.parametrize("rule", ["ocp", "ceil"])
@pytest.mark.parametrize("k", [-110, -20, 0, 7, 100])
def test_every_finite_e4m3_code_round_trips(rule, k):
    """All 254 finite E4M3 codes (+0 and -0 included) times 2^k: byte 127 + k, the same codes back,
    and dequantize gives back x exactly."""
    x0, codes = _all_codes_input()
    assert FINITE_CODES.size == 254 and np.isfinite(FINITE_VALUES).all()
    x = (x0.astype(np.float64) * 2.0**k).astype(np.float32)
    a = quantize_mxfp8(x, scale_rule=rule)
    assert (np.asarray(a.scales) == 127 + k).all()
    np.testing.assert_array_equal(np.asarray(a.data).view(np.uint8), codes)
    np.testing.assert_array_equal(as_bytes(dequantize_mxfp8(a)), as_bytes(x))


def test_every_midpoint_rounds_half_to_even():
    """Each midpoint between neighbouring E4M3 values (scale 2^0) goes to the even mantissa."""
    pos = ref.E4M3_POS
    mids = ((pos[1:] + pos[:-1]) / 2).astype(np.float32)
    assert (mids.astype(np.float64) == (pos[1:] + pos[:-1]) / 2).all()  # exact in float32
    vals = np.concatenate([mids, -mids])
    x = np.zeros((-(-vals.size // 31), 32), np.float32)
    x[:, 0] = 448.0
    x[:, 1:].reshape(-1)[: vals.size] = vals
    a = quantize_mxfp8(x)
    got = np.asarray(a.data)[:, 1:].reshape(-1)[: vals.size]
    mantissa = got.view(np.uint8) & 0x07
    assert (mantissa % 2 == 0).all(), "a midpoint rounded to an odd mantissa"
    elems, _ = ref8.quantize_mxfp8(x)
    np.testing.assert_array_equal(as_bytes(a.data), as_bytes(ref8.e4m3_bytes(elems)))
    # spot checks: 1.0625 (between 1 and 1.125) -> 1; 1.1875 (1.125 | 1.25) -> 1.25; 464 is not a
    # midpoint (448 is the largest) but saturates
    y = np.zeros((1, 32), np.float32)
    y[0, :4] = [448, 1.0625, 1.1875, -1.0625]
    assert np.asarray(quantize_mxfp8(y).data)[0, :4].astype(np.float32).tolist() == [
        448,
        1.0,
        1.25,
        -1.0,
    ]


def test_subnormal_elements():
    """Scale 2^0 (amax 448): k * 2^-9 (k = 1..7) exact; (k + 1/2) * 2^-9 -> even k; 7.5 -> 2^-6."""
    k = np.arange(1, 8, dtype=np.float32)
    x = np.zeros((2, 32), np.float32)
    x[:, 0] = 448.0
    x[0, 1:8] = k * 2.0**-9
    x[1, 1:8] = (k + 0.5) * 2.0**-9
    x[1, 8] = -0.25 * 2.0**-9  # below half the smallest subnormal -> -0
    a = quantize_mxfp8(x)
    data = np.asarray(a.data).astype(np.float32)
    np.testing.assert_array_equal(data[0, 1:8], k * 2.0**-9)
    # 1.5 -> 2, 2.5 -> 2, 3.5 -> 4, 4.5 -> 4, 5.5 -> 6, 6.5 -> 6, 7.5 -> 8 (= 2^-6, the min normal)
    np.testing.assert_array_equal(data[1, 1:8], np.float32([2, 2, 4, 4, 6, 6, 8]) * 2.0**-9)
    assert data[1, 8] == 0 and np.signbit(data[1, 8])
    bytes_ = np.asarray(a.data).view(np.uint8)
    assert bytes_[0, 1:8].tolist() == list(range(1, 8))  # subnormal codes 0x01..0x07
    assert bytes_[1, 7] == 0x08  # 2^-6: exponent field 1, mantissa 0


# ----------------------------------------------------------------------------- saturation
def test_values_beyond_448_saturate_not_overflow():
    """ocp: amax in [256 * 2^e, 512 * 2^e) -> block max up to 511.99 * 2^e, clipped to 448.

    A bare float8_e4m3fn cast of 500 is NaN (no Inf in E4M3): the quantizer clips first.
    """
    assert np.isnan(np.float32(500).astype(E4M3).astype(np.float32))
    x = np.zeros((1, 32), np.float32)
    x[0, :5] = [511.0, -500.0, 464.0, 449.0, 440.0]
    a = quantize_mxfp8(x, "ocp")
    assert int(a.scales[0, 0]) == 127
    assert np.asarray(a.data)[0, :5].astype(np.float32).tolist() == [448, -448, 448, 448, 448]
    assert np.isfinite(np.asarray(dequantize_mxfp8(a))).all()
    # "ceil" never saturates: e = 1 and 511 / 2 = 255.5 -> 256, 500 / 2 = 250 -> 256
    c = quantize_mxfp8(x, "ceil")
    assert int(c.scales[0, 0]) == 128
    assert np.asarray(c.data)[0, :2].astype(np.float32).tolist() == [256, -256]


def test_ceil_never_saturates_and_ocp_lands_in_256_to_512():
    x = ref.sample("cauchy", (64, 128), np.float32, 37)
    amax = np.abs(x).reshape(64, 4, 32).max(axis=-1).astype(np.float64)
    e_ceil = np.asarray(quantize_mxfp8(x, "ceil").scales).astype(np.float64) - 127
    e_ocp = np.asarray(quantize_mxfp8(x, "ocp").scales).astype(np.float64) - 127
    assert (amax <= 448 * 2.0**e_ceil).all() and (amax > 224 * 2.0**e_ceil).all()
    assert (amax >= 256 * 2.0**e_ocp).all() and (amax < 512 * 2.0**e_ocp).all()


@pytest.mark.parametrize("k", range(-100, 101, 25))
def test_ceil_rule_boundary_is_exact(k):
    """amax = 448 * 2^k exactly -> e = k; one float32 ulp above -> e = k + 1."""
    at = np.float32(448 * 2.0**k)
    above = np.nextafter(at, np.float32(np.inf))
    x = np.zeros((2, 32), np.float32)
    x[0, 3], x[1, 3] = at, -above
    assert np.asarray(quantize_mxfp8(x, "ceil").scales)[:, 0].tolist() == [k + 127, k + 128]


@pytest.mark.parametrize("k", range(-100, 101, 25))
def test_ocp_rule_boundary_is_exact(k):
    """amax = 2^k -> e = k - 8; one ulp below -> e = k - 9."""
    at = np.float32(2.0**k)
    below = np.nextafter(at, np.float32(0))
    x = np.zeros((2, 32), np.float32)
    x[0, 31], x[1, 31] = -at, below
    assert np.asarray(quantize_mxfp8(x, "ocp").scales)[:, 0].tolist() == [k - 8 + 127, k - 9 + 127]


@pytest.mark.parametrize("rule", ["ocp", "ceil"])
def test_exponent_bounds(rule):
    """E8M0 bytes stay in 0..246 (e in [-127, 119]) over the whole float32 range; 255 never
    appears for finite input; the extremes decode finite."""
    exps = np.arange(-149, 128)
    x = np.zeros((exps.size, 32), np.float32)
    x[:, 0] = np.ldexp(np.float32(1.5), exps).astype(np.float32)
    x[-1, 0] = np.finfo(np.float32).max
    a = quantize_mxfp8(x, rule)
    s = np.asarray(a.scales)[:, 0].astype(int)
    assert s.min() == 0 and s.max() == 246
    assert (np.diff(s) >= 0).all()  # monotone in the block amax
    out = np.asarray(dequantize_mxfp8(a))
    assert np.isfinite(out).all()
    assert out[-1, 0] == np.float32(448 * 2.0**119)  # FLT_MAX saturates at the capped exponent
    elems, scales = ref8.quantize_mxfp8(x, rule)
    np.testing.assert_array_equal(np.asarray(a.scales), scales)
    np.testing.assert_array_equal(as_bytes(a.data), as_bytes(ref8.e4m3_bytes(elems)))


# ----------------------------------------------------------------------------- zeros, NaN, Inf
def test_zero_blocks_and_signed_zero():
    x = ref.sample("normal", (3, 64), np.float32, 41)
    x[1, 32:] = 0.0
    x[2, :32] = -0.0
    a = quantize_mxfp8(x)
    s = np.asarray(a.scales)
    assert s[1, 1] == 0 and s[2, 0] == 0 and (s[0] != 0).all()
    data = np.asarray(a.data)
    assert (data[1, 32:].view(np.uint8) == 0x00).all()
    assert (data[2, :32].view(np.uint8) == 0x80).all()  # -0 keeps its sign, as in MXFP4
    dq = np.asarray(dequantize_mxfp8(a))
    np.testing.assert_array_equal(as_bytes(dq[1, 32:]), as_bytes(np.zeros(32, np.float32)))
    np.testing.assert_array_equal(as_bytes(dq[2, :32]), as_bytes(np.full(32, -0.0, np.float32)))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_numpy_input_raises(bad):
    x = np.ones((2, 64), np.float32)
    x[1, 40] = bad
    with pytest.raises(ValueError, match=r"non-finite.*\(1, 40\)"):
        quantize_mxfp8(x)


def test_nan_scale_byte_decodes_its_block_to_nan():
    """A container whose scale byte is 255 (the JAX path's mark for non-finite input) decodes
    that block, and only that block, to NaN."""
    a = quantize_mxfp8(np.ones((1, 64), np.float32))
    scales = np.asarray(a.scales).copy()
    scales[0, 1] = 255
    out = np.asarray(dequantize_mxfp8(MXFP8Array(a.data, scales, a.shape, a.scale_rule)))
    assert np.isnan(out[0, 32:]).all() and (out[0, :32] == 1).all()


# ----------------------------------------------------------------------------- shapes, container
@pytest.mark.parametrize("shape", [(4, 48), (100,), (2, 3, 31)])
def test_k_not_a_multiple_of_32(shape):
    with pytest.raises(ValueError, match=r"K must be a multiple of 32") as info:
        quantize_mxfp8(np.zeros(shape, np.float32))
    assert str(shape) in str(info.value)


def test_scalar_and_bad_rule_and_dtype():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp8(np.ones((), np.float32))
    with pytest.raises(ValueError, match="scale_rule"):
        quantize_mxfp8(np.zeros((1, 32), np.float32), "nearest")
    with pytest.raises(TypeError, match="int32"):
        quantize_mxfp8(np.zeros((1, 32), np.int32))
    with pytest.raises(TypeError, match="MXFP8Array"):
        dequantize_mxfp8(np.zeros((1, 32), np.float32))


@pytest.mark.parametrize("shape", [(0, 32), (3, 0), (2, 0, 64)])
def test_zero_size_input_gives_an_empty_container(shape):
    a = quantize_mxfp8(np.zeros(shape, np.float32))
    assert tuple(a.shape) == shape
    assert np.asarray(a.data).shape == shape and np.asarray(a.data).dtype == E4M3
    assert np.asarray(a.scales).shape == (*shape[:-1], shape[-1] // 32)
    assert np.asarray(dequantize_mxfp8(a)).shape == shape


def test_container_fields_and_validation():
    x = ref.sample("normal", (2, 3, 64), np.float32, 43)
    a = quantize_mxfp8(x, "ceil")
    assert isinstance(a, MXFP8Array) and a.scale_rule == "ceil"
    assert tuple(a.shape) == (2, 3, 64)
    assert np.asarray(a.data).shape == (2, 3, 64) and np.asarray(a.scales).shape == (2, 3, 2)
    assert a.nbytes == 2 * 3 * 64 + 2 * 3 * 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.data = a.data  # type: ignore[misc]
    with pytest.raises(TypeError, match=r"MXFP8Array\.data must have dtype float8_e4m3fn"):
        MXFP8Array(np.zeros((2, 64), np.uint8), np.zeros((2, 2), np.uint8), (2, 64))
    with pytest.raises(ValueError, match=r"MXFP8Array\.scales must have shape \(2, 2\)"):
        MXFP8Array(np.zeros((2, 64), E4M3), np.zeros((2, 1), np.uint8), (2, 64))
    with pytest.raises(ValueError, match="multiple of 32"):
        MXFP8Array(np.zeros((2, 48), E4M3), np.zeros((2, 1), np.uint8), (2, 48))
    with pytest.raises(ValueError, match="scale_rule"):
        MXFP8Array(np.zeros((2, 64), E4M3), np.zeros((2, 2), np.uint8), (2, 64), "floor")


@pytest.mark.parametrize("out_dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_dequantize_dtype(out_dtype):
    x = ref.sample("normal", (2, 64), np.float32, 47)
    elems, scales = ref8.quantize_mxfp8(x, "ceil")
    dq = np.asarray(dequantize_mxfp8(quantize_mxfp8(x, "ceil"), dtype=out_dtype))
    assert dq.dtype == np.dtype(out_dtype)
    want = ref8.dequantize_mxfp8(elems, scales).astype(out_dtype)
    np.testing.assert_array_equal(as_bytes(dq), as_bytes(want))


def test_error_bound():
    """RNE on E4M3: |x - x'| <= 2^-4 * 2^floor(log2|x|) for normal-range elements (half the
    spacing 2^-3 of E4M3's 3 mantissa bits), and 2^-10 * 2^e in the subnormal range."""
    x = ref.sample("student_t", (16, 256), np.float32, 53)
    a = quantize_mxfp8(x, "ceil")
    e = np.repeat(np.asarray(a.scales).astype(np.float64) - 127, 32, axis=-1)
    err = np.abs(np.asarray(dequantize_mxfp8(a)).astype(np.float64) - x)
    mag = np.abs(x.astype(np.float64))
    bound = np.where(
        mag >= 2.0 ** (e - 6),
        2.0 ** (np.floor(np.log2(np.maximum(mag, 1e-300))) - 4),
        2.0 ** (e - 10),
    )
    assert (err <= bound).all()
