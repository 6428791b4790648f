"""Backend capabilities, the xla backend against the emulated one, TE (skips without sm_100+)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_ops
from nvfp4_ops.cli import main
from nvfp4_ops.grouped.gemm import GROUPED_GEMMS

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
def test_te_backend_agrees_with_emulated_on_this_gpu():
    report = nvfp4_ops.verify_backend("te")
    assert report.ok, report.table()


def test_unknown_or_unavailable_backend_is_an_error():
    x, w = jnp.ones((16, 16)), jnp.ones((16, 16))
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        nvfp4_ops.dot_general(x, w, MATMUL, recipe="nvfp4-no-sr", backend="cuda")
    if not CAPS["te"][0]:
        with pytest.raises(ValueError, match="cannot run this call: not available here"):
            nvfp4_ops.dot_general(x, w, MATMUL, recipe="nvfp4-no-sr", backend="te")


def test_doctor_prints_backends_and_auto_choice(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"jax {jax.__version__}" in out
    for name in ("emulated", "xla", "te"):
        assert name in out
    assert f"auto -> {nvfp4_ops.auto_backend()[0]}" in out


@pytest.mark.skipif(not CAPS["xla"][0], reason=CAPS["xla"][1])
def test_doctor_verify_passes_here_and_writes_json(capsys, tmp_path):
    path = tmp_path / "verify.json"
    assert main(["doctor", "--verify", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "verify xla against emulated: agrees with emulated" in out
    (report,) = json.loads(path.read_text())
    assert report["ok"] and report["backend"] == "xla"
    cases = {(c["case"], c["recipe"], c["quantity"]) for c in report["checks"]}
    assert len(cases) == 24  # 4 shapes (one grouped) x 2 presets x (y, dx, dw)
    assert {c for c, *_ in cases} == {"aligned", "unaligned", "batched", "grouped"}
    assert set(report["steps_per_second"]) == {"xla", "emulated"}


def _off_by(factor):
    gemm = nvfp4_ops.gemm.GEMMS["xla"]
    return lambda *args, **kwargs: gemm(*args, **kwargs) * factor


def _grouped_off_by(factor):
    gemms = GROUPED_GEMMS["xla"]
    return dataclasses.replace(
        gemms,
        rows=lambda *args: gemms.rows(*args) * factor,
        wgrad=lambda *args: gemms.wgrad(*args) * factor,
    )


@pytest.mark.skipif(not CAPS["xla"][0], reason=CAPS["xla"][1])
@pytest.mark.parametrize(
    "factor, caught",
    [
        # 0.1% off: far outside the FP32 bound of the forward; the BF16 gradients round away
        # anything below their own rounding (~0.4%), so only y resolves it.
        (1.001, {("nvfp4-no-sr", "y"), ("nvfp4", "y")}),
        # a gross error (a wrong scale, layout or transform): every GEMM, SR ones included
        (0.5, {(r, q) for r in ("nvfp4-no-sr", "nvfp4") for q in ("y", "dx", "dw")}),
    ],
)
def test_a_backend_made_to_disagree_fails_verification(monkeypatch, capsys, factor, caught):
    monkeypatch.setitem(nvfp4_ops.gemm.GEMMS, "xla", _off_by(factor))
    monkeypatch.setitem(GROUPED_GEMMS, "xla", _grouped_off_by(factor))
    jax.clear_caches()
    # no timing: the speeds are the doctor test's (and the CLI run below times them again)
    report = nvfp4_ops.verify_backend("xla", recipes=("nvfp4-no-sr", "nvfp4"), measure_speed=False)
    assert not report.ok
    assert {(c.recipe, c.quantity) for c in report.checks if not c.ok} == caught
    assert "DISAGREES" in report.table()
    if factor == 0.5:  # the CLI's exit status once: a second full battery proves nothing more
        assert main(["doctor", "--verify"]) == 1
    jax.clear_caches()
