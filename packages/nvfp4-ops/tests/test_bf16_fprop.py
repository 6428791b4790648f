"""`Recipe.bf16_fprop`: BF16 Fprop GEMM, Dgrad and Wgrad bit-identical to the quantized recipe."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from vjp_cases import MATMUL, operands, vjp_of

import nvfp4_ops
from nvfp4_ops import Recipe, get_recipe

# One per code path: 2D weight reused in Dgrad, 1D weight re-quantized, MXFP4, per-tensor FP8.
PATHS = ["nvfp4", "nvfp4-no-2d", "mxfp4", "fp8"]


def _bits(a: jax.Array) -> np.ndarray:
    return np.asarray(a.astype(jnp.float32))


def test_with_bf16_fprop_sets_the_flag_and_the_name():
    base = get_recipe("nvfp4")
    late = base.with_bf16_fprop()
    assert late.bf16_fprop and not base.bf16_fprop
    assert late.name == "nvfp4+bf16-fprop"
    assert dataclasses.replace(late, bf16_fprop=False, name=base.name) == base
    assert late.with_bf16_fprop() is late
    assert late.needs_key == base.needs_key and late.alignment == base.alignment


def test_with_bf16_fprop_leaves_an_unquantized_recipe_unchanged():
    assert get_recipe("bf16").with_bf16_fprop() is get_recipe("bf16")


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_bf16_fprop_must_be_a_bool(bad):
    with pytest.raises(TypeError, match="bf16_fprop must be a bool"):
        Recipe(bf16_fprop=bad)


def test_recipe_with_the_flag_is_hashable_and_distinct():
    base = get_recipe("nvfp4")
    late = base.with_bf16_fprop()
    table = {base: "base", late: "late"}
    assert table[get_recipe("nvfp4").with_bf16_fprop()] == "late"
    assert hash(late) == hash(base.with_bf16_fprop()) and late != base


@pytest.mark.parametrize(
    "name, dtype", [(name, jnp.bfloat16) for name in PATHS] + [("nvfp4", jnp.float32)]
)
def test_forward_is_lax_dot_general_of_the_unquantized_operands(name, dtype):
    x, w, _ = operands(dtype=dtype)
    recipe = get_recipe(name).with_bf16_fprop()
    y = nvfp4_ops.dot_general(x, w, MATMUL, recipe=recipe, key=jax.random.key(1))
    want = jax.lax.dot_general(x, w, MATMUL, preferred_element_type=jnp.float32).astype(dtype)
    assert y.dtype == want.dtype
    np.testing.assert_array_equal(_bits(y), _bits(want))


def test_forward_with_batch_dims_and_padded_shapes_is_the_plain_dot():
    dn = (((2,), (1,)), ((0,), (0,)))
    kx, kw = jax.random.split(jax.random.key(5))
    x = jax.random.normal(kx, (2, 20, 24), jnp.float32)
    w = jax.random.normal(kw, (2, 24, 12), jnp.float32)
    recipe = get_recipe("nvfp4").with_bf16_fprop()
    y = nvfp4_ops.dot_general(x, w, dn, recipe=recipe, key=jax.random.key(0))
    want = jax.lax.dot_general(x, w, dn, preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))


@pytest.mark.parametrize(
    "name, backend",
    [(name, "emulated") for name in PATHS] + [("nvfp4", "xla"), ("nvfp4-no-2d", "xla")],
)
def test_gradients_are_bit_identical_to_the_quantized_recipe(name, backend):
    if not nvfp4_ops.backend_capabilities()[backend][0]:
        pytest.skip(nvfp4_ops.backend_capabilities()[backend][1])
    x, w, dy = operands(dtype=jnp.bfloat16, seed=2)
    key = jax.random.key(7)
    _, dx, dw = vjp_of(get_recipe(name), backend=backend)(x, w, dy, key)
    _, dx_late, dw_late = vjp_of(get_recipe(name).with_bf16_fprop(), backend=backend)(x, w, dy, key)
    assert dx_late.dtype == dx.dtype and dw_late.dtype == dw.dtype
    np.testing.assert_array_equal(_bits(dx_late), _bits(dx))
    np.testing.assert_array_equal(_bits(dw_late), _bits(dw))
    plain_dx = jax.vjp(lambda a: jax.lax.dot_general(a, w, MATMUL), x)[1](dy)[0]
    assert not np.array_equal(_bits(dx_late), _bits(plain_dx))


def test_gradients_depend_on_the_key_like_the_quantized_recipe():
    x, w, dy = operands(seed=3)
    run = vjp_of(get_recipe("nvfp4").with_bf16_fprop())
    a, b = run(x, w, dy, jax.random.key(0)), run(x, w, dy, jax.random.key(1))
    np.testing.assert_array_equal(_bits(a[0]), _bits(b[0]))
    assert not np.array_equal(_bits(a[1]), _bits(b[1]))


def test_stochastic_recipe_with_the_flag_still_needs_a_key():
    x, w, _ = operands()
    with pytest.raises(ValueError, match="needs a PRNG key"):
        nvfp4_ops.dot_general(x, w, MATMUL, recipe=get_recipe("nvfp4").with_bf16_fprop())


def test_jit_with_the_recipe_static_retraces_per_flag():
    x, w, _ = operands()
    traces = []

    def f(a, b, recipe):
        traces.append(recipe.name)
        return nvfp4_ops.dot_general(a, b, MATMUL, recipe=recipe, key=jax.random.key(0))

    g = jax.jit(f, static_argnums=2)
    base = get_recipe("nvfp4")
    y0 = g(x, w, base)
    y1 = g(x, w, base.with_bf16_fprop())
    g(x, w, base.with_bf16_fprop())
    assert traces == ["nvfp4", "nvfp4+bf16-fprop"]
    assert not np.array_equal(np.asarray(y0), np.asarray(y1))


def test_backend_te_refuses_a_bf16_fprop_recipe():
    x, w, _ = operands()
    recipe = get_recipe("nvfp4").with_bf16_fprop()
    with pytest.raises(ValueError, match="te"):
        nvfp4_ops.dot_general(x, w, MATMUL, recipe=recipe, key=jax.random.key(0), backend="te")


def test_te_recipe_refuses_a_bf16_fprop_recipe_before_importing_te():
    from nvfp4_ops.te_backend import te_recipe

    with pytest.raises(ValueError, match=r"runs it in BF16 \(bf16_fprop\)"):
        te_recipe(nvfp4_ops.get_recipe("nvfp4").with_bf16_fprop())
