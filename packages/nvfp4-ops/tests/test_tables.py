"""The format table and the GEMM operand table: complete, and read alike by training and telemetry."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from nvfp4_ops import FORMATS, RECIPES, Recipe, TensorQuant, get_recipe, qdot
from nvfp4_ops.canonical import pad_to
from nvfp4_ops.formats import FORMAT_OPS
from nvfp4_ops.gemm_table import (
    GEMM_SPECS,
    KEY_SLOTS,
    OPERANDS,
    operand_quants,
    quantizations,
    require_key,
)
from nvfp4_ops.recipe import DEFAULTS_TO, ROLES, compose
from nvfp4_ops.telemetry import gemm_operands

_NV, _MX8, _BF = get_recipe("nvfp4"), get_recipe("nvfp4-fwd-mxfp8-bwd"), get_recipe("bf16")
ALL_RECIPES = [
    r for name in RECIPES for r in (get_recipe(name), get_recipe(name).with_bf16_fprop())
] + [
    compose(_NV, _MX8, get_recipe("nvfp4-no-sr")),
    compose(_BF, _NV, _MX8),
    compose(_NV, _BF, _NV),
    compose(get_recipe("nvfp4-no-2d"), _NV, _NV),
]


def test_every_format_has_one_table_entry():
    assert tuple(FORMAT_OPS) == FORMATS
    for fmt, ops in FORMAT_OPS.items():
        for block in ops.block_shapes:
            tq = TensorQuant(fmt, block)
            assert tq.quantized == ops.quantized
            assert (ops.counts is not None) == ops.quantized
        rounding_ok = True
        try:
            TensorQuant(fmt, ops.block_shapes[0], "stochastic")
        except ValueError:
            rounding_ok = False
        assert rounding_ok == ops.stochastic, fmt


def test_operand_table_is_consistent():
    assert KEY_SLOTS == ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_x", "wgrad_dy")
    assert [n for g in GEMM_SPECS.values() for n in (g.lhs, g.rhs)] == list(OPERANDS)
    for spec in OPERANDS.values():
        assert GEMM_SPECS[spec.gemm] in [
            g for g in GEMM_SPECS.values() if spec.name in (g.lhs, g.rhs)
        ]
        assert spec.setting in ROLES
        shares = spec.shares
        assert shares is None or DEFAULTS_TO[spec.setting] == OPERANDS[shares].setting
    for flag in (g.unquantized_if for g in GEMM_SPECS.values() if g.unquantized_if):
        assert isinstance(getattr(Recipe(), flag), bool)


@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=lambda r: r.name)
def test_telemetry_describes_exactly_the_quantizations_qdot_runs(recipe, monkeypatch):
    """Every quantize_operand call of the custom_vjp (forward and backward) is one operand of
    `telemetry.gemm_operands`, with the same settings, the same key and the same values."""
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (32, 64))
    w = jax.random.normal(kw, (64, 32)) * 0.1
    dy = jax.random.normal(kd, (32, 32)) * 0.01
    key = jax.random.key(5)
    calls = []
    real = qdot.quantize_operand

    def recording(operand, tq, k=None):
        if tq.quantized:
            calls.append((np.asarray(operand), tq, None if k is None else jax.random.key_data(k)))
        return real(operand, tq, k)

    monkeypatch.setattr(qdot, "quantize_operand", recording)
    a = recipe.alignment
    cfg = qdot.GemmConfig(recipe, "emulated", np.dtype("float32"), np.dtype("float32"), x.dtype)
    x3, w3 = pad_to(x[None], (1, a, a)), pad_to(w[None], (1, a, a))
    _, residuals = qdot._fwd(x3, w3, key, cfg)
    qdot._bwd(cfg, residuals, pad_to(dy[None], (1, a, a)))

    slot_of = {
        np.asarray(jax.random.key_data(k)).tobytes(): s for s, k in qdot.split_keys(key).items()
    }
    ran = {slot_of[np.asarray(k).tobytes()]: (operand, tq) for operand, tq, k in calls}
    described = gemm_operands(x, w, dy, recipe)
    assert len(ran) == len(calls) == len(described)  # one key slot per quantization
    assert sorted(ran) == sorted(slot for _, _, slot in described.values())
    for role, (want, want_tq, slot) in described.items():
        operand, tq = ran[slot]
        assert tq == want_tq, role
        np.testing.assert_array_equal(operand, np.asarray(want), err_msg=role)


def test_quantizations_name_the_reused_weight_once():
    nv = get_recipe("nvfp4")
    assert list(quantizations(nv)) == ["fprop_x", "fprop_w", "dgrad_dy", "wgrad_x", "wgrad_dy"]
    assert operand_quants(nv)["dgrad_w"].key_slot == "fprop_w"
    late = quantizations(nv.with_bf16_fprop())
    assert list(late) == ["dgrad_dy", "dgrad_w", "wgrad_x", "wgrad_dy"]
    assert late["dgrad_w"].name == "fprop_w"  # the Fprop quantization, computed for Dgrad
    assert list(quantizations(get_recipe("nvfp4-no-2d"))) == list(KEY_SLOTS)


def test_one_missing_key_check():
    sr = TensorQuant("nvfp4", (1, 16), "stochastic")
    for settings in (sr, get_recipe("nvfp4")):
        with pytest.raises(ValueError, match="needs a PRNG key, got key=None"):
            require_key(None, settings)
        require_key(jax.random.key(0), settings)
    require_key(None, get_recipe("nvfp4-no-sr"))
    require_key(None, TensorQuant("nvfp4", (1, 16)))
    with pytest.raises(ValueError, match="recipe 'nvfp4' uses stochastic rounding"):
        require_key(None, get_recipe("nvfp4"))
