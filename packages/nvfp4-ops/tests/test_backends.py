"""Backend capabilities, the xla backend against the emulated one, TE (skips without sm_100+)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_ops
from nvfp4_ops.cli import main

MATMUL = (((1,), (0,)), ((), ()))
CAPS = nvfp4_ops.backend_capabilities()


def test_capabilities_report_every_backend_with_a_reason():
    assert set(CAPS) == {"emulated", "xla", "te"}
    for ok, why in CAPS.values():
        assert isinstance(ok, bool) and isinstance(why, str) and why
    assert CAPS["emulated"][0]
    assert nvfp4_ops.auto_backend()[0] in {name for name, (ok, _) in CAPS.items() if ok}


def _vjp(recipe, backend, x, w, dy, key):
    f = lambda a, b: nvfp4_ops.dot_general(a, b, MATMUL, recipe=recipe, key=key, backend=backend)  # noqa: E731
    y, pullback = jax.vjp(f, x, w)
    return (y, *pullback(dy))


@pytest.mark.skipif(not CAPS["xla"][0], reason=CAPS["xla"][1])
@pytest.mark.parametrize("recipe", ["nvfp4", "nvfp4-no-2d", "mxfp4", "fp8"])
def test_xla_backend_agrees_with_emulated(recipe):
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (32, 64))
    w = jax.random.normal(kw, (64, 32)) * 0.1
    dy = jax.random.normal(kd, (32, 32))
    key = jax.random.key(1)
    run = jax.jit(_vjp, static_argnums=(0, 1))
    emulated = run(recipe, "emulated", x, w, dy, key)
    xla = run(recipe, "xla", x, w, dy, key)
    for name, a, b, scale in zip(
        ("y", "dx", "dw"),
        emulated,
        xla,
        (jnp.abs(x) @ jnp.abs(w), jnp.abs(dy) @ jnp.abs(w).T, jnp.abs(x).T @ jnp.abs(dy)),
        strict=True,
    ):
        # Same codes and scales; only FP32 summation order and the global-scale rounding differ.
        err = np.abs(np.asarray(a) - np.asarray(b))
        assert (err <= 1e-5 * np.asarray(scale) + 1e-30).all(), (name, err.max())


@pytest.mark.skipif(not CAPS["te"][0], reason=CAPS["te"][1])
def test_te_backend_close_to_emulated():
    x = jax.random.normal(jax.random.key(0), (128, 128), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (128, 128), jnp.bfloat16) * 0.1
    y_te = nvfp4_ops.dot_general(x, w, MATMUL, recipe="nvfp4-no-sr", backend="te")
    y_em = nvfp4_ops.dot_general(x, w, MATMUL, recipe="nvfp4-no-sr", backend="emulated")
    rel = jnp.linalg.norm((y_te - y_em).astype(jnp.float32)) / jnp.linalg.norm(
        y_em.astype(jnp.float32)
    )
    assert float(rel) < 1e-2


def test_unknown_or_unavailable_backend_is_an_error():
    x, w = jnp.ones((16, 16)), jnp.ones((16, 16))
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        nvfp4_ops.dot_general(x, w, MATMUL, recipe="nvfp4-no-sr", backend="cuda")
    if not CAPS["te"][0]:
        with pytest.raises(ValueError, match="not available here"):
            nvfp4_ops.dot_general(x, w, MATMUL, recipe="nvfp4-no-sr", backend="te")


def test_doctor_prints_backends_and_auto_choice(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"jax {jax.__version__}" in out
    for name in ("emulated", "xla", "te"):
        assert name in out
    assert f"auto -> {nvfp4_ops.auto_backend()[0]}" in out
