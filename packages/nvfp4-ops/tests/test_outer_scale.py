"""Per-row ("per-token") NVFP4 outer scales through `dot_general`: forward, gradients, error, stats.

"nvfp4-per-token" quantizes x with one FP32 outer scale per row as it is contracted: per token in
Fprop, per feature of (H x^T) in Wgrad. `ROW_GRAD` does the same for dY (Dgrad per token, Wgrad per
output feature). The references are written here with `nvfp4_format` directly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import ops_reference as ref
import pytest

import nvfp4_format as nf
import nvfp4_ops
from nvfp4_ops import Recipe, TensorQuant
from nvfp4_ops.formats import FORMAT_OPS
from nvfp4_ops.quantizers import quantize_operand

MATMUL = (((1,), (0,)), ((), ()))
CAPS = nvfp4_ops.backend_capabilities()
ROW_X = TensorQuant("nvfp4", (1, 16), "rne", outer_scale="row")
ROW_G = TensorQuant("nvfp4", (1, 16), "stochastic", outer_scale="row")
PER_TOKEN = nvfp4_ops.get_recipe("nvfp4-per-token")
ROW_GRAD = Recipe(grad=ROW_G, name="row-grad")
ROW_BOTH = Recipe(fprop_input=ROW_X, grad=ROW_G, name="row-both")
KEY = jax.random.key(0)  # the SR key of the gradients (the forward does not use it)


def _spread(key, shape, lo=-12, hi=12) -> jax.Array:
    """Normal rows whose magnitudes differ: row i scaled by 2^e_i, e_i uniform in [lo, hi)."""
    kv, ke = jax.random.split(key)
    e = jax.random.randint(ke, (shape[0], 1), lo, hi).astype(jnp.float32)
    return jax.random.normal(kv, shape, jnp.float32) * jnp.exp2(e)


def _data(m=32, k=64, n=48, seed=0):
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    x = _spread(kx, (m, k))
    w = jax.random.normal(kw, (k, n), jnp.float32) * 0.1
    dy = _spread(kd, (m, n), -8, 8) * 0.01
    return x, w, dy


def _dot(recipe, backend, key):
    return lambda a, b: nvfp4_ops.dot_general(a, b, MATMUL, recipe=recipe, key=key, backend=backend)


@functools.cache
def _grads(recipe, backend):
    """jit (x, w, dy, key) -> (y, dx, dw), the gradients by `jax.grad` of sum(y * dy)."""

    @jax.jit
    def run(x, w, dy, key):
        f = _dot(recipe, backend, key)
        dx, dw = jax.grad(lambda a, b: jnp.sum(f(a, b).astype(jnp.float32) * dy), (0, 1))(x, w)
        return f(x, w), dx, dw

    return run


# ----------------------------------------------------------------------------- the reference
def _qrow(v, **kwargs):
    """nvfp4_format quantization of [1, rows, C] with one outer scale per row."""
    q = nf.quantize(v, (1, 16), outer_scale="row", **kwargs)
    assert q.global_scale.shape == (*v.shape[:-1], 1)
    return q


@jax.jit
def _per_token_reference(x, w, dy, key):
    """(y, dx, dw) of "nvfp4-per-token" from nvfp4_format: x per row, W 16x16, dY SR per tensor."""
    ks = jax.random.split(key, 6)
    qw = nf.quantize(w.T[None], (16, 16))
    y = ref.dot_last(ref.dq(_qrow(x[None])), ref.dq(qw))
    u_dy = ref.uniform8(ks[2], (1, *dy.shape))
    qdy = nf.quantize(dy[None], (1, 16), rounding="stochastic", uniform=u_dy)
    dx = ref.dot_last(ref.dq(qdy), jnp.swapaxes(ref.dq(qw), -1, -2))
    xt, dyt = ref.rotate(x.T[None]), ref.rotate(dy.T[None])
    u_dyt = ref.uniform8(ks[5], dyt.shape)
    qdyt = nf.quantize(dyt, (1, 16), rounding="stochastic", uniform=u_dyt)
    dw = ref.dot_last(ref.dq(_qrow(xt)), ref.dq(qdyt))
    return y[0], dx[0], dw[0]


@jax.jit
def _row_grad_reference(x, w, dy, key):
    """(y, dx, dw) of `ROW_GRAD`: as "nvfp4" with dY (Dgrad) and H dY^T (Wgrad) per row, SR."""
    ks = jax.random.split(key, 6)
    qw = nf.quantize(w.T[None], (16, 16))
    y = ref.dot_last(ref.dq(nf.quantize(x[None], (1, 16))), ref.dq(qw))
    qdy = _qrow(dy[None], rounding="stochastic", uniform=ref.uniform8(ks[2], (1, *dy.shape)))
    dx = ref.dot_last(ref.dq(qdy), jnp.swapaxes(ref.dq(qw), -1, -2))
    xt, dyt = ref.rotate(x.T[None]), ref.rotate(dy.T[None])
    qdyt = _qrow(dyt, rounding="stochastic", uniform=ref.uniform8(ks[5], dyt.shape))
    dw = ref.dot_last(ref.dq(nf.quantize(xt, (1, 16))), ref.dq(qdyt))
    return y[0], dx[0], dw[0]


def _assert_equal(got, want, what):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), what)


# ----------------------------------------------------------------------------- bit-exact, emulated
@pytest.mark.parametrize(
    "recipe, reference",
    [(PER_TOKEN, _per_token_reference), (ROW_GRAD, _row_grad_reference)],
    ids=["nvfp4-per-token", "row-grad"],
)
def test_emulated_forward_and_gradients_are_bit_exact(recipe, reference):
    x, w, dy = _data()
    key = jax.random.key(7)
    got = _grads(recipe, "emulated")(x, w, dy, key)
    for name, a, b in zip(("y", "dx", "dw"), got, reference(x, w, dy, key), strict=True):
        _assert_equal(a, b, name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_per_token_fprop_bit_exact_and_not_the_per_tensor_one(dtype):
    x, w, _ = _data(m=48, k=32, n=16, seed=1)
    x, w = x.astype(dtype), w.astype(dtype)
    y = nvfp4_ops.dot_general(x, w, MATMUL, recipe=PER_TOKEN, key=KEY, backend="emulated")
    want = jax.jit(
        lambda a, b: ref.dot_last(ref.dq(_qrow(a[None])), ref.dq(nf.quantize(b.T[None], (16, 16))))[
            0
        ].astype(dtype)
    )(x, w)
    assert y.dtype == dtype
    _assert_equal(y, want, "y")
    per_tensor = nvfp4_ops.dot_general(x, w, MATMUL, recipe="nvfp4-no-sr", backend="emulated")
    assert not np.array_equal(np.asarray(y, np.float32), np.asarray(per_tensor, np.float32))


def test_unaligned_tokens_are_padded_with_zero_rows():
    # M=5, K=24, N=7: padding adds zero rows (outer scale 1), changing no real row.
    x, w, _ = _data(m=5, k=24, n=7, seed=2)
    y = nvfp4_ops.dot_general(x, w, MATMUL, recipe=PER_TOKEN, key=KEY, backend="emulated")
    xp, wp = jnp.pad(x, ((0, 11), (0, 8))), jnp.pad(w, ((0, 8), (0, 9)))
    want = ref.dot_last(ref.dq(_qrow(xp[None])), ref.dq(nf.quantize(wp.T[None], (16, 16))))
    _assert_equal(y, want[0, :5, :7], "y")


# ----------------------------------------------------------------------------- xla vs emulated
@pytest.mark.skipif(not CAPS["xla"][0], reason=CAPS["xla"][1])
@pytest.mark.parametrize("recipe", [PER_TOKEN, ROW_GRAD, ROW_BOTH], ids=lambda r: r.name)
def test_xla_backend_agrees_with_emulated(recipe):
    x, w, dy = _data(seed=3)
    key = jax.random.key(11)
    emulated = _grads(recipe, "emulated")(x, w, dy, key)
    xla = _grads(recipe, "xla")(x, w, dy, key)
    # Wgrad contracts x^T and dY^T rotated along the tokens: its sum of |terms| is that of the
    # rotated operands, which can exceed |x|^T |dY| (the RHT spreads each token over 16).
    hx, hdy = (nvfp4_ops.hadamard_transform(t.T) for t in (x, dy))
    scales = (jnp.abs(x) @ jnp.abs(w), jnp.abs(dy) @ jnp.abs(w).T, jnp.abs(hx) @ jnp.abs(hdy).T)
    for name, a, b, scale in zip(("y", "dx", "dw"), emulated, xla, scales, strict=True):
        # Same codes and scales; only the FP32 summation order and where the (per-row) outer
        # scales are applied differ.
        err = np.abs(np.asarray(a) - np.asarray(b))
        assert (err <= 1e-5 * np.asarray(scale) + 1e-30).all(), (name, err.max())


def test_a_row_scaled_operand_is_never_used_transposed():
    q = nf.quantize(jnp.ones((1, 32, 32)), (1, 16), outer_scale="row")
    vals, scales, g = FORMAT_OPS["nvfp4"].gemm_operand(q, False)
    assert vals.shape == (1, 32, 32) and scales.shape == (1, 32, 2) and g.shape == (1, 32, 1)
    with pytest.raises(ValueError, match="row-scaled NVFP4 operand .* cannot be reused transposed"):
        FORMAT_OPS["nvfp4"].gemm_operand(q, True)


# ----------------------------------------------------------------------------- error, statistics
def _rows_over_30_binades():
    """[32, 64] rows of magnitude 2^0 ... 2^-31: the per-tensor scale flushes the smallest."""
    x = jax.random.normal(jax.random.key(5), (32, 64), jnp.float32)
    return x * jnp.exp2(-jnp.arange(32, dtype=jnp.float32))[:, None]


def _per_row_rel_error(x, xq):
    return jnp.linalg.norm(x - xq, axis=-1) / jnp.linalg.norm(x, axis=-1)


def test_row_scales_have_lower_error_on_rows_of_different_magnitudes():
    x = _rows_over_30_binades()
    per_tensor = TensorQuant("nvfp4", (1, 16))
    err_tensor = _per_row_rel_error(x, nf.dequantize(quantize_operand(x, per_tensor)))
    err_row = _per_row_rel_error(x, nf.dequantize(quantize_operand(x, ROW_X)))
    assert float(err_row.max()) < 0.2  # every row relative to its own amax
    assert float(err_tensor.max()) == 1.0  # the smallest rows decode to zero
    assert float(err_row.mean()) < float(err_tensor.mean()) / 2
    s_row, s_tensor = nvfp4_ops.operand_stats(x, ROW_X), nvfp4_ops.operand_stats(x, per_tensor)
    assert float(s_row["underflow"]) == 0.0 < float(s_tensor["underflow"])
    # The GEMM output too: per token, relative to the exact product.
    w = jax.random.normal(jax.random.key(6), (64, 16), jnp.float32) * 0.1
    exact = jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST)
    y_row = nvfp4_ops.dot_general(x, w, MATMUL, recipe=PER_TOKEN, key=KEY)
    y_tensor = nvfp4_ops.dot_general(x, w, MATMUL, recipe="nvfp4-no-sr")
    assert float(_per_row_rel_error(exact, y_row).mean()) < float(
        _per_row_rel_error(exact, y_tensor).mean() / 2
    )


def test_operand_stats_of_a_row_scaled_operand():
    x = _rows_over_30_binades()
    s = nvfp4_ops.operand_stats(x, ROW_X)
    xq = nf.dequantize(nf.quantize(x, (1, 16), outer_scale="row"))
    want = jnp.linalg.norm(x - xq) / jnp.linalg.norm(x)
    np.testing.assert_allclose(float(s["rel_error"]), float(want), rtol=1e-6)
    assert float(s["amax"]) == float(jnp.abs(x).max())
    assert 0.0 <= float(s["saturation"]) < 0.1 and float(s["underflow"]) == 0.0


@pytest.mark.parametrize("recipe", [PER_TOKEN, ROW_GRAD], ids=lambda r: r.name)
def test_gemm_operand_stats_runs_for_the_recipe(recipe):
    x, w, dy = _data(seed=4)
    stats = nvfp4_ops.gemm_operand_stats(x, w, dy, recipe, key=jax.random.key(0))
    assert sorted(stats) == ["dgrad_dy", "fprop_w", "fprop_x", "wgrad_dy", "wgrad_x"]
    for role, values in stats.items():
        assert sorted(values) == sorted(nvfp4_ops.STATS)
        assert all(np.isfinite(float(v)) for v in values.values()), role
    row_role = "fprop_x" if recipe is PER_TOKEN else "dgrad_dy"
    assert float(stats[row_role]["underflow"]) == 0.0
