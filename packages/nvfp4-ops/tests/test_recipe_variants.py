"""The full recipe's variants (Four Over Six, an MXFP8 backward) and per-GEMM `compose`.

Each preset's three GEMMs are checked bit for bit against the recipe written plainly with
`nvfp4_format` (as `ops_reference` does for the paper's recipe), and `compose` against the presets
it must reproduce.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import ops_reference as ref
import pytest
from vjp_cases import operands, vjp_of

import nvfp4_format as nf
import nvfp4_ops
from nvfp4_ops.recipe import BF16, Recipe, TensorQuant, compose
from nvfp4_ops.te_backend import te_unsupported


def _data(seed=0):
    return operands(64, 64, 32, seed=seed)


def _assert_equal(got, want):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# --- Four Over Six --------------------------------------------------------------------------


def _four_over_six_reference(x, w, dy, key):
    """The "nvfp4-4over6" GEMMs: every operand with 4/6 block scales, RHT + SR as the paper's."""
    rule = {"block_scale_rule": "4over6"}
    ks = jax.random.split(key, 6)
    qx = nf.quantize(x[None], (1, 16), **rule)
    qw = nf.quantize(w.T[None], (16, 16), **rule)
    y = ref.dot_last(ref.dq(qx), ref.dq(qw))
    u = ref.uniform8(ks[2], (1, *dy.shape))
    qdy = nf.quantize(dy[None], (1, 16), rounding="stochastic", uniform=u, **rule)
    dx = ref.dot_last(ref.dq(qdy), jnp.swapaxes(ref.dq(qw), -1, -2))
    xt, dyt = ref.rotate(x.T[None]), ref.rotate(dy.T[None])
    qxt = nf.quantize(xt, (1, 16), **rule)
    u = ref.uniform8(ks[5], dyt.shape)
    qdyt = nf.quantize(dyt, (1, 16), rounding="stochastic", uniform=u, **rule)
    dw = ref.dot_last(ref.dq(qxt), ref.dq(qdyt))
    return y[0], dx[0], dw[0]


def test_four_over_six_recipe_matches_the_plain_reference_bit_exactly():
    x, w, dy = _data()
    key = jax.random.key(7)
    got = vjp_of("nvfp4-4over6")(x, w, dy, key)
    want = jax.jit(_four_over_six_reference)(x, w, dy, key)
    for g, r in zip(got, want, strict=True):
        _assert_equal(g, r)
    # It is not the standard recipe: some block chose amax -> 4.
    standard = vjp_of("nvfp4")(x, w, dy, key)
    assert not np.array_equal(np.asarray(got[0]), np.asarray(standard[0]))


def test_four_over_six_is_closer_to_fp32_than_max_scaling_on_the_forward():
    x, w, dy = _data(seed=3)
    exact = x @ w
    err = {}
    for name in ("nvfp4", "nvfp4-4over6"):
        y = vjp_of(name)(x, w, dy, jax.random.key(0))[0]
        err[name] = float(jnp.sum((y - exact) ** 2))
    assert err["nvfp4-4over6"] < err["nvfp4"]


# --- NVFP4 forward, MXFP8 backward ----------------------------------------------------------


def _mx8(a):
    return nf.dequantize_mxfp8(nf.quantize_mxfp8(a, "ceil"), jnp.float32)


def _mxfp8_backward_reference(x, w, dy):
    """NVFP4 Fprop; Dgrad and Wgrad on MXFP8 operands (blocks of 32 along each contraction,
    rounded-up E8M0 scales, round to nearest, no RHT)."""
    y = ref.fprop(x, w)[0]
    dx = ref.dot_last(_mx8(dy[None]), _mx8(w[None]))  # W [K, N] blocked along N
    dw = ref.dot_last(_mx8(x.T[None]), _mx8(dy.T[None]))
    return y[0], dx[0], dw[0]


@pytest.mark.parametrize("backend", ["emulated", "xla"])
def test_mxfp8_backward_recipe_matches_the_plain_reference(backend):
    x, w, dy = _data()
    got = vjp_of("nvfp4-fwd-mxfp8-bwd", backend)(x, w, dy, None)
    want = jax.jit(_mxfp8_backward_reference)(x, w, dy)
    if backend == "emulated":
        for g, r in zip(got, want, strict=True):
            _assert_equal(g, r)
    else:  # block-scaled dot: FP32 summation order differs
        for g, r in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-5, atol=1e-6)


def test_mxfp8_backward_recipe_needs_no_key_and_keeps_the_nvfp4_forward():
    recipe = nvfp4_ops.get_recipe("nvfp4-fwd-mxfp8-bwd")
    assert not recipe.needs_key and recipe.alignment == 32
    x, w, dy = _data()
    y8 = vjp_of(recipe)(x, w, dy, None)[0]
    y4 = vjp_of("nvfp4")(x, w, dy, jax.random.key(1))[0]
    _assert_equal(y8, y4)


def test_mxfp8_gradients_are_closer_to_fp32_than_nvfp4_gradients():
    x, w, dy = _data(seed=5)
    exact_dx, exact_dw = dy @ w.T, x.T @ dy
    err = {}
    for name, key in (("nvfp4", jax.random.key(2)), ("nvfp4-fwd-mxfp8-bwd", None)):
        _, dx, dw = vjp_of(name)(x, w, dy, key)
        err[name] = (float(jnp.sum((dx - exact_dx) ** 2)), float(jnp.sum((dw - exact_dw) ** 2)))
    assert err["nvfp4-fwd-mxfp8-bwd"][0] < err["nvfp4"][0]
    assert err["nvfp4-fwd-mxfp8-bwd"][1] < err["nvfp4"][1]


