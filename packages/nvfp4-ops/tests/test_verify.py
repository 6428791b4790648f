"""`verify_backend` on CPU with injected faults: a crash is a failed check, not an exception; the
bound passes a GEMM summed as the assumed tensor cores sum, and fails a wrong scale layout and a
wrong RHT sign. Each uses one small case and the round-to-nearest preset (seconds, not minutes).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_ops
from nvfp4_ops import backends, dispatch, formats, gemm, gemm_table, verify
from nvfp4_ops.hadamard import TE_SIGNS, hadamard_transform
from nvfp4_ops.quantizers import dequantize_operand
from nvfp4_ops.verify import BATTERY, Case

CAPS_XLA = nvfp4_ops.backend_capability("xla")
pytestmark = pytest.mark.skipif(not CAPS_XLA[0], reason=CAPS_XLA[1])

SMALL = (Case("small", 48, 144, 80),)  # contractions 144 (3 groups of 64), 80 and 48
RNE = ("nvfp4-no-sr",)
RUNNER = verify._runner  # the cached runners (a test below wraps verify._runner)


def _retrace_xla() -> None:
    """Drop the compiled xla runs of the small case (a fault must reach the xla backend's trace);
    the emulated reference stays compiled."""
    dispatch._canonical_dot.clear_cache()
    for case in SMALL:
        for recipe in RNE:
            RUNNER(case, recipe, "xla").clear_cache()


@pytest.fixture
def fresh(monkeypatch):
    """A fresh xla trace, and this process's verification record restored afterwards."""
    monkeypatch.setattr(backends, "_VERIFIED", {})
    _retrace_xla()
    yield
    _retrace_xla()


def _small_report():
    return nvfp4_ops.verify_backend("xla", recipes=RNE, battery=SMALL, measure_speed=False)


def _failing(report) -> set[str]:
    return {c.quantity for c in report.checks if not c.ok}


def test_a_backend_that_crashes_while_verified_is_reported_and_not_used(monkeypatch, fresh):
    def crash(*args, **kwargs):
        raise RuntimeError("no cuDNN engine for this block-scaled dot (fake)\nHLO: ...")

    monkeypatch.setitem(gemm.GEMMS, "xla", crash)
    report = _small_report()
    assert not report.ok and report.checks == ()
    assert report.error == (
        "RuntimeError: no cuDNN engine for this block-scaled dot (fake) (in small nvfp4-no-sr)"
    )
    assert "CRASHED: RuntimeError: no cuDNN engine" in report.table()
    assert report.as_dict()["error"] == report.error
    assert nvfp4_ops.verification("xla") == (False, f"crashed while verified: {report.error}")


def _tensor_core_sum(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[B, P, C] . [B, Q, C] summed as the accumulation model of verify.py assumes the hardware
    does: groups of 64 exact products aligned to the group's largest, truncated to 22 fraction
    bits, the group sums accumulated in float32 rounding toward zero."""
    p = a.astype(np.float64)[:, :, None, :] * b.astype(np.float64)[:, None, :, :]
    p = np.pad(p, [(0, 0)] * 3 + [(0, -p.shape[-1] % 64)])
    groups = p.reshape(*p.shape[:-1], -1, 64)
    top = np.max(np.abs(groups), axis=-1, keepdims=True)
    grid = np.exp2(np.floor(np.log2(np.where(top > 0, top, 1.0))) - 22)
    sums = np.sum(np.trunc(groups / grid) * grid, axis=-1)
    acc = np.zeros(sums.shape[:-1], np.float32)
    for g in np.moveaxis(sums, -1, 0):
        exact = acc.astype(np.float64) + g
        near = exact.astype(np.float32)
        acc = np.where(np.abs(near) > np.abs(exact), np.nextafter(near, np.float32(0)), near)
    return acc


def _tensor_core_gemm(qa, ta, qb, tb, *, b_transposed=False):
    a = dequantize_operand(qa, ta, np.float32)
    b = dequantize_operand(qb, tb, np.float32)
    if b_transposed:
        b = b.swapaxes(-1, -2)
    out = jax.ShapeDtypeStruct((*a.shape[:-1], b.shape[-2]), np.float32)
    return jax.pure_callback(_tensor_core_sum, out, a, b)


def test_a_gemm_summed_as_tensor_cores_sum_passes(monkeypatch, fresh):
    monkeypatch.setitem(gemm.GEMMS, "xla", _tensor_core_gemm)
    report = _small_report()
    assert report.ok, report.table()
    assert report.checks[0].quantity == "y" and report.checks[0].statistic > 0  # it did differ


def _rolled_scales(gemm_operand, q, transposed):
    """Block scales one block off along the contraction: a wrong scale layout."""
    vals, scales, g = gemm_operand(q, transposed)
    return vals, jnp.roll(scales, 1, axis=-1), g


def test_a_wrong_scale_layout_fails_every_gemm(monkeypatch, fresh):
    nvfp4 = formats.FORMAT_OPS["nvfp4"]
    wrong = dataclasses.replace(
        nvfp4, gemm_operand=functools.partial(_rolled_scales, nvfp4.gemm_operand)
    )
    monkeypatch.setattr(gemm, "FORMAT_OPS", {**formats.FORMAT_OPS, "nvfp4": wrong})
    assert _failing(_small_report()) == {"y", "dx", "dw"}


def test_a_wrong_rht_sign_fails_wgrad_only(monkeypatch, fresh):
    # The xla backend's Wgrad operands rotated with one of the 16 signs flipped (what a kernel
    # with another sign vector computes); "emulated" keeps TE_SIGNS. Only dW has an RHT.
    flipped = functools.partial(hadamard_transform, signs=(-TE_SIGNS[0], *TE_SIGNS[1:]))

    def faulty_runner(case, recipe, backend):
        run = RUNNER(case, recipe, backend)
        if backend != "xla":
            return run

        def traced_with_wrong_signs(*args):
            with monkeypatch.context() as patch:
                patch.setattr(gemm_table, "hadamard_transform", flipped)
                return run(*args)

        return traced_with_wrong_signs

    monkeypatch.setattr(verify, "_runner", faulty_runner)
    assert _failing(_small_report()) == {"dw"}


def test_the_battery_contracts_16_mod_32_sizes():
    # Padded to the recipe's 16, the three GEMMs contract K (Fprop), N (Dgrad) and M (Wgrad).
    contractions = {-(-d // 16) * 16 for case in BATTERY for d in (case.m, case.k, case.n)}
    assert {16, 48, 80, 112} <= contractions
