"""`backend="te"` run end to end on CPU through TransformerEngine's own pure-JAX fallbacks.

This exercises every call `nvfp4_ops.te_backend` makes into the released TE (quantizer set and
metadata, quantize, GEMM usages, residuals, dtypes, padding, the stochastic-rounding state) on
TE's Python code paths, with TE's pure-JAX kernels instead of its CUDA ones (see te_standin.py).
TE's pure-JAX quantizer is not its CUDA kernel: it computes block scales as (amax / 6) * s_enc
where the kernels fold 1/6 into s_enc, and draws stochastic rounding from its own uniform numbers,
so the comparison with the emulated backend is to a bound, not bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import te_standin

import nvfp4_ops
from nvfp4_ops.canonical import make_layout
from nvfp4_ops.te_backend import TE_TESTED_VERSIONS, te_dot

MATMUL = (((1,), (0,)), ((), ()))


@pytest.fixture(scope="module")
def te_dot_cpu(te_jax):
    """te_dot's forward and gradients, traced inside `pure_jax_te` (compiled once per shape)."""
    del te_jax  # imported: TE's modules are now what te_backend imports

    def run(x, w, dy, recipe, key, out_dtype=jnp.float32):
        layout = make_layout(x.shape, w.shape, MATMUL)

        def f(a, b):
            return te_dot(a, b, layout, nvfp4_ops.get_recipe(recipe), key, np.dtype(out_dtype))

        with te_standin.pure_jax_te():
            y, pullback = jax.vjp(f, x, w)
            return (y, *pullback(dy.astype(y.dtype)))

    return run


def _emulated(x, w, dy, recipe, key, out_dtype=jnp.float32):
    def f(a, b):
        return nvfp4_ops.dot_general(
            a, b, MATMUL, preferred_element_type=out_dtype, recipe=recipe, key=key,
            backend="emulated",
        )  # fmt: skip

    y, pullback = jax.vjp(f, x, w)
    return (y, *pullback(dy.astype(y.dtype)))


def _data(m, k, n, seed=0):
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) * 0.05).astype(jnp.bfloat16)
    dy = (jax.random.normal(kd, (m, n), jnp.float32) * 1e-2).astype(jnp.bfloat16)
    return x, w, dy


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("recipe", ["nvfp4-no-sr", "nvfp4", "nvfp4-no-rht", "nvfp4-no-2d"])
@pytest.mark.parametrize("shape", [(128, 128, 256), (100, 72, 40)])  # aligned; padded
def test_te_backend_runs_through_te_and_agrees_with_emulated(te_dot_cpu, recipe, shape):
    # Round to nearest: the same recipe with a few block scales rounded otherwise, so the
    # results differ by much less than NVFP4's own error (~10% relative per GEMM here).
    # Stochastic rounding: TE draws its own random numbers, so one draw of each differs by the
    # SR noise (~20%); both are unbiased, so means over draws agree.
    x, w, dy = _data(*shape)
    draws = 1 if recipe == "nvfp4-no-sr" else 8
    keys = jax.random.split(jax.random.key(1), draws)
    te = [te_dot_cpu(x, w, dy, recipe, key) for key in keys]
    em = [_emulated(x, w, dy, recipe, key) for key in keys]
    for i, name in enumerate(("y", "dx", "dw")):
        got, want = te[0][i], em[0][i]
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert np.isfinite(np.asarray(got, np.float32)).all(), name
        if draws == 1 or name == "y":  # no stochastic rounding in it
            assert _rel(got, want) < 0.05, (name, _rel(got, want))
            continue
        a = np.stack([np.asarray(t[i], np.float64) for t in te])
        b = np.stack([np.asarray(e[i], np.float64) for e in em])
        # the difference of the means in units of its standard error, element by element: about
        # 1 on average (chi-square) when the two differ by SR noise only; a bias makes it >> 1.
        noise = a.var(axis=0, ddof=1) / draws + b.var(axis=0, ddof=1) / draws
        z2 = (a.mean(axis=0) - b.mean(axis=0)) ** 2 / np.maximum(noise, 1e-30)
        assert float(np.mean(z2[noise > 0])) < 2.0, (name, float(np.mean(z2[noise > 0])))
    y_exact = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    assert 0.01 < _rel(te[0][0], y_exact) < 0.2  # it really quantized


