"""NVFP4 two-level quantize/dequantize (spec section 2): reference agreement, goldens, edge cases."""

from __future__ import annotations

import dataclasses
import zlib

import ml_dtypes
import numpy as np
import pytest
import reference as ref
from reference import as_bytes

from nvfp4_format import NVFP4Array, dequantize, quantize, unpack_fp4

E4M3 = ml_dtypes.float8_e4m3fn


def check_against_reference(x, block_shape=(1, 16), **kwargs) -> NVFP4Array:
    """quantize(x) must equal the reference bit for bit: bytes, scales, global scale, dequant."""
    a = quantize(x, block_shape=block_shape, **kwargs)
    codes, scales, s_dec = ref.quantize(x, block_shape, **kwargs)
    assert tuple(a.shape) == x.shape
    assert tuple(a.block_shape) == block_shape
    packed = np.asarray(a.packed)
    assert packed.dtype == np.uint8
    assert packed.shape == x.shape[:-1] + (x.shape[-1] // 2,)
    np.testing.assert_array_equal(packed, ref.pack_fp4(codes), err_msg="packed bytes")
    sb = np.asarray(a.block_scales)
    assert sb.dtype == E4M3
    assert sb.shape == x.shape[:-1] + (x.shape[-1] // 16,)
    np.testing.assert_array_equal(as_bytes(sb), as_bytes(scales.astype(E4M3)), "block scales")
    gs = np.asarray(a.global_scale)
    assert gs.dtype == np.float32
    assert gs.shape == ()
    assert as_bytes(gs).tolist() == as_bytes(np.float32(s_dec)).tolist(), (gs, s_dec)
    dq = np.asarray(dequantize(a))
    assert dq.dtype == np.float32
    np.testing.assert_array_equal(as_bytes(dq), as_bytes(ref.dequantize(codes, scales, s_dec)))
    return a


# ----------------------------------------------------------------------------- reference agreement
@pytest.mark.parametrize(("block_shape", "shape"), [((1, 16), (2, 3, 64)), ((16, 16), (2, 32, 48))])
def test_matches_reference_on_random_inputs(dist, dtype, block_shape, shape):
    seed = zlib.crc32(f"{dist}/{np.dtype(dtype)}/{block_shape}".encode())
    check_against_reference(ref.sample(dist, shape, dtype, seed), block_shape)


@pytest.mark.parametrize("block_shape", [(1, 16), (16, 16)])
def test_matches_reference_2d_larger(block_shape):
    check_against_reference(ref.sample("student_t", (64, 256), np.float32, 5), block_shape)


@pytest.mark.parametrize("block_shape", [(1, 16), (16, 16)])
def test_matches_reference_with_stochastic_rounding(dist, block_shape):
    x = ref.sample(dist, (32, 64), np.float32, 21)
    u = np.random.default_rng(22).random(x.shape, dtype=np.float32)
    check_against_reference(x, block_shape, rounding="stochastic", uniform=u)


@pytest.mark.parametrize("block_shape", [(1, 16), (16, 16)])
def test_global_amax_shared_across_two_tensors(block_shape):
    a = ref.sample("normal", (32, 64), np.float32, 31)
    b = ref.sample("cauchy", (16, 64), np.float32, 32)
    g = np.float32(max(np.abs(a).max(), np.abs(b).max()))
    qa = check_against_reference(a, block_shape, global_amax=g)
    qb = check_against_reference(b, block_shape, global_amax=g)
    assert as_bytes(qa.global_scale).tolist() == as_bytes(qb.global_scale).tolist()
    # sharing the amax is the same as quantizing the stacked tensor
    both = quantize(np.concatenate([a, b]), block_shape=block_shape)
    np.testing.assert_array_equal(np.asarray(both.packed)[:32], np.asarray(qa.packed))
    np.testing.assert_array_equal(np.asarray(both.packed)[32:], np.asarray(qb.packed))
    assert as_bytes(both.global_scale).tolist() == as_bytes(qa.global_scale).tolist()


@pytest.mark.parametrize("factor", [0.25, 4.0])
def test_global_amax_different_from_the_tensor_amax(factor):
    """A larger global amax shrinks the scales; a smaller one clips them at 448 and saturates."""
    x = ref.sample("normal", (8, 64), np.float32, 41)
    a = check_against_reference(x, global_amax=np.float32(np.abs(x).max() * factor))
    if factor < 1:
        assert (np.asarray(a.block_scales).astype(np.float32) == 448).any()
        assert np.isin(np.asarray(a.codes()), [7, 15]).mean() > 0.05


# ----------------------------------------------------------------------------- E4M3 / E2M1 exhaustive
def test_every_finite_e4m3_value_round_trips_as_a_block_scale():
    """Block b has amax 6*v_b for every finite non-negative E4M3 value v_b.

    The first block has amax 6*448 = 2688, so s_enc = 2688/2688 = 1 and s_dec = 1 exactly;
    6*v * f32(1/6) is within 2 float32 ulps of v, so sb = v; enc_b = 1/v and the block max maps to
    exactly 6 (code 7), so dequantize gives back 6*v exactly.
    """
    vals = np.unique(np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32))
    vals = np.sort(vals[np.isfinite(vals) & (vals >= 0)])[::-1]  # 448 first
    assert len(vals) == 127
    x = np.zeros((len(vals), 16), np.float32)
    x[:, 0] = 6 * vals
    a = quantize(x)
    got = np.asarray(a.block_scales)[:, 0]
    np.testing.assert_array_equal(as_bytes(got), as_bytes(vals.astype(E4M3)))
    assert float(np.asarray(a.global_scale)) == 1.0
    np.testing.assert_array_equal(np.asarray(dequantize(a)), x)
    codes = np.asarray(a.codes())
    assert (codes[vals > 0, 0] == 7).all() and (codes[:, 1:] == 0).all()


def test_all_sixteen_codes_through_quantize():
    """global_amax 2688 -> s_enc = 1; block amax 6 -> sb = e4m3(6 * f32(1/6)) = 1; enc_b = 1."""
    x = np.array([[0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]], np.float32)
    a = quantize(x, global_amax=2688.0)
    np.testing.assert_array_equal(np.asarray(a.codes()), np.arange(16)[None, :])
    dq = np.asarray(dequantize(a))
    np.testing.assert_array_equal(dq, x)
    np.testing.assert_array_equal(np.signbit(dq), np.signbit(x))


def test_ties_through_quantize():
    """Same setup (enc_b = 1): each tie of spec section 1 lands on the even neighbour."""
    x = np.array(
        [[6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -6, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5]],
        np.float32,
    )
    a = quantize(x, global_amax=2688.0)
    expect = [7, 0, 2, 2, 4, 4, 6, 6, 15, 8, 10, 10, 12, 12, 14, 14]
    assert np.asarray(a.codes()).tolist() == [expect]


def test_saturation_when_global_amax_is_too_small():
    """s_enc = 1 but the block amax is 5376: sb clips to 448, x*enc_b = 12 clips to 6."""
    x = np.zeros((1, 16), np.float32)
    x[0, :3] = [5376.0, -5376.0, 2688.0]
    a = quantize(x, global_amax=2688.0)
    assert np.asarray(a.block_scales).view(np.uint8).tolist() == [[0x7E]]
    assert np.asarray(a.codes())[0, :3].tolist() == [7, 15, 7]
    assert np.asarray(dequantize(a))[0, :3].tolist() == [2688.0, -2688.0, 2688.0]


# ----------------------------------------------------------------------------- zeros and flushing
@pytest.mark.parametrize("block_shape", [(1, 16), (16, 16)])
def test_all_zero_tensor(block_shape):
    x = np.zeros((2, 16, 32), np.float32)
    x[1, 3, 5] = -0.0
    a = quantize(x, block_shape=block_shape)
    assert float(np.asarray(a.global_scale)) == 1.0  # amax == 0 -> s_enc = 1
    assert not np.asarray(a.packed).any()
    assert not np.asarray(a.block_scales).view(np.uint8).any()
    np.testing.assert_array_equal(np.asarray(dequantize(a)), x)
    check_against_reference(x, block_shape)


def test_zero_block_among_nonzero_blocks():
    x = ref.sample("normal", (4, 48), np.float32, 51)
    x[1, 16:32] = 0.0
    x[2, :16] = -0.0
    a = check_against_reference(x)
    sb = np.asarray(a.block_scales).view(np.uint8)
    assert sb[1, 1] == 0 and sb[2, 0] == 0
    assert (sb[0] != 0).all()
    assert not np.asarray(a.codes())[1, 16:32].any()
    assert not np.asarray(a.codes())[2, :16].any()  # the deviation: flushed blocks code 0, not 8


def _flush_boundary() -> np.float32:
    """Largest float32 v with f32(v * f32(1/6)) <= 2^-10 (half the smallest E4M3 subnormal 2^-9).

    With s_enc = 1 a block of amax v has scaled amax v*(1*(1/6)); a value <= 2^-10 rounds to
    E4M3 zero (2^-10 itself is the tie between 0 and 2^-9 and goes to the even 0).
    """
    sixth = np.float32(1) / np.float32(6)
    v = np.float32(6 * 2.0**-10)
    while np.float32(v * sixth) > np.float32(2.0**-10):
        v = np.nextafter(v, np.float32(0))
    while np.float32(np.nextafter(v, np.float32(1)) * sixth) <= np.float32(2.0**-10):
        v = np.nextafter(v, np.float32(1))
    return v


def test_flush_to_zero_threshold():
    v = _flush_boundary()
    above = np.nextafter(v, np.float32(1))
    x = np.zeros((2, 16), np.float32)
    x[0, :2] = [v, -v / 2]
    x[1, :2] = [above, -above / 2]
    a = quantize(x, global_amax=2688.0)
    sb = np.asarray(a.block_scales).view(np.uint8)[:, 0].tolist()
    assert sb == [0x00, 0x01], f"scale bytes {sb}: amax {v!r} must flush, {above!r} must not"
    codes = np.asarray(a.codes())
    assert not codes[0].any()
    # sb = 2^-9 -> enc_b = 512; above*512 ~ 3.0 -> code 5, -above/2*512 ~ -1.5 -> code 11
    assert codes[1, :2].tolist() == [5, 11]
    dq = np.asarray(dequantize(a))
    assert not dq[0].any()
    assert dq[1, :2].tolist() == [3 * 2.0**-9, -1.5 * 2.0**-9]
    check_against_reference(x, global_amax=np.float32(2688))


def test_flush_relative_to_the_tensor_amax():
    """The spec's '~2.2e-6 * amax' rule: a block far below the tensor amax flushes."""
    x = np.zeros((2, 16), np.float32)
    x[0, 0] = 1.0
    x[1, 0] = 1e-6  # 1e-6 * 2688/6 = 4.5e-4 < 2^-10 -> flush
    x[1, 1] = -3e-7
    a = check_against_reference(x)
    assert np.asarray(a.block_scales).view(np.uint8)[1, 0] == 0
    x[1, 0] = 3e-6  # 1.3e-3 > 2^-10 -> smallest subnormal scale
    a = check_against_reference(x)
    assert np.asarray(a.block_scales).view(np.uint8)[1, 0] == 1


def test_tiny_and_subnormal_tensor_amax():
    """2688/amax overflows float32 for amax < ~7.9e-36: s_enc = FLT_MAX (spec's min)."""
    for amax in (1e-30, 1e-36, 1e-40, 1.4e-45):
        x = np.zeros((1, 32), np.float32)
        x[0, 0] = amax
        x[0, 17] = -amax
        check_against_reference(x)


# ----------------------------------------------------------------------------- container
def test_container_fields():
    x = ref.sample("normal", (3, 32, 64), np.float32, 61)
    a = quantize(x, block_shape=(16, 16))
    assert isinstance(a, NVFP4Array)
    assert tuple(a.shape) == (3, 32, 64)
    assert tuple(a.block_shape) == (16, 16)
    np.testing.assert_array_equal(np.asarray(a.codes()), np.asarray(unpack_fp4(a.packed)))
    # 16x16: the tile's scale repeated over its 16 rows
    sb = np.asarray(a.block_scales).view(np.uint8).reshape(3, 2, 16, 4)
    assert (sb == sb[:, :, :1, :]).all()
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.packed = a.packed  # type: ignore[misc]


def test_global_scale_is_amax_over_2688():
    x = ref.sample("normal", (4, 32), np.float32, 71)
    amax = np.float32(np.abs(x).max())
    a = quantize(x)
    expect = np.float32(1) / np.float32(np.float32(2688) / amax)
    assert as_bytes(a.global_scale).tolist() == as_bytes(expect).tolist()
    assert abs(float(np.asarray(a.global_scale)) - float(amax) / 2688) < 1e-6 * float(amax) / 2688


@pytest.mark.parametrize("out_dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_dequantize_dtype(out_dtype):
    x = ref.sample("normal", (4, 32), np.float32, 81)
    a = quantize(x)
    codes, scales, s_dec = ref.quantize(x)
    dq = np.asarray(dequantize(a, dtype=out_dtype))
    assert dq.dtype == np.dtype(out_dtype)
    expect = ref.dequantize(codes, scales, s_dec).astype(out_dtype)
    np.testing.assert_array_equal(as_bytes(dq), as_bytes(expect))
