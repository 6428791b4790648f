"""Per-row ("per-token") outer scales: `quantize(..., outer_scale="row")`.

Each row (index of the leading axes) must quantize exactly as that row alone as a one-row tensor:
checked against the plain references (`reference.py`, `reference_four_over_six.py`) row by row,
against the package's own per-tensor path, and against the scale formula written out here.
The JAX tests skip without JAX, so the file also runs where only NumPy is installed.
"""

from __future__ import annotations

import functools
import zlib

import ml_dtypes
import numpy as np
import pytest
import reference as ref
import reference_four_over_six as ref46
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from reference import as_bytes

import nvfp4_format as nf

E4M3 = ml_dtypes.float8_e4m3fn
F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)


def _seed(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def _spread_rows(shape, seed) -> np.ndarray:
    """float32 rows whose magnitudes differ by up to 2^+-20, with one all-zero row."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, shape[:-1] + (1,)))
    x.reshape(-1, shape[-1])[1] = 0.0
    return x.astype(F32)


def _same(a, b, what=""):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    np.testing.assert_array_equal(as_bytes(a), as_bytes(b), err_msg=what)


def _same_nvfp4(a, b):
    assert tuple(a.shape) == tuple(b.shape) and tuple(a.block_shape) == tuple(b.block_shape)
    _same(a.packed, b.packed, "packed")
    _same(a.block_scales, b.block_scales, "block_scales")
    _same(a.global_scale, b.global_scale, "global_scale")


def _row_formula(amax_row, e4m3_max=448.0) -> np.float32:
    """s_dec = 1 / min(6 * e4m3_max / amax, FLT_MAX) in float32; 1 for a zero row (spec sec. 2)."""
    amax_row = F32(amax_row)
    if amax_row == 0:
        return F32(1.0)
    with np.errstate(over="ignore"):
        s_enc = F32(min(F32(6.0 * e4m3_max) / amax_row, FLT_MAX))
    return F32(F32(1.0) / s_enc)


def check_rows_against_reference(x, q, *, rule="max", rounding="rne", uniform=None):
    """Every row of `q` equals the plain reference's quantization of that row alone."""
    lead = x.shape[:-1]
    assert np.asarray(q.global_scale).shape == (*lead, 1) and q.outer_scale == "row"
    codes = np.asarray(q.codes())
    scales = np.asarray(q.block_scales)
    gs = np.asarray(q.global_scale)
    dq = np.asarray(nf.dequantize(q))
    for idx in np.ndindex(lead):
        row = x[idx][None]
        u = None if uniform is None else np.asarray(uniform)[idx][None]
        if rule == "4over6":
            want_codes, want_scales, s_dec, _ = ref46.quantize(row, rounding=rounding, uniform=u)
        else:
            want_codes, want_scales, s_dec = ref.quantize(row, rounding=rounding, uniform=u)
        what = f"row {idx}"
        np.testing.assert_array_equal(codes[idx], want_codes[0], err_msg=f"codes {what}")
        _same(scales[idx], want_scales[0].astype(E4M3), f"block scales {what}")
        _same(gs[idx], np.array([s_dec], F32), f"global scale {what}")
        want_dq = ref.dequantize(want_codes, want_scales, s_dec)[0]
        _same(dq[idx], want_dq, f"dequantize {what}")


# ----------------------------------------------------------------------------- reference agreement
def test_each_row_matches_the_reference(dist, dtype):
    x = ref.sample(dist, (3, 4, 64), dtype, _seed(dist, np.dtype(dtype)))
    check_rows_against_reference(x, nf.quantize(x, outer_scale="row"))


def test_each_row_equals_that_row_quantized_alone():
    x = _spread_rows((5, 3, 48), 7)
    q = nf.quantize(x, outer_scale="row")
    for idx in np.ndindex(x.shape[:-1]):
        alone = nf.quantize(x[idx][None], outer_scale="tensor")
        _same(np.asarray(q.packed)[idx], alone.packed[0], f"packed {idx}")
        _same(np.asarray(q.block_scales)[idx], alone.block_scales[0], f"scales {idx}")
        _same(np.asarray(q.global_scale)[idx], alone.global_scale.reshape(1), f"scale {idx}")


def test_row_scale_is_the_spec_formula_per_row():
    x = _spread_rows((6, 64), 8)
    x[2, 5] = -6.0 * 448.0  # amax exactly 2688: s_enc = 1, s_dec = 1
    x[2] = np.clip(x[2], -2688.0, 2688.0)
    x[3] = 0.0
    x[3, 17] = 3.0  # s_enc = 2688 / 3 = 896
    gs = np.asarray(nf.quantize(x, outer_scale="row").global_scale)
    want = np.array([[_row_formula(np.abs(r).max())] for r in x], F32)
    _same(gs, want, "per-row s_dec")
    assert gs[1, 0] == 1.0 and gs[2, 0] == 1.0  # the zero row, and amax 2688
    assert gs[3, 0] == F32(1.0) / F32(896.0)
    gs46 = np.asarray(nf.quantize(x, outer_scale="row", block_scale_rule="4over6").global_scale)
    want46 = np.array([[_row_formula(np.abs(r).max(), 256.0)] for r in x], F32)
    _same(gs46, want46, "per-row s_dec, 4over6")
    assert gs46[3, 0] == F32(1.0) / F32(512.0)  # 1536 / 3


def test_one_dimensional_x_has_one_row():
    x = ref.sample("normal", (64,), F32, 9)
    q, t = nf.quantize(x, outer_scale="row"), nf.quantize(x)
    assert np.asarray(q.global_scale).shape == (1,) and q.outer_scale == "row"
    _same(q.packed, t.packed, "packed")
    _same(q.global_scale, t.global_scale.reshape(1), "scale")
    _same(nf.dequantize(q), nf.dequantize(t), "dequantize")


@given(
    hnp.arrays(
        F32,
        st.tuples(st.integers(1, 4), st.sampled_from([16, 32])),
        elements=st.floats(-1e6, 1e6, width=32, allow_subnormal=False),
    )
)
def test_property_rows_are_independent(x):
    q = nf.quantize(x, outer_scale="row")
    for i in range(x.shape[0]):
        alone = nf.quantize(x[i : i + 1])
        _same(np.asarray(q.packed)[i : i + 1], alone.packed, "packed")
        _same(np.asarray(q.global_scale)[i], alone.global_scale.reshape(1), "scale")
        _same(nf.dequantize(q)[i : i + 1], nf.dequantize(alone), "dequantize")


# ----------------------------------------------------------------------------- zeros, non-finite
def test_all_zero_rows_get_scale_one_and_zero_codes():
    x = _spread_rows((4, 32), 10)
    x[3] = 0.0
    x[0, :16] = 0.0  # a zero block in a nonzero row
    q = nf.quantize(x, outer_scale="row")
    gs = np.asarray(q.global_scale)
    assert gs[1, 0] == 1.0 and gs[3, 0] == 1.0
    for r in (1, 3):
        assert not np.asarray(q.codes())[r].any() and not np.asarray(q.packed)[r].any()
        assert not np.asarray(q.block_scales)[r].astype(F32).any()
        assert not nf.dequantize(q)[r].any()
    assert not np.asarray(q.codes())[0, :16].any() and np.asarray(q.codes())[0, 16:].any()
    check_rows_against_reference(x, q)
    zeros = nf.quantize(np.zeros((2, 3, 16), F32), outer_scale="row")
    _same(zeros.global_scale, np.ones((2, 3, 1), F32), "all-zero tensor")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_numpy_nonfinite_input_raises(bad):
    x = _spread_rows((3, 32), 11)
    x[2, 7] = bad
    with pytest.raises(ValueError, match=r"non-finite value\(s\).*index \(2, 7\)"):
        nf.quantize(x, outer_scale="row")


# ----------------------------------------------------------------------------- 4over6, stochastic
@pytest.mark.parametrize("metric", ["mse", "l1", "max_abs"])
def test_four_over_six_rows_match_the_reference(metric):
    x = ref.sample("mixed", (3, 2, 64), F32, _seed("46", metric))
    q = nf.quantize(x, outer_scale="row", block_scale_rule="4over6", error_metric=metric)
    for idx in np.ndindex(x.shape[:-1]):
        codes, scales, s_dec, _ = ref46.quantize(x[idx][None], metric=metric)
        np.testing.assert_array_equal(np.asarray(q.codes())[idx], codes[0])
        _same(np.asarray(q.block_scales)[idx], scales[0].astype(E4M3), f"scales {idx}")
        _same(np.asarray(q.global_scale)[idx], np.array([s_dec], F32), f"scale {idx}")


def test_four_over_six_with_row_scales_is_each_row_alone():
    x = _spread_rows((4, 2, 64), 12)
    q = nf.quantize(x, outer_scale="row", block_scale_rule="4over6")
    check_rows_against_reference(x, q, rule="4over6")


@pytest.mark.parametrize("rule", ["max", "4over6"])
def test_stochastic_rounding_with_row_scales(rule):
    x = _spread_rows((3, 2, 32), _seed("sr", rule))
    u = np.random.default_rng(13).random(x.shape, dtype=F32)
    q = nf.quantize(x, outer_scale="row", rounding="stochastic", uniform=u, block_scale_rule=rule)
    check_rows_against_reference(x, q, rule=rule, rounding="stochastic", uniform=u)
    rne = nf.quantize(x, outer_scale="row", block_scale_rule=rule)
    _same(q.block_scales, rne.block_scales, "SR changes no scale")
    assert not np.array_equal(np.asarray(q.packed), np.asarray(rne.packed))


# ----------------------------------------------------------------------------- global_amax
def test_global_amax_per_row_in_both_shapes():
    x = _spread_rows((3, 2, 32), 14)
    g = (np.abs(x).max(axis=-1) * np.array([1.0, 3.0], F32)).astype(F32)  # some rows saturate-free
    q1 = nf.quantize(x, outer_scale="row", global_amax=g)
    q2 = nf.quantize(x, outer_scale="row", global_amax=g[..., None])
    _same_nvfp4(q1, q2)
    for idx in np.ndindex(x.shape[:-1]):
        codes, scales, s_dec = ref.quantize(x[idx][None], global_amax=g[idx])
        np.testing.assert_array_equal(np.asarray(q1.codes())[idx], codes[0])
        _same(np.asarray(q1.global_scale)[idx], np.array([s_dec], F32), f"scale {idx}")


def test_global_amax_per_row_is_validated():
    x = _spread_rows((3, 32), 15)
    with pytest.raises(
        ValueError, match=r"one amax per row, shape \(3, 1\) or \(3,\), got shape \(\)"
    ):
        nf.quantize(x, outer_scale="row", global_amax=F32(2.0))
    with pytest.raises(ValueError, match=r"got shape \(1, 3\)"):
        nf.quantize(x, outer_scale="row", global_amax=np.ones((1, 3), F32))
    with pytest.raises(ValueError, match="finite and >= 0, got -1.0"):
        nf.quantize(x, outer_scale="row", global_amax=np.array([1.0, -1.0, 2.0], F32))
    with pytest.raises(ValueError, match="finite and >= 0, got nan"):
        nf.quantize(x, outer_scale="row", global_amax=np.array([1.0, np.nan, 2.0], F32))
    with pytest.raises(ValueError, match="global_amax must be a scalar"):
        nf.quantize(x, global_amax=np.ones(3, F32))  # per-tensor: unchanged


# ----------------------------------------------------------------------------- errors, container
def test_sixteen_by_sixteen_tiles_are_refused():
    x = _spread_rows((32, 32), 16)
    with pytest.raises(ValueError, match=r"outer_scale='row' needs block_shape=\(1, 16\)"):
        nf.quantize(x, (16, 16), outer_scale="row")
    with pytest.raises(ValueError, match=r"outer_scale must be one of \('tensor', 'row'\)"):
        nf.quantize(x, outer_scale="column")
    t = nf.quantize(x, (16, 16))
    with pytest.raises(ValueError, match="per-row global scales needs 1x16 blocks"):
        nf.NVFP4Array(t.packed, t.block_scales, np.ones((32, 1), F32), t.shape, (16, 16))


def test_container_validation_and_outer_scale():
    x = _spread_rows((2, 3, 32), 17)
    q = nf.quantize(x, outer_scale="row")
    assert q.outer_scale == "row" and nf.quantize(x).outer_scale == "tensor"
    again = nf.NVFP4Array(q.packed, q.block_scales, np.asarray(q.global_scale), q.shape)
    _same_nvfp4(again, q)
    with pytest.raises(ValueError, match=r"global_scale must have shape \(2, 3, 1\)"):
        nf.NVFP4Array(q.packed, q.block_scales, np.ones((2, 3, 2), F32), q.shape)
    with pytest.raises(ValueError, match="leading"):
        nf.NVFP4Array(q.packed, q.block_scales, np.ones((3,), F32), q.shape)
    with pytest.raises(TypeError, match="global_scale must have dtype float32"):
        nf.NVFP4Array(q.packed, q.block_scales, np.ones((2, 3, 1), np.float64), q.shape)


def test_nbytes_counts_four_bytes_per_row_scale():
    x = _spread_rows((3, 5, 64), 18)
    q, t = nf.quantize(x, outer_scale="row"), nf.quantize(x)
    assert t.nbytes == 3 * 5 * 32 + 3 * 5 * 4 + 4
    assert q.nbytes == 3 * 5 * 32 + 3 * 5 * 4 + 4 * 3 * 5


def test_dequantize_round_trip_and_error_versus_the_tensor_scale():
    rng = np.random.default_rng(19)
    exponents = np.array([4, 0, -4, -8, -12, -16, -20, -24], F32)[:, None]
    x = (rng.standard_normal((8, 64)) * np.exp2(exponents)).astype(F32)
    q, t = nf.quantize(x, outer_scale="row"), nf.quantize(x)
    # Decoding is (e2m1 value * block scale) * that row's scale, in float32.
    sb = np.repeat(np.asarray(q.block_scales).astype(F32), 16, axis=-1)
    by_hand = (ref.decode_e2m1(np.asarray(q.codes())) * sb) * np.asarray(q.global_scale)
    _same(nf.dequantize(q), by_hand.astype(F32), "decode")
    _same(nf.dequantize(q, dtype=ml_dtypes.bfloat16), nf.dequantize(q).astype(ml_dtypes.bfloat16))
    amax = np.abs(x).max(axis=-1)
    rel_row = np.abs(nf.dequantize(q) - x).max(axis=-1) / amax
    rel_tensor = np.abs(nf.dequantize(t) - x).max(axis=-1) / amax
    # Per row the error is relative to that row's amax (half the top E2M1 step, 1 of 6, times
    # the E4M3 rounding of the block scale); the tensor scale flushes the smallest rows to 0.
    assert rel_row.max() <= 0.25, rel_row
    _same(nf.dequantize(q)[0], nf.dequantize(t)[0], "the row holding the tensor amax")
    assert (rel_tensor[-2:] == 1.0).all() and not nf.dequantize(t)[-2:].any()
    assert rel_row.mean() < rel_tensor.mean() / 2


@pytest.mark.parametrize("shape", [(0, 32), (4, 0), (0,), (2, 0, 32)])
def test_zero_size_input(shape):
    q = nf.quantize(np.zeros(shape, F32), outer_scale="row")
    assert q.outer_scale == "row"
    assert np.asarray(q.global_scale).shape == (*shape[:-1], 1)
    assert (np.asarray(q.global_scale) == 1.0).all() and not nf.has_nonfinite(q)
    assert nf.dequantize(q).shape == shape


def test_has_nonfinite_is_false_for_numpy_results():
    q = nf.quantize(_spread_rows((3, 32), 20), outer_scale="row")
    assert not bool(nf.has_nonfinite(q)) and np.asarray(nf.has_nonfinite(q)).shape == ()


# ----------------------------------------------------------------------------- JAX
@functools.cache
def _jit_row(**kwargs):
    jax = pytest.importorskip("jax")
    return jax.jit(
        lambda v, u=None, g=None: nf.quantize(
            v, outer_scale="row", uniform=u, global_amax=g, **kwargs
        )
    )


def _jnp():
    pytest.importorskip("jax")
    import jax.numpy as jnp

    return jnp


@pytest.mark.parametrize("rule", ["max", "4over6"])
def test_jax_and_numpy_give_identical_bytes(dist, dtype, rule):
    jnp = _jnp()
    x = ref.sample(dist, (2, 3, 64), dtype, _seed("jax", dist, np.dtype(dtype), rule))
    want = nf.quantize(x, outer_scale="row", block_scale_rule=rule)
    got = _jit_row(block_scale_rule=rule)(jnp.asarray(x))
    _same_nvfp4(got, want)
    _same(nf.dequantize(got), nf.dequantize(want), "dequantize")
    if dist == "mixed":  # eager JAX too
        _same_nvfp4(nf.quantize(jnp.asarray(x), outer_scale="row", block_scale_rule=rule), want)


@pytest.mark.parametrize("rule", ["max", "4over6"])
def test_jax_stochastic_and_global_amax_identical_bytes(rule):
    jnp = _jnp()
    x = _spread_rows((4, 2, 32), 21)
    u = np.random.default_rng(22).random(x.shape, dtype=F32)
    g = (np.abs(x).max(axis=-1, keepdims=True) * 2).astype(F32)
    kwargs = {"rounding": "stochastic", "block_scale_rule": rule}
    want = nf.quantize(x, outer_scale="row", uniform=u, global_amax=g, **kwargs)
    got = _jit_row(**kwargs)(jnp.asarray(x), jnp.asarray(u), jnp.asarray(g))
    _same_nvfp4(got, want)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("rule", ["max", "4over6"])
def test_jax_nonfinite_marks_only_that_row(bad, rule):
    jnp = _jnp()
    x = _spread_rows((3, 2, 32), 23)
    finite = nf.quantize(x, outer_scale="row", block_scale_rule=rule)
    x[1, 0, 9] = bad
    got = _jit_row(block_scale_rule=rule)(jnp.asarray(x))
    gs = np.asarray(got.global_scale)
    assert np.isnan(gs[1, 0, 0]) and np.isnan(gs).sum() == 1
    assert bool(nf.has_nonfinite(got))
    dq = np.asarray(nf.dequantize(got))
    assert np.isnan(dq[1, 0]).all() and np.isfinite(np.delete(dq.reshape(6, 32), 2, 0)).all()
    others = [i for i in np.ndindex(3, 2) if i != (1, 0)]
    for idx in others:  # every other row is untouched by the bad one
        _same(np.asarray(got.packed)[idx], np.asarray(finite.packed)[idx], f"packed {idx}")
        _same(gs[idx], np.asarray(finite.global_scale)[idx], f"scale {idx}")


def test_jax_vmap_keeps_the_per_row_layout():
    jnp = _jnp()
    import jax

    x = _spread_rows((2, 3, 32), 24)
    x[1, 2, 3] = np.nan
    got = jax.vmap(lambda v: nf.quantize(v, outer_scale="row"))(jnp.asarray(x))
    assert got.outer_scale == "row" and np.asarray(got.global_scale).shape == (2, 3, 1)
    flat = nf.quantize(jnp.asarray(x), outer_scale="row")
    assert got.shape == (3, 32)  # the logical shape of one example; the fields carry the batch
    for name in ("packed", "block_scales", "global_scale"):
        _same(getattr(got, name), getattr(flat, name), name)
    assert np.asarray(jax.vmap(nf.has_nonfinite)(got)).tolist() == [False, True]
    assert np.asarray(nf.has_nonfinite(got)).tolist() == [False, True]  # batch axis kept


def test_jax_zero_size_input():
    jnp = _jnp()
    q = _jit_row()(jnp.zeros((3, 0), jnp.float32))
    _same(q.global_scale, np.ones((3, 1), F32), "empty rows")