def test_te_backend_writes_the_dtypes_dot_general_promises(te_dot_cpu):
    x, w, dy = _data(128, 128, 128)
    for out_dtype in (jnp.float32, jnp.bfloat16):
        y, dx, dw = te_dot_cpu(x, w, dy, "nvfp4-no-sr", None, out_dtype)
        assert (y.dtype, dx.dtype, dw.dtype) == (out_dtype, jnp.bfloat16, jnp.bfloat16)


def test_rne_forward_matches_emulated_closely(te_dot_cpu):
    # Fprop has no RHT and no SR: only TE's pure-JAX block-scale formula differs (rare ties).
    x, w, dy = _data(128, 256, 128, seed=2)
    te_y = te_dot_cpu(x, w, dy, "nvfp4-no-sr", None)[0]
    em_y = _emulated(x, w, dy, "nvfp4-no-sr", None)[0]
    same = np.isclose(np.asarray(te_y), np.asarray(em_y), rtol=1e-6, atol=1e-6)
    assert same.mean() > 0.9, same.mean()


class _Recording:
    """TE's cpp_extensions, recording the amax scope each quantize is called with, by shape."""

    def __init__(self, tex) -> None:
        self._tex, self.scopes = tex, {}

    def __getattr__(self, name):
        return getattr(self._tex, name)

    def quantize(self, x, *args, amax_scope=None, **kwargs):
        self.scopes[tuple(x.shape)] = getattr(amax_scope, "name", amax_scope)
        return self._tex.quantize(x, *args, amax_scope=amax_scope, **kwargs)

    def quantize_dbias(self, x, *args, amax_scope=None, **kwargs):
        self.scopes[tuple(x.shape)] = getattr(amax_scope, "name", amax_scope)
        return self._tex.quantize_dbias(x, *args, amax_scope=amax_scope, **kwargs)


def test_te_dot_passes_the_amax_scopes_te_dense_passes(te_jax, monkeypatch):
    # Aligned shapes, so both see the same [M, K] x, [K, N] kernel and [M, N] dY.
    from nvfp4_ops import te_backend

    dense = te_standin.importlib.import_module("transformer_engine.jax.dense")
    x, w, dy = _data(128, 256, 384)
    recipe, key = nvfp4_ops.get_recipe("nvfp4"), jax.random.key(1)
    ours, theirs = _Recording(te_backend._tex()), _Recording(dense.tex)
    monkeypatch.setattr(te_backend, "_tex", lambda: ours)
    monkeypatch.setattr(dense, "tex", theirs)
    quantizers = te_backend._quantizer_set(recipe, key)
    layout = make_layout(x.shape, w.shape, MATMUL)

    def gradients(f):  # traced only: the scopes are arguments, nothing needs to run
        return jax.eval_shape(lambda a, b, g: jax.vjp(f, a, b)[1](g), x, w, dy)

    with te_standin.pure_jax_te():
        gradients(lambda a, b: dense.dense(a, b, quantizer_set=quantizers))
        gradients(lambda a, b: te_dot(a, b, layout, recipe, key, np.dtype(jnp.bfloat16)))
    roles = {(128, 256): "x", (256, 384): "kernel", (128, 384): "grad"}
    dense_scopes = {roles[s]: v for s, v in theirs.scopes.items()}
    assert dense_scopes == {"x": "TPSP", "kernel": "FSDP", "grad": "TPSP"}  # dense.py, read
    assert ours.scopes == theirs.scopes
    assert dense_scopes == te_backend.AMAX_SCOPES


def test_the_te_probe_runs_through_te(te_jax, te_version):
    # The newest release only (a compile of ~10 s; the floor's API is checked by test_te_api.py).
    if te_version != TE_TESTED_VERSIONS[-1]:
        pytest.skip("run for the newest release only (test_te_api.py checks the floor's API)")
    from nvfp4_ops.probe import probe_backend

    with te_standin.pure_jax_te():
        probe_backend("te")  # raises if any step of the padded nvfp4 call fails


def test_te_under_fsdp_and_tensor_sharding_equals_one_device(te_root, te_version):
    # Its own process: 8 fake CPU devices must be set before jax initialises. One release
    # only (the newest): the floor's API is checked by test_te_api.py, and the ~30 s compile
    # of the sharded step is the most expensive test of this session.
    if te_version != TE_TESTED_VERSIONS[-1]:
        pytest.skip("run for the newest release only (test_te_api.py checks the floor's API)")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    script = Path(__file__).with_name("sharded_te.py")
    done = subprocess.run(
        [sys.executable, str(script), str(Path(te_root).resolve()), te_version],
        env=env, cwd=script.parent, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    assert "sharded te ok" in done.stdout
