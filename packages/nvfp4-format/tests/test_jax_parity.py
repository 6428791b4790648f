"""NumPy path vs JAX path (eager and under jax.jit): identical bytes for every public function."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import reference as ref
from reference import as_bytes

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import nvfp4_format as nf  # noqa: E402


@functools.cache
def _jit_quantize(block_shape):
    """One jitted function per block shape, so compiles are shared across tests."""
    return jax.jit(lambda v: nf.quantize(v, block_shape=block_shape))


@functools.cache
def _jit_quantize_mxfp4(rule):
    return jax.jit(lambda v: nf.quantize_mxfp4(v, rule))


def _same(a, b, what=""):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} vs {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {a.shape} vs {b.shape}"
    np.testing.assert_array_equal(as_bytes(a), as_bytes(b), err_msg=what)


def _same_nvfp4(a, b):
    assert tuple(a.shape) == tuple(b.shape)
    assert tuple(a.block_shape) == tuple(b.block_shape)
    _same(a.packed, b.packed, "packed")
    _same(a.block_scales, b.block_scales, "block_scales")
    _same(a.global_scale, b.global_scale, "global_scale")


@pytest.mark.parametrize("block_shape", [(1, 16), (16, 16)])
def test_quantize_identical_bytes(dist, dtype, block_shape):
    x = ref.sample(dist, (2, 32, 64), dtype, 101)
    want = nf.quantize(x, block_shape=block_shape)
    jitted = _jit_quantize(block_shape)(jnp.asarray(x))
    checks = [jitted]
    if dist == "mixed":  # the eager (op-by-op) JAX path, once per dtype and block shape
        checks.append(nf.quantize(jnp.asarray(x), block_shape=block_shape))
    for got in checks:
        assert isinstance(np.asarray(got.packed), np.ndarray)
        _same_nvfp4(got, want)
    _same(jax.jit(nf.dequantize)(jitted), nf.dequantize(want), "dequantize")
    _same(nf.dequantize(jitted, dtype=jnp.bfloat16), nf.dequantize(want, dtype=jnp.bfloat16))


@pytest.mark.parametrize("block_shape", [(1, 16), (16, 16)])
def test_quantize_stochastic_and_global_amax_identical_bytes(dist, block_shape):
    x = ref.sample(dist, (32, 64), np.float32, 102)
    u = jax.random.uniform(jax.random.key(0), x.shape, jnp.float32)
    g = np.float32(np.abs(x).max() * 3)
    want = nf.quantize(x, block_shape, global_amax=g, rounding="stochastic", uniform=np.asarray(u))

    def fn(v, amax, uni):
        return nf.quantize(v, block_shape, global_amax=amax, rounding="stochastic", uniform=uni)

    _same_nvfp4(jax.jit(fn)(jnp.asarray(x), jnp.float32(g), u), want)


def _two_value_tensor(amax: float) -> np.ndarray:
    x = np.zeros((2, 32), np.float32)
    x[0, 0], x[1, 17] = amax, -amax / 3
    return x


def test_tiny_amax_identical_bytes():
    for amax in (1e-20, 1e-30, 4e-35):
        x = _two_value_tensor(amax)
        got, want = _jit_quantize((1, 16))(jnp.asarray(x)), nf.quantize(x)
        _same_nvfp4(got, want)
        _same(nf.dequantize(got), nf.dequantize(want), f"dequantize amax={amax}")


def test_subnormal_elements_in_a_normal_tensor_identical_bytes():
    """Subnormal inputs (e.g. tiny gradients) inside normal-scale blocks: codes 0 / 8 both ways."""
    x = ref.sample("normal", (2, 32), np.float32, 110)
    x[0, 3], x[1, 5], x[1, 6] = -1e-40, 1e-41, -0.0
    want = nf.quantize(x)
    _same_nvfp4(_jit_quantize((1, 16))(jnp.asarray(x)), want)
    assert np.asarray(want.codes())[0, 3] == 8 and np.asarray(want.codes())[1, 5] == 0
    m = nf.quantize_mxfp4(x)
    _same(_jit_quantize_mxfp4("ocp")(jnp.asarray(x)).packed, m.packed)


FTZ_REASON = (
    "documented platform difference: XLA flushes float32 subnormals to zero (FTZ/DAZ) and NumPy "
    "keeps them, so tensors whose amax is below ~2^-105 (where the spec's float32 scales become "
    "subnormal) may quantize differently; see the nvfp4-format README, 'Numerics'"
)


@pytest.mark.xfail(strict=True, reason=FTZ_REASON)
@pytest.mark.parametrize("amax", [1e-35, 1e-36, 1e-40])
def test_subnormal_global_scale_identical_bytes(amax):
    """amax < 2688 * 2^-126 (~3.2e-35) makes s_dec = 1/s_enc a float32 subnormal; below ~7.9e-36
    s_enc = FLT_MAX and s_dec = 2^-128; for 1e-40 the input itself is subnormal.

    Spec section 2 is plain float32 arithmetic, which keeps subnormals (NumPy does); XLA on CPU
    flushes them to zero, so the JAX path must avoid producing or consuming them to agree.
    """
    x = _two_value_tensor(amax)
    got, want = _jit_quantize((1, 16))(jnp.asarray(x)), nf.quantize(x)
    _same_nvfp4(got, want)
    _same(nf.dequantize(got), nf.dequantize(want), f"dequantize amax={amax}")


def test_e2m1_and_packing_identical_bytes(dtype):
    x = ref.sample("student_t", (8, 64), dtype, 103)
    u = np.random.default_rng(104).random(x.shape, dtype=np.float32)
    xj, uj = jnp.asarray(x), jnp.asarray(u)
    _same(jax.jit(nf.encode_e2m1)(xj), nf.encode_e2m1(x), "encode rne")
    sr = jax.jit(lambda v, w: nf.encode_e2m1(v, "stochastic", w))(xj, uj)
    _same(sr, nf.encode_e2m1(x, "stochastic", u), "encode sr")
    codes = np.asarray(nf.encode_e2m1(x))
    _same(jax.jit(nf.decode_e2m1)(jnp.asarray(codes)), nf.decode_e2m1(codes), "decode")
    packed = jax.jit(nf.pack_fp4)(jnp.asarray(codes))
    _same(packed, nf.pack_fp4(codes), "pack")
    _same(jax.jit(nf.unpack_fp4)(packed), codes, "unpack")


@pytest.mark.parametrize("rule", ["ocp", "ceil"])
def test_mxfp4_identical_bytes(dist, dtype, rule):
    x = ref.sample(dist, (4, 96), dtype, 105)
    want = nf.quantize_mxfp4(x, rule)
    got = _jit_quantize_mxfp4(rule)(jnp.asarray(x))
    assert tuple(got.shape) == tuple(want.shape) and got.scale_rule == want.scale_rule
    _same(got.packed, want.packed, "packed")
    _same(got.scales, want.scales, "scales")
    _same(jax.jit(nf.dequantize_mxfp4)(got), nf.dequantize_mxfp4(want), "dequantize")


def test_mxfp4_stochastic_identical_bytes():
    x = ref.sample("normal", (4, 64), np.float32, 106)
    u = np.random.default_rng(107).random(x.shape, dtype=np.float32)
    want = nf.quantize_mxfp4(x, "ceil", rounding="stochastic", uniform=u)

    def fn(v, w):
        return nf.quantize_mxfp4(v, "ceil", rounding="stochastic", uniform=w)

    got = jax.jit(fn)(jnp.asarray(x), jnp.asarray(u))
    _same(got.packed, want.packed)
    _same(got.scales, want.scales)


@pytest.mark.xfail(strict=True, reason=FTZ_REASON)
def test_mxfp4_clamped_exponent_identical_bytes():
    """Block amax 2^-126 clamps e to -127 (byte 0, value 2^-127): JAX must decode it the same."""
    x = np.zeros((1, 32), np.float32)
    x[0, :2] = [2.0**-126, -(2.0**-127)]
    want = nf.quantize_mxfp4(x)
    got = jax.jit(nf.quantize_mxfp4)(jnp.asarray(x))
    _same(got.packed, want.packed)
    _same(got.scales, want.scales)
    _same(jax.jit(nf.dequantize_mxfp4)(got), nf.dequantize_mxfp4(want))


@pytest.mark.parametrize("shape", [(130, 5), (2, 129, 3)])
def test_swizzle_identical_bytes(shape):
    s = (np.arange(int(np.prod(shape))).reshape(shape) % 251 + 1).astype(np.uint8)
    for arr in (s, s.view(jnp.float8_e4m3fn)):
        want = nf.swizzle_scales(arr)
        got = jax.jit(nf.swizzle_scales)(jnp.asarray(arr))
        _same(got, want, "swizzle")
        back = jax.jit(lambda v: nf.unswizzle_scales(v, shape[-2], shape[-1]))(got)
        _same(back, arr, "unswizzle")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("jit", [False, True])
def test_nonfinite_jax_input_gives_nan_global_scale(bad, jit):
    x = ref.sample("normal", (4, 32), np.float32, 108)
    x[2, 7] = bad
    fn = jax.jit(nf.quantize) if jit else nf.quantize
    a = fn(jnp.asarray(x))
    assert np.isnan(np.asarray(a.global_scale))
    assert np.isnan(np.asarray(nf.dequantize(a))).all()
    assert bool(nf.has_nonfinite(a))
    assert not bool(nf.has_nonfinite(nf.quantize(jnp.asarray(np.nan_to_num(x)))))


def test_nvfp4_array_is_a_pytree():
    x = jnp.asarray(ref.sample("normal", (16, 32), np.float32, 109))
    a = nf.quantize(x, block_shape=(16, 16))
    leaves, treedef = jax.tree_util.tree_flatten(a)
    assert len(leaves) == 3
    b = jax.tree_util.tree_unflatten(treedef, leaves)
    assert tuple(b.shape) == (16, 32) and tuple(b.block_shape) == (16, 16)
    _same_nvfp4(b, a)
    # an NVFP4Array passes through jit boundaries as an argument and a result
    c = jax.jit(lambda q: q)(a)
    _same_nvfp4(c, a)
    _same(jax.jit(nf.dequantize)(a), nf.dequantize(a))


@pytest.mark.parametrize("amax", [2.0**-105, 1e-31, 1e-25])
def test_tiny_tensors_above_the_subnormal_regime_identical_bytes(amax):
    """Above amax ~2^-105 no float32 intermediate of spec section 2 is subnormal: bytes agree.

    The tensor holds a block at the tensor amax and a block 2^-10 below it (the smallest nonzero
    E4M3 scale region), so s_dec and sb * s_dec are both near the bottom of the normal range.
    """
    x = np.zeros((2, 32), np.float32)
    x[0, :16] = np.linspace(-amax, amax, 16, dtype=np.float32)
    x[1, 16:] = np.float32(amax * 2.0**-10) * np.linspace(-1, 1, 16, dtype=np.float32)
    got, want = _jit_quantize((1, 16))(jnp.asarray(x)), nf.quantize(x)
    _same_nvfp4(got, want)
    _same(nf.dequantize(got), nf.dequantize(want), f"dequantize amax={amax}")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_input_marks_the_tensor_even_with_a_shared_global_amax(bad):
    x = np.ones((2, 32), np.float32)
    x[1, 3] = bad
    q = jax.jit(lambda v: nf.quantize(v, global_amax=4.0))(jnp.asarray(x))
    assert bool(nf.has_nonfinite(q))
    assert np.isnan(np.asarray(nf.dequantize(q))).all()


# ----------------------------------------------------------------------------- Four Over Six
@functools.cache
def _jit_quantize_4over6(block_shape, metric):
    return jax.jit(
        lambda v: nf.quantize(v, block_shape, block_scale_rule="4over6", error_metric=metric)
    )


@pytest.mark.parametrize("metric", ["mse", "l1", "max_abs"])
@pytest.mark.parametrize("block_shape", [(1, 16), (16, 16)])
def test_four_over_six_identical_bytes(dist, dtype, block_shape, metric):
    x = ref.sample(dist, (2, 32, 64), dtype, 120)
    want = nf.quantize(x, block_shape, block_scale_rule="4over6", error_metric=metric)
    got = _jit_quantize_4over6(block_shape, metric)(jnp.asarray(x))
    _same_nvfp4(got, want)
    if dist == "mixed" and metric == "mse":  # the eager JAX path too
        eager = nf.quantize(jnp.asarray(x), block_shape, block_scale_rule="4over6")
        _same_nvfp4(eager, want)
    _same(jax.jit(nf.dequantize)(got), nf.dequantize(want), "dequantize")


def test_four_over_six_fma_sensitive_input_identical_bytes():
    """An input where XLA's fused multiply-add changes the choice: with the products feeding the
    error sums not held apart from the additions (four_over_six._unfused replaced by the identity)
    2 of these 4096 blocks chose the other candidate under jit (measured: their l1 errors differ
    by ~2e-7 relative, e.g. 30.668582 vs 30.668577, near the float32 resolution)."""
    x = ref.sample("cauchy", (4, 64, 256), np.float32, 11)
    want = nf.quantize(x, block_scale_rule="4over6", error_metric="l1")
    _same_nvfp4(_jit_quantize_4over6((1, 16), "l1")(jnp.asarray(x)), want)


@pytest.mark.parametrize("block_shape", [(1, 16), (16, 16)])
def test_four_over_six_stochastic_and_global_amax_identical_bytes(block_shape):
    x = ref.sample("student_t", (32, 64), np.float32, 121)
    u = jax.random.uniform(jax.random.key(1), x.shape, jnp.float32)
    g = np.float32(np.abs(x).max() * 2)
    kw = dict(block_scale_rule="4over6", rounding="stochastic")
    want = nf.quantize(x, block_shape, global_amax=g, uniform=np.asarray(u), **kw)

    def fn(v, amax, uni):
        return nf.quantize(v, block_shape, global_amax=amax, uniform=uni, **kw)

    _same_nvfp4(jax.jit(fn)(jnp.asarray(x), jnp.float32(g), u), want)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_four_over_six_nonfinite_jax_input_gives_nan_global_scale(bad):
    x = ref.sample("normal", (4, 32), np.float32, 122)
    x[1, 9] = bad
    a = _jit_quantize_4over6((1, 16), "mse")(jnp.asarray(x))
    assert bool(nf.has_nonfinite(a))
    assert np.isnan(np.asarray(nf.dequantize(a))).all()


# ----------------------------------------------------------------------------- MXFP8
@functools.cache
def _jit_quantize_mxfp8(rule):
    return jax.jit(lambda v: nf.quantize_mxfp8(v, rule))


@pytest.mark.parametrize("rule", ["ocp", "ceil"])
def test_mxfp8_identical_bytes(dist, dtype, rule):
    x = ref.sample(dist, (4, 96), dtype, 123)
    want = nf.quantize_mxfp8(x, rule)
    got = _jit_quantize_mxfp8(rule)(jnp.asarray(x))
    assert tuple(got.shape) == tuple(want.shape) and got.scale_rule == want.scale_rule
    _same(got.data, want.data, "data")
    _same(got.scales, want.scales, "scales")
    _same(jax.jit(nf.dequantize_mxfp8)(got), nf.dequantize_mxfp8(want), "dequantize")
    if dist == "mixed":
        eager = nf.quantize_mxfp8(jnp.asarray(x), rule)
        _same(eager.data, want.data, "eager data")


def test_mxfp8_every_code_and_midpoint_identical_bytes():
    """All finite E4M3 codes, the midpoints between them (ties) and values beyond 448."""
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    vals = codes.view(jnp.float8_e4m3fn).astype(np.float32)
    pos = np.sort(vals[vals > 0])
    mids = ((pos[1:] + pos[:-1]) / 2).astype(np.float32)
    extra = np.array([449, 464, 479, 500, 511.9], np.float32)
    v = np.concatenate([vals, mids, -mids, extra, -extra])
    x = np.zeros((-(-v.size // 31), 32), np.float32)
    x[:, 0] = 448.0
    x[:, 1:].reshape(-1)[: v.size] = v
    for rule in ("ocp", "ceil"):
        want = nf.quantize_mxfp8(x, rule)
        got = _jit_quantize_mxfp8(rule)(jnp.asarray(x))
        _same(got.data, want.data, f"data {rule}")
        _same(got.scales, want.scales, f"scales {rule}")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_mxfp8_nonfinite_jax_input_marks_its_block(bad):
    x = ref.sample("normal", (2, 64), np.float32, 124)
    x[1, 40] = bad
    a = _jit_quantize_mxfp8("ocp")(jnp.asarray(x))
    s = np.asarray(a.scales)
    assert s[1, 1] == 255 and (s[0] != 255).all() and s[1, 0] != 255
    out = np.asarray(jax.jit(nf.dequantize_mxfp8)(a))
    assert (
        np.isnan(out[1, 32:]).all() and np.isfinite(out[0]).all() and np.isfinite(out[1, :32]).all()
    )


def test_mxfp8_array_is_a_pytree():
    a = nf.quantize_mxfp8(jnp.asarray(ref.sample("normal", (2, 64), np.float32, 125)), "ceil")
    leaves, treedef = jax.tree_util.tree_flatten(a)
    assert len(leaves) == 2
    b = jax.jit(lambda q: q)(jax.tree_util.tree_unflatten(treedef, leaves))
    assert b.scale_rule == "ceil" and tuple(b.shape) == (2, 64)
    _same(b.data, a.data)
    _same(b.scales, a.scales)
