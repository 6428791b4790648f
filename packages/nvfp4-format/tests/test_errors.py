"""Bad input: a ValueError / TypeError whose message names the argument and the offending value."""

from __future__ import annotations

import re

import numpy as np
import pytest

import nvfp4_format as nf

X = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)


def _raises(exc, fn, *words: str) -> str:
    """Call fn, expect exc, and check each word occurs (as a whole word) in the message."""
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    for w in words:
        assert re.search(rf"(?<![A-Za-z0-9_]){re.escape(w)}(?![A-Za-z0-9_])", msg), (
            f"message {msg!r} should name {w!r}"
        )
    return msg


# ----------------------------------------------------------------------------- quantize
def test_k_not_multiple_of_16():
    _raises(ValueError, lambda: nf.quantize(np.zeros((4, 100), np.float32)), "K", "100")


def test_m_not_multiple_of_16_for_2d_blocks():
    _raises(ValueError, lambda: nf.quantize(np.zeros((20, 32), np.float32), (16, 16)), "x", "20")


def test_2d_blocks_need_two_axes():
    with pytest.raises(ValueError, match=r"x|block_shape"):
        nf.quantize(np.zeros((32,), np.float32), (16, 16))


@pytest.mark.parametrize("bad", [(2, 16), (1, 32), (16, 1), (32, 32)])
def test_unsupported_block_shape(bad):
    _raises(ValueError, lambda: nf.quantize(X, bad), "block_shape")


@pytest.mark.parametrize("dt", [np.int32, np.uint8, np.int8, np.bool_])
def test_non_float_dtype(dt):
    _raises(TypeError, lambda: nf.quantize(np.ones((2, 32), dt)), "x", np.dtype(dt).name)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_numpy_input(bad):
    x = X.copy()
    x[3, 5] = bad
    msg = _raises(ValueError, lambda: nf.quantize(x), "x")
    assert re.search(r"nan|inf|non-?finite", msg, re.I), msg


def test_bad_rounding():
    _raises(ValueError, lambda: nf.quantize(X, rounding="nearest"), "rounding", "nearest")


def test_stochastic_without_uniform():
    _raises(ValueError, lambda: nf.quantize(X, rounding="stochastic"), "uniform")


def test_uniform_of_wrong_shape():
    u = np.zeros((32, 32), np.float32)
    _raises(ValueError, lambda: nf.quantize(X, rounding="stochastic", uniform=u), "uniform")


# ----------------------------------------------------------------------------- e2m1 and packing
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_encode_nonfinite(bad):
    x = np.array([1.0, bad], np.float32)
    _raises(ValueError, lambda: nf.encode_e2m1(x), "x")


def test_encode_bad_rounding():
    _raises(ValueError, lambda: nf.encode_e2m1(X, rounding="up"), "rounding", "up")


def test_encode_stochastic_without_uniform():
    _raises(ValueError, lambda: nf.encode_e2m1(X, rounding="stochastic"), "uniform")


def test_decode_code_out_of_range():
    codes = np.array([0, 3, 16], np.uint8)
    _raises(ValueError, lambda: nf.decode_e2m1(codes), "codes", "16")


def test_pack_odd_width():
    codes = np.zeros((2, 7), np.uint8)
    _raises(ValueError, lambda: nf.pack_fp4(codes), "codes", "7")


# ----------------------------------------------------------------------------- MXFP4
def test_mxfp4_k_not_multiple_of_32():
    _raises(ValueError, lambda: nf.quantize_mxfp4(np.zeros((2, 48), np.float32)), "K", "48")


def test_mxfp4_bad_scale_rule():
    _raises(ValueError, lambda: nf.quantize_mxfp4(X, "floor"), "scale_rule", "floor")


def test_mxfp4_nonfinite_numpy_input():
    x = X.copy()
    x[0, 0] = np.nan
    _raises(ValueError, lambda: nf.quantize_mxfp4(x), "x")


# ----------------------------------------------------------------------------- swizzle
def test_swizzle_needs_two_axes():
    _raises(ValueError, lambda: nf.swizzle_scales(np.zeros((8,), np.uint8)), "scales")


def test_unswizzle_rows_larger_than_the_padded_array():
    s = np.zeros((128, 4), np.uint8)
    _raises(ValueError, lambda: nf.unswizzle_scales(s, 200, 4), "rows", "200")


def test_unswizzle_shape_not_padded():
    s = np.zeros((100, 4), np.uint8)
    _raises(ValueError, lambda: nf.unswizzle_scales(s, 100, 4), "swizzled")


# ----------------------------------------------------------------------------- containers
E4M3 = nf.nvfp4.ml_dtypes.float8_e4m3fn


def _nvfp4(packed_shape=(4, 8), scales_shape=(4, 1), *, scale_dtype=E4M3, shape=(4, 16)):
    return nf.NVFP4Array(
        np.zeros(packed_shape, np.uint8),
        np.ones(scales_shape, np.float32).astype(scale_dtype),
        np.float32(1.0),
        shape,
    )


def test_nvfp4_array_with_broadcastable_scales_is_refused():
    # [1, 1] scales used to broadcast over the 4 rows and decode wrong values silently
    _raises(ValueError, lambda: _nvfp4(scales_shape=(1, 1)), "block_scales", "(4, 1)", "(1, 1)")
    _raises(ValueError, lambda: _nvfp4(packed_shape=(4, 16)), "packed", "(4, 8)")
    _raises(TypeError, lambda: _nvfp4(scale_dtype=np.float32), "block_scales", "float8_e4m3fn")
    _raises(ValueError, lambda: _nvfp4(shape=(4, 20)), "shape", "16")
    assert _nvfp4().shape == (4, 16)  # the valid one builds
    with pytest.raises(ValueError, match="block_shape must be one of"):
        nf.NVFP4Array(_nvfp4().packed, _nvfp4().block_scales, np.float32(1), (4, 16), (2, 16))


def test_mxfp4_array_is_validated_too():
    ok = nf.MXFP4Array(np.zeros((4, 16), np.uint8), np.zeros((4, 1), np.uint8), (4, 32))
    assert ok.shape == (4, 32)
    _raises(
        ValueError,
        lambda: nf.MXFP4Array(np.zeros((4, 16), np.uint8), np.zeros((1, 1), np.uint8), (4, 32)),
        "scales",
    )  # noqa: E501
    _raises(
        TypeError,
        lambda: nf.MXFP4Array(np.zeros((4, 16), np.int8), np.zeros((4, 1), np.uint8), (4, 32)),
        "packed",
    )  # noqa: E501
    with pytest.raises(ValueError, match="scale_rule"):
        nf.MXFP4Array(np.zeros((4, 16), np.uint8), np.zeros((4, 1), np.uint8), (4, 32), "round")


def test_a_python_list_is_a_type_error_not_an_attribute_error():
    _raises(TypeError, lambda: nf.quantize([1.0] * 16), "x", "list")
    _raises(TypeError, lambda: nf.quantize_mxfp4([1.0] * 32), "x", "list")


@pytest.mark.parametrize("shape", [(0, 32), (4, 0), (0,), (2, 0, 32)])
def test_zero_size_input_round_trips_to_empty_containers(shape):
    x = np.zeros(shape, np.float32)
    q = nf.quantize(x)
    assert q.shape == shape and q.packed.shape == (*shape[:-1], shape[-1] // 2)
    assert nf.dequantize(q).shape == shape
    mx = nf.quantize_mxfp4(x)
    assert nf.dequantize_mxfp4(mx).shape == shape
