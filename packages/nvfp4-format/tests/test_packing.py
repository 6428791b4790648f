"""Nibble packing (spec section 1): byte[j] = code[2j] | code[2j+1] << 4."""

from __future__ import annotations

import numpy as np
import reference as ref

from nvfp4_format import encode_e2m1, pack_fp4, unpack_fp4


def test_even_index_goes_to_low_nibble():
    # codes 1, 2 -> low nibble 1, high nibble 2 -> 0x21; codes 15, 0 -> 0x0F; 0, 15 -> 0xF0
    codes = np.array([1, 2, 15, 0, 0, 15, 7, 8], np.uint8)
    assert np.asarray(pack_fp4(codes)).tolist() == [0x21, 0x0F, 0xF0, 0x87]


def test_all_sixteen_codes_in_order():
    packed = np.asarray(pack_fp4(np.arange(16, dtype=np.uint8)))
    assert packed.dtype == np.uint8
    assert packed.tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]


def test_every_byte_unpacks_and_repacks():
    every = np.arange(256, dtype=np.uint8)
    codes = np.asarray(unpack_fp4(every))
    assert codes.dtype == np.uint8
    assert codes.shape == (512,)
    np.testing.assert_array_equal(codes[0::2], every & 0xF)
    np.testing.assert_array_equal(codes[1::2], every >> 4)
    np.testing.assert_array_equal(np.asarray(pack_fp4(codes)), every)


def test_matches_reference_with_batch_dims():
    codes = np.random.default_rng(3).integers(0, 16, (2, 3, 5, 32)).astype(np.uint8)
    packed = np.asarray(pack_fp4(codes))
    assert packed.shape == (2, 3, 5, 16)
    np.testing.assert_array_equal(packed, ref.pack_fp4(codes))
    unpacked = np.asarray(unpack_fp4(packed))
    assert unpacked.shape == codes.shape
    np.testing.assert_array_equal(unpacked, codes)
    np.testing.assert_array_equal(ref.unpack_fp4(packed), codes)


def test_packed_fp4_matches_ml_dtypes_element_order():
    """The low nibble holds the element that comes first, as in ONNX FLOAT4E2M1 / TE."""
    x = np.array([0.5, -6.0, 3.0, 0.0], np.float32)
    # codes: 0.5 -> 1, -6 -> 15, 3 -> 5, 0 -> 0; bytes 1 | 15<<4 = 0xF1, 5 | 0<<4 = 0x05
    assert np.asarray(pack_fp4(encode_e2m1(x))).tolist() == [0xF1, 0x05]
