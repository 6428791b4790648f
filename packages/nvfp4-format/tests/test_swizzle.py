"""128x4 scale swizzle (spec section 6): the offset formula, padding, round trip."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import reference as ref
from reference import as_bytes

from nvfp4_format import quantize, swizzle_scales, unswizzle_scales


def _distinct(shape) -> np.ndarray:
    """uint8 scales with (mostly) distinct non-zero values, so misplaced bytes are visible."""
    return (np.arange(int(np.prod(shape))).reshape(shape) % 251 + 1).astype(np.uint8)


@pytest.mark.parametrize(
    "shape", [(1, 1), (128, 4), (130, 5), (256, 8), (300, 7), (2, 129, 3), (3, 2, 64, 12)]
)
def test_matches_offset_formula(shape):
    s = _distinct(shape)
    out = np.asarray(swizzle_scales(s))
    expect = ref.swizzle_scales(s)
    assert out.shape == expect.shape
    assert out.dtype == np.uint8
    np.testing.assert_array_equal(out, expect)


def test_hand_computed_offsets():
    """offset(r, c) = (rt*(Cpad/4) + ct)*512 + (r%32)*16 + ((r%128)//32)*4 + c%4, Cpad = 8."""
    s = np.zeros((256, 8), np.uint8)
    cases = {
        (0, 0): 0,
        (0, 1): 1,
        (0, 3): 3,
        (1, 0): 16,  # next row of a 32-row group: +16
        (31, 3): 31 * 16 + 3,
        (32, 0): 4,  # second 32-row group interleaves at +4
        (97, 2): 16 + 3 * 4 + 2,
        (0, 4): 512,  # next column tile (ct = 1)
        (128, 0): 2 * 512,  # next row tile: rt * (Cpad/4) = 2 tiles further
        (255, 7): (1 * 2 + 1) * 512 + 31 * 16 + 3 * 4 + 3,
    }
    for i, (r, c) in enumerate(cases):
        s[r, c] = i + 1
    flat = np.asarray(swizzle_scales(s)).reshape(-1)
    for i, ((r, c), off) in enumerate(cases.items()):
        assert flat[off] == i + 1, f"scale ({r}, {c}) should sit at byte {off}"
    assert np.count_nonzero(flat) == len(cases)


def test_pads_with_zeros():
    s = _distinct((130, 5))
    out = np.asarray(swizzle_scales(s))
    assert out.shape == (256, 8)
    assert np.count_nonzero(out) == s.size  # padding adds zeros only
    assert sorted(out[out != 0].tolist()) == sorted(s.reshape(-1).tolist())


@pytest.mark.parametrize("shape", [(1, 1), (130, 5), (256, 8), (2, 129, 3)])
def test_round_trip(shape):
    s = _distinct(shape)
    back = np.asarray(unswizzle_scales(swizzle_scales(s), shape[-2], shape[-1]))
    np.testing.assert_array_equal(back, s)


def test_float8_block_scales_of_a_real_tensor():
    """Scales of an NVFP4 tensor: float8_e4m3fn in, float8_e4m3fn out, same bytes as uint8."""
    x = ref.sample("normal", (160, 96), np.float32, 3)
    sb = np.asarray(quantize(x).block_scales)  # [160, 6]
    out = np.asarray(swizzle_scales(sb))
    assert out.dtype == ml_dtypes.float8_e4m3fn
    assert out.shape == (256, 8)
    np.testing.assert_array_equal(as_bytes(out), as_bytes(ref.swizzle_scales(sb.view(np.uint8))))
    back = np.asarray(unswizzle_scales(out, 160, 6))
    assert back.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(as_bytes(back), as_bytes(sb))
