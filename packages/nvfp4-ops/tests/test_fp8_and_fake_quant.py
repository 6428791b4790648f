"""FP8 current scaling and fake_quantize."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import nvfp4_format as nf
import nvfp4_ops


def test_fp8_current_scaling_round_trip():
    x = jnp.array([1.0, -448.0, 3.0, 0.0])
    t = nvfp4_ops.quantize_fp8(x)
    assert t.data.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(nvfp4_ops.dequantize_fp8(t)), np.asarray(x))
    y = jax.random.normal(jax.random.key(0), (64,)) * 1e-3
    t = nvfp4_ops.quantize_fp8(y, "fp8_e5m2")
    assert float(jnp.abs(t.data.astype(jnp.float32)).max()) == 57344.0
    expected = (np.asarray(y) * np.float32(t.decode_scale) ** -1).astype(ml_dtypes.float8_e5m2)
    np.testing.assert_array_equal(np.asarray(t.data), expected)
    rel = jnp.abs(nvfp4_ops.dequantize_fp8(t) - y) / jnp.abs(y)
    assert float(rel.max()) <= 2.0**-3 + 1e-6  # E5M2: 2 mantissa bits, RNE


def test_fp8_nonfinite_and_zero():
    assert bool(jnp.isnan(nvfp4_ops.quantize_fp8(jnp.array([1.0, jnp.nan])).decode_scale))
    assert bool(jnp.isnan(nvfp4_ops.quantize_fp8(jnp.array([1.0, jnp.inf])).decode_scale))
    z = nvfp4_ops.quantize_fp8(jnp.zeros(4))
    np.testing.assert_array_equal(np.asarray(nvfp4_ops.dequantize_fp8(z)), np.zeros(4))
    with pytest.raises(ValueError, match="fmt must be one of"):
        nvfp4_ops.quantize_fp8(jnp.ones(3), "fp8_e3m4")


def test_fake_quantize_equals_format_round_trip():
    x = jax.random.normal(jax.random.key(1), (32, 48))
    got = nvfp4_ops.fake_quantize(x, "nvfp4", (16, 16))
    np.testing.assert_array_equal(
        np.asarray(got), np.asarray(nf.dequantize(nf.quantize(x, (16, 16))))
    )
    x64 = jnp.concatenate([x, x[:, :16]], axis=1)
    got = nvfp4_ops.fake_quantize(x64, "mxfp4", (1, 32))
    want = nf.dequantize_mxfp4(nf.quantize_mxfp4(x64))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert bool((nvfp4_ops.fake_quantize(x, "bf16", None) == x).all())


def test_fake_quantize_any_shape_and_dtype():
    x = jax.random.normal(jax.random.key(2), (5, 21), jnp.bfloat16)
    y = nvfp4_ops.fake_quantize(x)
    assert y.shape == x.shape and y.dtype == jnp.bfloat16
    padded = jnp.pad(x, ((0, 0), (0, 11)))
    expected = nf.dequantize(nf.quantize(padded))[:, :21].astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(expected, np.float32))


def test_fake_quantize_stochastic_needs_a_key_and_uses_it():
    x = jax.random.normal(jax.random.key(3), (4, 32))
    with pytest.raises(ValueError, match="needs a PRNG key"):
        nvfp4_ops.fake_quantize(x, rounding="stochastic")
    a = nvfp4_ops.fake_quantize(x, rounding="stochastic", key=jax.random.key(0))
    b = nvfp4_ops.fake_quantize(x, rounding="stochastic", key=jax.random.key(1))
    assert not np.array_equal(np.asarray(a), np.asarray(b))


def test_operand_decoding_equals_nvfp4_format():
    from nvfp4_ops.quantizers import dequantize_operand
    from nvfp4_ops.recipe import TensorQuant

    x = jax.random.normal(jax.random.key(4), (2, 16, 64)) * jnp.logspace(-8, 8, 64)
    q = nf.quantize(x, (16, 16))
    got = dequantize_operand(q, TensorQuant("nvfp4", (16, 16)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(nf.dequantize(q)))
    m = nf.quantize_mxfp4(x)
    got = dequantize_operand(m, TensorQuant("mxfp4", (1, 32)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(nf.dequantize_mxfp4(m)))
