"""The operands and the jitted forward + VJP that the recipe tests run `dot_general` on."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import nvfp4_ops

MATMUL = (((1,), (0,)), ((), ()))


def operands(m=32, k=48, n=32, dtype=jnp.float32, seed=0):
    """(x [m, k] ~ N(0, 1), w [k, n] ~ N(0, 0.1^2), dy [m, n] ~ N(0, 0.01^2)) in `dtype`."""
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, n), jnp.float32) * 0.1).astype(dtype)
    dy = (jax.random.normal(kd, (m, n), jnp.float32) * 0.01).astype(dtype)
    return x, w, dy


def vjp_of(recipe, backend="emulated", dn=MATMUL):
    """jit((x, w, dy, key) -> (y, dx, dw)) of `nvfp4_ops.dot_general` with `recipe`."""

    @jax.jit
    def run(x, w, dy, key):
        def f(a, b):
            return nvfp4_ops.dot_general(a, b, dn, recipe=recipe, key=key, backend=backend)

        y, pullback = jax.vjp(f, x, w)
        return (y, *pullback(dy))

    return run
