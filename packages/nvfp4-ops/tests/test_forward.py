"""Fprop of dot_general equals dequantize(quantize(X)) . dequantize(quantize(W)) bit-exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import ops_reference as ref
import pytest

import nvfp4_format as nf
import nvfp4_ops

# (lhs shape, rhs shape, dimension numbers, x -> [B, M, K], w -> [B, N, K] (i.e. W^T))
CASES = {
    "matmul": (
        (32, 64),
        (64, 48),
        (((1,), (0,)), ((), ())),
        lambda x: x[None],
        lambda w: w.T[None],
    ),
    "flax_3d": (
        (2, 16, 32),
        (32, 16),
        (((2,), (0,)), ((), ())),
        lambda x: x.reshape(1, 32, 32),
        lambda w: w.T[None],
    ),
    "rhs_transposed": (
        (16, 32),
        (48, 32),
        (((1,), (1,)), ((), ())),
        lambda x: x[None],
        lambda w: w[None],
    ),
    "lhs_contract_first": (
        (32, 16),
        (32, 16),
        (((0,), (0,)), ((), ())),
        lambda x: x.T[None],
        lambda w: w.T[None],
    ),
    "batched": (
        (3, 16, 32),
        (3, 32, 16),
        (((2,), (1,)), ((0,), (0,))),
        lambda x: x,
        lambda w: jnp.swapaxes(w, 1, 2),
    ),
}


def _inputs(lhs_shape, rhs_shape, dtype, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, lhs_shape, jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, rhs_shape, jnp.float32) * 0.05).astype(dtype)
    return x, w


def _reference(x, w, dn, to_x, to_wt, out_dtype):
    out_shape = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dn), x, w).shape

    @jax.jit
    def run(x, w):
        qx = nf.quantize(to_x(x), (1, 16))
        qw = nf.quantize(to_wt(w), (16, 16))
        return ref.dot_last(ref.dq(qx), ref.dq(qw)).astype(out_dtype).reshape(out_shape)

    return run(x, w)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("backend", ["emulated"])
def test_fprop_bit_exact(case, dtype, backend):
    lhs_shape, rhs_shape, dn, to_x, to_wt = CASES[case]
    x, w = _inputs(lhs_shape, rhs_shape, dtype)
    expected = _reference(x, w, dn, to_x, to_wt, dtype)
    got = nvfp4_ops.dot_general(x, w, dn, recipe="nvfp4-no-sr", backend=backend)
    assert got.dtype == dtype and got.shape == expected.shape
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32))


def test_fprop_bit_exact_inside_jit_with_the_full_recipe():
    lhs_shape, rhs_shape, dn, to_x, to_wt = CASES["flax_3d"]
    x, w = _inputs(lhs_shape, rhs_shape, jnp.bfloat16)
    expected = _reference(x, w, dn, to_x, to_wt, jnp.bfloat16)
    f = jax.jit(lambda a, b: nvfp4_ops.dot_general(a, b, dn, recipe="nvfp4", key=jax.random.key(1)))
    np.testing.assert_array_equal(np.asarray(f(x, w), np.float32), np.asarray(expected, np.float32))


def test_fprop_preferred_element_type():
    x, w = _inputs((16, 32), (32, 16), jnp.bfloat16)
    y = nvfp4_ops.dot_general(
        x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32, recipe="nvfp4-no-sr"
    )
    expected = _reference(
        x, w, (((1,), (0,)), ((), ())), lambda a: a[None], lambda b: b.T[None], jnp.float32
    )
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y), np.asarray(expected))


def test_unaligned_shapes_are_zero_padded():
    # M=5, K=24, N=7: padding to 16 changes no amax and no sum.
    x, w = _inputs((5, 24), (24, 7), jnp.float32)
    y = nvfp4_ops.dot_general(x, w, (((1,), (0,)), ((), ())), recipe="nvfp4-no-sr")
    xp = jnp.pad(x, ((0, 11), (0, 8)))
    wp = jnp.pad(w, ((0, 8), (0, 9)))
    expected = _reference(
        xp, wp, (((1,), (0,)), ((), ())), lambda a: a[None], lambda b: b.T[None], jnp.float32
    )
    np.testing.assert_array_equal(np.asarray(y), np.asarray(expected)[:5, :7])


def test_fprop_weight_is_16x16_and_input_1x16():
    x, w = _inputs((16, 32), (32, 32), jnp.float32)
    dn = (((1,), (0,)), ((), ()))
    y_2d = nvfp4_ops.dot_general(x, w, dn, recipe="nvfp4-no-sr")
    y_1d = nvfp4_ops.dot_general(x, w, dn, recipe="nvfp4-naive")
    exp_1d = jax.jit(
        lambda x, w: ref.dot_last(
            ref.dq(nf.quantize(x[None], (1, 16))), ref.dq(nf.quantize(w.T[None], (1, 16)))
        )[0]
    )(x, w)
    np.testing.assert_array_equal(np.asarray(y_1d), np.asarray(exp_1d))
    assert not np.array_equal(np.asarray(y_2d), np.asarray(y_1d))


def test_nonfinite_input_gives_nan_not_a_finite_lie():
    x, w = _inputs((16, 32), (32, 16), jnp.float32)
    x = x.at[3, 5].set(jnp.inf)
    y = nvfp4_ops.dot_general(x, w, (((1,), (0,)), ((), ())), recipe="nvfp4-no-sr")
    assert bool(jnp.isnan(y).all())


def test_dimension_number_errors():
    x, w = _inputs((16, 32), (32, 16), jnp.float32)
    with pytest.raises(ValueError, match="contracting dimension sizes differ"):
        nvfp4_ops.dot_general(x, w, (((0,), (0,)), ((), ())), recipe="nvfp4-no-sr")
    with pytest.raises(ValueError, match="out of range"):
        nvfp4_ops.dot_general(x, w, (((2,), (0,)), ((), ())), recipe="nvfp4-no-sr")
    with pytest.raises(ValueError, match="dimension_numbers must be"):
        nvfp4_ops.dot_general(x, w, ((1,), (0,)), recipe="nvfp4-no-sr")


@pytest.mark.parametrize("lhs_shape, rhs_shape", [((0, 32), (32, 16)), ((4, 0), (0, 16))])
def test_zero_size_operands_give_the_exact_product_and_gradients(lhs_shape, rhs_shape):
    x, w = jnp.ones(lhs_shape, jnp.bfloat16), jnp.ones(rhs_shape, jnp.bfloat16)

    def f(a, b):
        return (
            nvfp4_ops.dot_general(
                a, b, (((1,), (0,)), ((), ())), recipe="nvfp4", key=jax.random.key(0)
            )
            .astype(jnp.float32)
            .sum()
        )

    y = nvfp4_ops.dot_general(x, w, (((1,), (0,)), ((), ())), recipe="nvfp4", key=jax.random.key(0))
    assert y.shape == (lhs_shape[0], rhs_shape[1]) and not np.asarray(y, np.float32).any()
    dx, dw = jax.grad(f, (0, 1))(x, w)
    assert dx.shape == lhs_shape and dw.shape == rhs_shape