def test_mxfp8_role_settings_are_validated():
    with pytest.raises(ValueError, match="rounding='stochastic' is implemented for fmt"):
        TensorQuant("mxfp8", (1, 32), "stochastic")
    with pytest.raises(ValueError, match="block_shape for fmt='mxfp8'"):
        TensorQuant("mxfp8", (1, 16))
    with pytest.raises(ValueError, match="block_scale_rule for fmt='mxfp4'"):
        TensorQuant("mxfp4", (1, 32), block_scale_rule="4over6")
    with pytest.raises(ValueError, match="outer_scale='row' needs 1x16 blocks"):
        TensorQuant("nvfp4", (16, 16), outer_scale="row")


# --- per-GEMM roles and compose -------------------------------------------------------------


def test_a_role_equal_to_its_default_is_spelled_none():
    nv = nvfp4_ops.get_recipe("nvfp4")
    same = dataclasses.replace(
        nv, dgrad_weight=nv.fprop_weight, wgrad_input=nv.fprop_input, wgrad_grad=nv.grad
    )
    assert same == nv and hash(same) == hash(nv)
    assert (same.dgrad_weight, same.wgrad_input, same.wgrad_grad) == (None, None, None)


def test_compose_reproduces_the_presets():
    nv, bf = nvfp4_ops.get_recipe("nvfp4"), nvfp4_ops.get_recipe("bf16")
    for recipe in nvfp4_ops.RECIPES.values():
        assert compose(recipe, recipe, recipe) is recipe
        late = compose(bf, recipe, recipe)
        assert late == recipe.with_bf16_fprop()
    assert compose(bf, bf, bf) == bf
    assert compose(nv, nv, nv, name="x").name == "x"


def test_compose_takes_each_gemm_from_its_recipe_bit_exactly():
    nv = nvfp4_ops.get_recipe("nvfp4")
    mx8 = nvfp4_ops.get_recipe("nvfp4-fwd-mxfp8-bwd")
    no_sr = nvfp4_ops.get_recipe("nvfp4-no-sr")
    x, w, dy = _data()
    key = jax.random.key(11)
    mixed = compose(nv, mx8, no_sr)
    assert mixed.name == "fprop=nvfp4,dgrad=nvfp4-fwd-mxfp8-bwd,wgrad=nvfp4-no-sr"
    y, dx, dw = vjp_of(mixed)(x, w, dy, key)
    _assert_equal(y, vjp_of(nv)(x, w, dy, key)[0])
    _assert_equal(dx, vjp_of(mx8)(x, w, dy, None)[1])
    _assert_equal(dw, vjp_of(no_sr)(x, w, dy, key)[2])


def test_compose_with_a_bf16_backward_gemm():
    nv, bf = nvfp4_ops.get_recipe("nvfp4"), nvfp4_ops.get_recipe("bf16")
    x, w, dy = _data()
    key = jax.random.key(4)
    y, dx, dw = vjp_of(compose(nv, bf, nv))(x, w, dy, key)
    _assert_equal(y, vjp_of(nv)(x, w, dy, key)[0])
    np.testing.assert_allclose(np.asarray(dx), np.asarray(dy @ w.T), rtol=1e-6, atol=1e-7)
    _assert_equal(dw, vjp_of(nv)(x, w, dy, key)[2])
    fwd_only = compose(nv, bf, bf)
    assert not fwd_only.wgrad_hadamard  # nothing quantized in Wgrad: no RHT
    assert fwd_only.setting("wgrad_input") == BF16


def test_compose_refuses_non_recipes():
    with pytest.raises(TypeError, match="compose: dgrad must be a Recipe"):
        compose(nvfp4_ops.get_recipe("nvfp4"), "nvfp4", nvfp4_ops.get_recipe("nvfp4"))


@pytest.mark.parametrize(
    "name, why",
    [
        ("nvfp4-4over6", "Four Over Six for PyTorch only"),
        ("nvfp4-per-token", "one outer scale per tensor"),
        ("nvfp4-fwd-mxfp8-bwd", "grad is 'mxfp8'"),
    ],
)
def test_transformer_engine_is_not_used_for_the_variants(name, why):
    assert why in te_unsupported(nvfp4_ops.get_recipe(name))


def test_transformer_engine_is_not_used_for_separate_backward_roles():
    recipe = Recipe(wgrad_input=TensorQuant("nvfp4", (1, 16), "stochastic"))
    assert "wgrad_input apart from the Fprop roles" in te_unsupported(recipe)


@pytest.mark.parametrize("name", ["nvfp4-4over6", "nvfp4-fwd-mxfp8-bwd"])
def test_telemetry_describes_the_variants(name):
    recipe = nvfp4_ops.get_recipe(name)
    x, w, dy = _data()
    stats = nvfp4_ops.gemm_operand_stats(x, w, dy, recipe, jax.random.key(0))
    expected = {"fprop_x", "fprop_w", "dgrad_dy", "wgrad_x", "wgrad_dy"}
    if name == "nvfp4-fwd-mxfp8-bwd":
        expected |= {"dgrad_w"}  # re-quantized to MXFP8 along N
    assert set(stats) == expected
    for role in stats.values():
        assert np.isfinite(float(role["rel_error"]))
