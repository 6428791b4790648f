"""`quantize_weight` + `prequantized_dot_general` against `dot_general`, bit for bit.

- the output and both gradients equal `dot_general`'s (nvfp4: 16x16 weight tiles reused by Dgrad,
  stochastic rounding of the gradients, RHT on Wgrad);
- shards of a weight quantized with the whole weight's amax (shard edges on multiples of 16, split
  along either axis) concatenate to the whole weight's quantization: what an FSDP gather of the
  codes relies on;
- recipes that cannot prequantize, and shapes that do not tile, are refused with the reason.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_ops

RECIPE = nvfp4_ops.get_recipe("nvfp4")
DIMS = (((2,), (0,)), ((), ()))


def _operands():
    x = jax.random.normal(jax.random.key(0), (2, 24, 64)).astype(jnp.bfloat16)
    w = (0.1 * jax.random.normal(jax.random.key(1), (64, 48))).astype(jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(2), (2, 24, 48))
    return x, w, dy


def test_output_and_gradients_equal_dot_general_bit_for_bit():
    x, w, dy = _operands()
    key = jax.random.key(3)

    def through_dot_general(x, w):
        y = nvfp4_ops.dot_general(x, w, DIMS, preferred_element_type=jnp.float32, recipe=RECIPE,
                                  key=key, backend="emulated")  # fmt: skip
        return jnp.sum(y * dy), y

    def prequantized(x, w):
        qw = nvfp4_ops.quantize_weight(jax.lax.stop_gradient(w), RECIPE)
        y = nvfp4_ops.prequantized_dot_general(
            x, w, qw, preferred_element_type=jnp.float32, recipe=RECIPE, key=key,
            backend="emulated",
        )  # fmt: skip
        return jnp.sum(y * dy), y

    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))  # noqa: E731
    want, got = grad(through_dot_general)(x, w), grad(prequantized)(x, w)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("axis", [0, 1])
def test_shards_with_the_global_amax_concatenate_to_the_whole_quantization(axis):
    _, w, _ = _operands()
    whole = nvfp4_ops.quantize_weight(w, RECIPE)
    amax = nvfp4_ops.weight_amax(w)
    parts = w.shape[axis] // 16
    shards = [nvfp4_ops.quantize_weight(s, RECIPE, amax=amax) for s in jnp.split(w, parts, axis)]
    # w [K, N] is quantized as w^T [1, N, K]: a split of K is a split of the last axis
    along = -1 if axis == 0 else -2
    for field in ("packed", "block_scales"):
        joined = jnp.concatenate([getattr(s, field) for s in shards], axis=along)
        np.testing.assert_array_equal(
            np.asarray(joined).view(np.uint8), np.asarray(getattr(whole, field)).view(np.uint8)
        )
    for s in shards:
        assert float(s.global_scale) == float(whole.global_scale)


@pytest.mark.parametrize(
    ("recipe", "reason"),
    [("bf16", "quantizes nothing"), ("nvfp4-no-2d", "not NVFP4 16x16 tiles"),
     (RECIPE.with_bf16_fprop(), "unquantized")],
)  # fmt: skip
def test_recipes_that_cannot_prequantize_are_refused_with_the_reason(recipe, reason):
    assert reason in nvfp4_ops.prequantized_unsupported(recipe)
    with pytest.raises(ValueError, match=reason):
        nvfp4_ops.quantize_weight(jnp.ones((32, 32)), recipe)


def test_a_weight_that_does_not_tile_is_refused():
    with pytest.raises(ValueError, match=r"multiples of 16.*\(40, 32\)"):
        nvfp4_ops.quantize_weight(jnp.ones((40, 32)), RECIPE)
