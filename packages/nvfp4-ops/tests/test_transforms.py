"""dot_general under jit, vmap, grad, remat, Flax NNX and sharding; residual memory."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np

import nvfp4_ops

MATMUL = (((1,), (0,)), ((), ()))


def _loss(x, w, key, recipe="nvfp4"):
    y = nvfp4_ops.dot_general(x, w, MATMUL, recipe=recipe, key=key)
    return (y.astype(jnp.float32) ** 2).mean()


def test_no_recompilation_per_call():
    step = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1)))
    w = jax.random.normal(jax.random.key(0), (32, 16))
    for i in range(3):
        x = jax.random.normal(jax.random.key(i + 1), (16, 32))
        jax.block_until_ready(step(x, w, jax.random.key(i)))
    assert step._cache_size() == 1


def test_vmap_equals_a_loop_of_calls():
    xs = jax.random.normal(jax.random.key(1), (3, 16, 32))
    w = jax.random.normal(jax.random.key(2), (32, 16))
    f = functools.partial(nvfp4_ops.dot_general, dimension_numbers=MATMUL, recipe="nvfp4-no-sr")
    batched = jax.vmap(lambda x: f(x, w))(xs)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(batched[i]), np.asarray(f(xs[i], w)))


def test_remat_gives_the_same_gradients():
    x = jax.random.normal(jax.random.key(1), (16, 32))
    w = jax.random.normal(jax.random.key(2), (32, 16))
    key = jax.random.key(3)
    plain = jax.jit(jax.grad(_loss, argnums=(0, 1)))(x, w, key)
    remat = jax.jit(jax.grad(jax.checkpoint(_loss), argnums=(0, 1)))(x, w, key)
    for a, b in zip(plain, remat, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_flax_nnx_linear_trains_with_the_recipe():
    from flax import nnx

    key = jax.random.key(0)
    dot = functools.partial(nvfp4_ops.dot_general, recipe="nvfp4", key=key)
    model = nnx.Linear(32, 16, dot_general=dot, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (8, 32))
    target = jax.random.normal(jax.random.key(2), (8, 16))
    direct = nvfp4_ops.dot_general(x, model.kernel[...], MATMUL, recipe="nvfp4", key=key)
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(direct + model.bias[...]))

    @nnx.jit
    def step(model):
        loss, grads = nnx.value_and_grad(lambda m: ((m(x) - target) ** 2).mean())(model)
        nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(model), grads))
        return loss

    losses = [float(step(model)) for _ in range(5)]
    assert losses[-1] < losses[0]


def _residual_bytes(recipe, x, w):
    f = lambda a, b: nvfp4_ops.dot_general(a, b, MATMUL, recipe=recipe, key=jax.random.key(0))  # noqa: E731
    _, pullback = jax.vjp(f, x, w)
    return sum(leaf.nbytes for leaf in jax.tree.leaves(pullback) if hasattr(leaf, "nbytes"))


def test_saved_residuals_are_quantized_not_bf16_copies():
    x = jax.random.normal(jax.random.key(1), (256, 128), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (128, 128), jnp.bfloat16)
    bf16 = _residual_bytes("bf16", x, w)
    nvfp4 = _residual_bytes("nvfp4", x, w)
    assert bf16 >= x.nbytes + w.nbytes
    # Packed codes (0.5 B) + E4M3 scales (1/16 B) per element of x and W, plus a few scalars.
    assert nvfp4 <= 0.3 * bf16, (nvfp4, bf16)


_SHARDED = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import nvfp4_ops
    assert jax.device_count() == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    dn = (((1,), (0,)), ((), ()))
    def loss(x, w, key):
        return (nvfp4_ops.dot_general(x, w, dn, recipe="nvfp4", key=key) ** 2).mean()
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    x = jax.random.normal(jax.random.key(1), (128, 32))
    w = jax.random.normal(jax.random.key(2), (32, 16))
    key = jax.random.key(3)
    ref = step(x, w, key)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    ws = jax.device_put(w, NamedSharding(mesh, P()))
    out = step(xs, ws, key)
    assert len(out[1][0].sharding.device_set) == 8
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(out)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    print("sharded ok")
    """
)


def test_sharded_inputs_on_8_fake_cpu_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run(
        [sys.executable, "-c", _SHARDED], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sharded ok" in done.stdout
