"""Remat: the quantized operands are named, so a policy can keep exactly them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_ops

P = jax.checkpoint_policies
DIMS = (((1,), (0,)), ((), ()))
KEY = jax.random.key(3)


def _loss(recipe):
    def loss(x, w):
        y = nvfp4_ops.dot_general(
            x, w, DIMS, preferred_element_type=jnp.float32, recipe=recipe, key=KEY,
            backend="emulated",
        )  # fmt: skip
        return jnp.sum(jnp.tanh(y))

    return loss


def _operands():
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (64, 128), jnp.bfloat16)
    w = (0.1 * jax.random.normal(kw, (128, 96))).astype(jnp.bfloat16)
    return x, w


def _saved(fn, *args) -> list[jax.Array]:
    """The arrays the pullback of `fn` holds: what the forward saved for the backward pass."""
    _, pullback = jax.vjp(fn, *args)
    return [leaf for leaf in jax.tree.leaves(pullback) if isinstance(leaf, jax.Array)]


@pytest.mark.parametrize("recipe", ["nvfp4", "nvfp4-no-2d", "mxfp4"])
def test_names_policy_saves_only_the_quantized_operands(recipe):
    x, w = _operands()
    names = P.save_only_these_names(nvfp4_ops.RESIDUAL_NAME)
    saved = _saved(jax.checkpoint(_loss(recipe), policy=names), x, w)
    narrow = (jnp.uint8, jnp.float8_e4m3fn, jnp.float8_e8m0fnu)
    quantized = [a for a in saved if a.dtype in narrow]
    assert quantized, [(a.dtype, a.shape) for a in saved]
    # nothing else of the GEMM's size: the BF16 x and w are the arguments, no FP32 copy of y,
    # of H x^T or of a dequantized operand survives
    large = [a for a in saved if a.size >= 64 * 32 and a.dtype not in narrow]
    assert all(a.dtype == jnp.bfloat16 and a.shape in (x.shape, w.shape) for a in large), [
        (a.dtype, a.shape) for a in large
    ]
    packed = sum(a.nbytes for a in quantized)
    assert packed < 0.35 * (x.nbytes + w.nbytes)


def test_dots_policy_without_the_names_would_keep_fp32_copies():
    # the reason for the names: dots_saveable alone keeps FP32 dot outputs (the RHT of x^T, the
    # emulated GEMM) and recomputes the FP4 codes from them
    x, w = _operands()
    saved = _saved(jax.checkpoint(_loss("nvfp4"), policy=P.dots_saveable), x, w)
    assert not any(a.dtype == jnp.uint8 for a in saved)
    assert any(a.dtype == jnp.float32 and a.size >= 128 * 64 for a in saved)


@pytest.mark.parametrize(
    "policy",
    [
        P.nothing_saveable,
        P.save_only_these_names(nvfp4_ops.RESIDUAL_NAME),
        P.save_from_both_policies(
            P.dots_saveable, P.save_only_these_names(nvfp4_ops.RESIDUAL_NAME)
        ),
    ],
    ids=["full", "quantized", "dots"],
)
def test_remat_gradients_are_bit_identical(policy):
    x, w = _operands()
    loss = _loss("nvfp4")
    plain = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    remat = jax.jit(jax.grad(jax.checkpoint(loss, policy=policy), argnums=(0, 1)))(x, w)
    for a, b in zip(plain, remat, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
