"""Gradients: exact for the BF16 recipe, bit-equal to the plain reference recipe for NVFP4."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import ops_reference as ref
import pytest
from vjp_cases import MATMUL, operands, vjp_of

import nvfp4_format as nf
import nvfp4_ops


@pytest.mark.parametrize(
    "dn, lhs_shape, rhs_shape",
    [
        (MATMUL, (8, 12), (12, 5)),
        ((((2,), (1,)), ((0,), (0,))), (2, 4, 6), (2, 6, 3)),
        ((((0,), (1,)), ((), ())), (6, 4), (3, 6)),
    ],
)
def test_bf16_recipe_is_exactly_lax_dot_general(dn, lhs_shape, rhs_shape):
    kx, kw = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, lhs_shape, jnp.bfloat16)
    w = jax.random.normal(kw, rhs_shape, jnp.bfloat16)

    def loss(f):
        return lambda a, b: (f(a, b).astype(jnp.float32) ** 2).sum()

    ours = jax.grad(loss(lambda a, b: nvfp4_ops.dot_general(a, b, dn, recipe="bf16")), (0, 1))
    plain = jax.grad(loss(lambda a, b: jax.lax.dot_general(a, b, dn)), (0, 1))
    for got, want in zip(ours(x, w), plain(x, w), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_nvfp4_gradients_match_the_plain_reference_bit_exactly():
    x, w, dy = operands()
    key = jax.random.key(42)
    y, dx, dw = vjp_of("nvfp4")(x, w, dy, key)
    y_ref = jax.jit(lambda x, w: ref.fprop(x, w)[0][0])(x, w)
    dx_ref = jax.jit(lambda dy, w, key: ref.dgrad(dy, w, key)[0][0])(dy, w, key)
    dw_ref = jax.jit(lambda x, dy, key: ref.wgrad(x, dy, key)[0][0])(x, dy, key)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx_ref))
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(dw_ref))
    # Same key, same bits; another key, other bits (the key is really used).
    _, dx2, dw2 = vjp_of("nvfp4")(x, w, dy, key)
    np.testing.assert_array_equal(np.asarray(dx2), np.asarray(dx))
    _, dx3, dw3 = vjp_of("nvfp4")(x, w, dy, jax.random.key(43))
    assert not np.array_equal(np.asarray(dx3), np.asarray(dx))
    assert not np.array_equal(np.asarray(dw3), np.asarray(dw))


@pytest.mark.parametrize("out_dtype", [None, jnp.float32])
def test_bf16_operands_round_the_wgrad_rotation_like_transformer_engine(out_dtype):
    # A BF16 operand's RHT is rounded back to BF16 before its amax and quantization (TE's
    # reference and kernel do so); rotating in FP32 instead changes ~1% of the Wgrad codes.
    # With an FP32 output (nvfp4-train's QuantLinear), dY still enters in the compute dtype.
    x, w, dy = (a.astype(jnp.bfloat16) for a in operands(m=64, k=48, n=32, seed=3))
    key = jax.random.key(5)

    @jax.jit
    def grads(x, w, dy):
        f = lambda a, b: nvfp4_ops.dot_general(  # noqa: E731
            a, b, MATMUL, preferred_element_type=out_dtype, recipe="nvfp4", key=key
        )
        y, pullback = jax.vjp(f, x, w)
        return pullback(dy.astype(y.dtype))

    _, dw = grads(x, w, dy)
    dw_ref, qxt, _, _, _ = jax.jit(lambda x, dy, key: ref.wgrad(x, dy, key))(x, dy, key)
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(dw_ref[0].astype(jnp.bfloat16)))
    f32_rotation = nf.quantize(ref.rotate(x.T[None]), (1, 16))
    assert (np.asarray(f32_rotation.packed) != np.asarray(qxt.packed)).any()


def test_no_sr_no_rht_gradients_match_reference():
    x, w, dy = operands(seed=1)
    key = jax.random.key(0)
    recipe = nvfp4_ops.Recipe(
        grad=nvfp4_ops.TensorQuant("nvfp4", (1, 16), "rne"), wgrad_hadamard=False
    )
    _, dx, dw = vjp_of(recipe)(x, w, dy, key)
    dx_ref = jax.jit(lambda dy, w: ref.dgrad(dy, w, key, stochastic=False)[0][0])(dy, w)
    dw_ref = jax.jit(lambda x, dy: ref.wgrad(x, dy, key, rht=False, stochastic=False)[0][0])(x, dy)
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx_ref))
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(dw_ref))


@pytest.mark.parametrize("recipe, same", [("nvfp4", True), ("nvfp4-no-2d", False)])
def test_dgrad_uses_the_fprop_weight_tiles(recipe, same):
    # X = I gives Y = W_fprop exactly; dY = I gives dX = W_dgrad^T exactly (one-hot rows
    # quantize exactly, also with stochastic rounding).
    k, n = 32, 48
    w = jax.random.normal(jax.random.key(5), (k, n), jnp.float32)
    run = vjp_of(recipe)
    y, _, _ = run(jnp.eye(k), w, jnp.zeros((k, n)), jax.random.key(0))
    _, dx, _ = run(jnp.ones((n, k)), w, jnp.eye(n), jax.random.key(0))
    assert np.array_equal(np.asarray(y), np.asarray(dx).T) == same


def test_hadamard_changes_only_wgrad():
    x, w, dy = operands(seed=2)
    key = jax.random.key(7)
    y1, dx1, dw1 = vjp_of("nvfp4")(x, w, dy, key)
    y2, dx2, dw2 = vjp_of("nvfp4-no-rht")(x, w, dy, key)
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
    np.testing.assert_array_equal(np.asarray(dx1), np.asarray(dx2))
    assert not np.array_equal(np.asarray(dw1), np.asarray(dw2))


def test_stochastic_rounding_is_unbiased_over_keys():
    m, k, n, samples = 16, 16, 32, 512
    kx, kw, kd = jax.random.split(jax.random.key(11), 3)
    w = jax.random.normal(kw, (k, n), jnp.float32)
    # Every 16-block of dY holds the tensor amax, so every block scale is exactly 448 and no
    # element clips: E[Q(dY)] = dY up to the 8-bit uniform's 1/512-step bias.
    dy = jax.random.uniform(kd, (m, n), jnp.float32, -1.0, 1.0).at[:, ::16].set(1.0)
    x = jax.random.normal(kx, (m, k), jnp.float32)
    run = vjp_of("nvfp4")
    keys = jax.random.split(jax.random.key(0), samples)
    dxs = jax.vmap(lambda kk: run(x, w, dy, kk)[1])(keys)
    wq_t = run(jnp.eye(k), w, jnp.zeros((k, n)), keys[0])[0]  # the 2D-quantized W, [K, N]
    expected = dy @ wq_t.T
    step = 1.0 / 3.0  # widest E2M1 gap (2) times the block decode scale (1/6)
    sigma = jnp.sqrt((wq_t**2).sum(axis=1)) * step / 2
    bias = jnp.abs(wq_t).sum(axis=1) * step / 512
    err = jnp.abs(dxs.mean(axis=0) - expected)
    assert bool((err <= 5 * sigma / np.sqrt(samples) + bias).all()), float((err / sigma).max())
    assert float(dxs.std(axis=0).mean()) > 0.01  # different keys really round differently


def test_gemm_errors_within_the_derived_bounds():
    x, w, dy = operands(m=48, k=32, n=64, seed=4)
    key = jax.random.key(9)
    y, dx, dw = vjp_of("nvfp4")(x, w, dy, key)
    hi = jax.lax.Precision.HIGHEST
    gamma = 2 * 64 * 2.0**-24  # FP32 accumulation, generously

    @jax.jit
    def bounds(x, w, dy, key):
        _, qx, qw = ref.fprop(x, w)
        bx, bw = ref.element_error_bound(qx)[0], ref.element_error_bound(qw)[0].T
        xh, wh = ref.dq(qx)[0], ref.dq(qw)[0].T
        b_y = jnp.dot(jnp.abs(x), bw, precision=hi) + jnp.dot(bx, jnp.abs(wh), precision=hi)
        b_y += gamma * jnp.dot(jnp.abs(x) + jnp.abs(xh), jnp.abs(w) + jnp.abs(wh), precision=hi)
        _, qdy, _ = ref.dgrad(dy, w, key)
        bdy, dyh = ref.element_error_bound(qdy, stochastic=True)[0], ref.dq(qdy)[0]
        b_dx = jnp.dot(jnp.abs(dy), bw.T, precision=hi) + jnp.dot(bdy, jnp.abs(wh).T, precision=hi)
        b_dx += gamma * jnp.dot(
            jnp.abs(dy) + jnp.abs(dyh), (jnp.abs(w) + jnp.abs(wh)).T, precision=hi
        )
        _, qxt, qdyt, xt, dyt = ref.wgrad(x, dy, key)
        bxt, bdyt = (
            ref.element_error_bound(qxt)[0],
            ref.element_error_bound(qdyt, stochastic=True)[0],
        )
        xth, dyth = ref.dq(qxt)[0], ref.dq(qdyt)[0]
        b_dw = jnp.dot(jnp.abs(xt[0]), bdyt.T, precision=hi) + jnp.dot(
            bxt, jnp.abs(dyth).T, precision=hi
        )
        b_dw += gamma * jnp.dot(
            jnp.abs(xt[0]) + jnp.abs(xth), (jnp.abs(dyt[0]) + jnp.abs(dyth)).T, precision=hi
        )
        return b_y, b_dx, b_dw

    b_y, b_dx, b_dw = bounds(x, w, dy, key)
    exact = {
        "fprop": (x @ w, y, b_y),
        "dgrad": (dy @ w.T, dx, b_dx),
        "wgrad": (x.T @ dy, dw, b_dw),
    }
    for name, (want, got, bound) in exact.items():
        want = jnp.matmul(
            *{"fprop": (x, w), "dgrad": (dy, w.T), "wgrad": (x.T, dy)}[name], precision="highest"
        )
        err = jnp.abs(got - want)
        assert bool((err <= bound).all()), (name, float((err / bound).max()))
        rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        assert rel < 0.25, (name, rel)  # typical NVFP4 GEMM error on Gaussian data is ~0.1


def test_stochastic_rounding_without_key_is_an_error():
    x, w, _ = operands()
    with pytest.raises(ValueError, match="needs a PRNG key"):
        nvfp4_ops.dot_general(x, w, MATMUL, recipe="nvfp4")
    with pytest.raises(TypeError, match="key must be"):
        nvfp4_ops.dot_general(x, w, MATMUL, recipe="nvfp4", key=np.zeros(2, np.uint32))
    y = nvfp4_ops.dot_general(x, w, MATMUL, recipe="nvfp4-no-sr")  # no SR: no key needed
    assert y.shape == (32, 32)
