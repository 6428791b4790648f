"""Quantization statistics: against direct computations and hand-built blocks with known answers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_ops
from nvfp4_ops import STATS, TensorQuant, gemm_operand_stats, get_recipe, operand_stats
from nvfp4_ops.canonical import pad_to
from nvfp4_ops.qdot import KEY_SLOTS, split_keys
from nvfp4_ops.quantizers import dequantize_operand, quantize_operand

NV_1D = TensorQuant("nvfp4", (1, 16))
NV_2D = TensorQuant("nvfp4", (16, 16))
NV_SR = TensorQuant("nvfp4", (1, 16), "stochastic")
MX = TensorQuant("mxfp4", (1, 32))
MX_SR = TensorQuant("mxfp4", (1, 32), "stochastic")
E4M3 = TensorQuant("fp8_e4m3", None)
E5M2 = TensorQuant("fp8_e5m2", None)
ALL_TQ = [NV_1D, NV_2D, NV_SR, MX, MX_SR, E4M3, E5M2]


def _normal(shape, seed=0, scale=1.0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale


def _gemm_data(m=32, k=48, n=32, seed=0, lead=()):
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (*lead, m, k))
    w = jax.random.normal(kw, (k, n)) * 0.1
    dy = jax.random.normal(kd, (*lead, m, n)) * 0.01
    return x, w, dy


@pytest.mark.parametrize("tq", ALL_TQ, ids=str)
def test_rel_error_is_the_round_trip_error(tq):
    x = _normal((32, 64), seed=1) * jnp.exp(_normal((32, 64), seed=2))  # heavy-ish tails
    key = jax.random.key(7)
    k = key if tq.rounding == "stochastic" else None

    xq = dequantize_operand(quantize_operand(x, tq, k), tq)
    expected = jnp.linalg.norm((x - xq).reshape(-1)) / jnp.linalg.norm(x.reshape(-1))
    got = operand_stats(x, tq, k)
    assert set(got) == set(STATS)
    assert all(v.dtype == jnp.float32 and v.shape == () for v in got.values())
    # Not bit-for-bit: under jit XLA fuses the decode into the subtraction (CPU may contract
    # x - q * s into an FMA) and orders the float32 sum of squares per fusion; differences are
    # a few ulp (seen: 1 ulp for FP8; bit-for-bit for all formats when both ran op by op).
    np.testing.assert_allclose(got["rel_error"], expected, rtol=2**-20, atol=0)
    assert float(got["amax"]) == float(jnp.max(jnp.abs(x)))
    assert 0.0 < float(got["rel_error"]) < 0.3


def test_nvfp4_underflow_counts_blocks_flushed_by_the_shared_global_scale():
    x = np.ones((2, 64), np.float32)
    x[0, 0:16] = 1e3  # sets the global scale: s_enc = 2688 / 1e3
    x[0, 16:32] = 1e-30  # block scale 1e-30 * 2.688 / 6 -> E4M3 0: underflow
    x[0, 32:48] = 0.0  # all-zero block: never underflow, not in the denominator
    x[1, 48:64] = np.linspace(-1e-30, 1e-30, 16)  # underflows too (a zero element inside)
    stats = operand_stats(jnp.asarray(x), NV_1D)
    assert float(stats["underflow"]) == np.float32(2) / np.float32(7)  # 7 nonzero blocks
    q = quantize_operand(jnp.asarray(x), NV_1D)
    sb = np.asarray(q.block_scales.astype(jnp.float32))
    assert sb[0, 1] == 0 and sb[1, 3] == 0 and np.count_nonzero(sb == 0) == 3  # 2 + the zero block
    assert float(operand_stats(jnp.zeros((2, 64)), NV_1D)["underflow"]) == 0.0


def test_nvfp4_2d_underflow_counts_tiles():
    x = np.ones((32, 32), np.float32)
    x[:16, :16] = 1e3
    x[16:, 16:] = 1e-30  # one of four tiles underflows
    x[16:, :16] = 0.0  # an all-zero tile
    assert float(operand_stats(jnp.asarray(x), NV_2D)["underflow"]) == np.float32(1) / 3
    assert float(operand_stats(jnp.asarray(x), NV_1D)["underflow"]) == np.float32(16) / 48


def _scale_rounds_down_block() -> np.ndarray:
    """Row 0 sets s_enc = 2688 / 2688 = 1; row 1's block max 6.3 gives 6.3 / 6 = 1.05, which E4M3
    rounds DOWN to 1.0, so its max scales to 6.3 > 6 and clips; row 2's max 6.6 gives 1.1 -> 1.125
    (rounded up), scaled max 5.87: no clip."""
    x = np.ones((3, 16), np.float32)
    x[0, 0] = 2688.0  # 2688 * (1 / 448) = 6 exactly: not saturated
    x[1, 5] = 6.3
    x[2, 9] = 6.6
    return x


def test_nvfp4_saturation_where_the_e4m3_scale_rounds_down():
    x = jnp.asarray(_scale_rounds_down_block())
    q = quantize_operand(x, NV_1D)
    assert float(q.global_scale) == 1.0
    np.testing.assert_array_equal(
        np.asarray(q.block_scales.astype(jnp.float32))[:, 0], [448, 1, 1.125]
    )
    xq = np.asarray(dequantize_operand(q, NV_1D))
    assert xq[1, 5] == 6.0 and xq[2, 9] == 6.75  # clipped / not clipped (6.6 / 1.125 -> 6 * 1.125)
    assert float(operand_stats(x, NV_1D)["saturation"]) == np.float32(1) / 48
    no_clip = x.at[1, 5].set(6.0)  # 6 / 6 = 1.0 exactly: the max lands on 6
    assert float(operand_stats(no_clip, NV_1D)["saturation"]) == 0.0


def test_mxfp4_saturation_ocp_rule():
    x = np.full((2, 32), 0.5, np.float32)
    x[0, 3] = 7.0  # e = floor(log2 7) - 2 = 0: 7 > 6 clips
    x[0, 4] = -6.5  # clips too
    x[1, 0] = 5.0  # e = 0, 5 <= 6
    stats = operand_stats(jnp.asarray(x), MX)
    assert float(stats["saturation"]) == np.float32(2) / 64
    assert float(stats["underflow"]) == 0.0


def test_fp8_underflow_and_no_spurious_saturation():
    x = np.ones(64, np.float32)
    x[0] = 448.0  # encode scale 1
    x[1:4] = 1e-4  # below half the smallest E4M3 subnormal (2^-10): decode to 0
    x[4:8] = 0.0  # zeros are not underflow, not in the denominator
    stats = operand_stats(jnp.asarray(x), E4M3)
    assert float(stats["underflow"]) == np.float32(3) / 60
    assert float(stats["saturation"]) == 0.0
    y = np.ones(64, np.float32)
    y[1:4] = 1e-6  # E5M2 with amax 1: encode 57344, 1e-6 -> 0.057, representable
    y[4:8] = 0.0
    assert float(operand_stats(jnp.asarray(y), E5M2)["underflow"]) == 0.0
    y[0] = 57344.0  # encode 1: 1e-6 is below half the smallest E5M2 subnormal (2^-17)
    assert float(operand_stats(jnp.asarray(y), E5M2)["underflow"]) == np.float32(3) / 60


def test_fp8_amax_a_few_ulps_above_max_is_not_saturation():
    # Find an amax whose max / decode_scale lands above 448 in float32 (scale rounding only).
    amaxes = np.linspace(1.0, 3.0, 4001, dtype=np.float32)
    decode = np.float32(1.0) / (np.float32(448.0) / amaxes)
    amax = amaxes[np.argmax(amaxes / decode > 448.0)]
    x = jnp.asarray(np.array([amax, 1.0, -0.5, 0.25], np.float32))
    t = nvfp4_ops.quantize_fp8(x)
    assert float(x[0] / t.decode_scale) > 448.0  # the precondition the slack is for
    assert float(operand_stats(x, E4M3)["saturation"]) == 0.0


def test_bf16_operand_and_recipe():
    x = _normal((4, 16)) * 3
    stats = operand_stats(x, TensorQuant("bf16", None))
    assert float(stats["amax"]) == float(jnp.max(jnp.abs(x)))
    assert [float(stats[s]) for s in ("underflow", "saturation", "rel_error")] == [0.0, 0.0, 0.0]
    assert gemm_operand_stats(*_gemm_data(), get_recipe("bf16")) == {}


def test_roles_per_recipe():
    data = _gemm_data()
    key = jax.random.key(0)
    nv = gemm_operand_stats(*data, get_recipe("nvfp4"), key)
    assert set(nv) == {"fprop_x", "fprop_w", "dgrad_dy", "wgrad_x", "wgrad_dy"}
    no2d = gemm_operand_stats(*data, get_recipe("nvfp4-no-2d"), key)
    assert set(no2d) == set(KEY_SLOTS)
    assert set(gemm_operand_stats(*data, get_recipe("fp8"))) == set(nv)  # per-tensor W reused
    assert all(set(s) == set(STATS) for s in no2d.values())


def test_wgrad_roles_are_the_rotated_transposed_operands():
    x, w, dy = _gemm_data(m=40, k=48, n=32)  # M padded to 48 before the rotation
    recipe = get_recipe("nvfp4")
    key = jax.random.key(3)
    keys = split_keys(key)
    got = gemm_operand_stats(x, w, dy, recipe, key)
    xt = nvfp4_ops.hadamard_transform(jnp.pad(x, ((0, 8), (0, 0))).T, axis=-1)
    dyt = nvfp4_ops.hadamard_transform(jnp.pad(dy, ((0, 8), (0, 0))).T, axis=-1)
    for role, op, tq in (("wgrad_x", xt, recipe.fprop_input), ("wgrad_dy", dyt, recipe.grad)):
        want = operand_stats(op[None], tq, keys[role])
        for s in STATS:
            np.testing.assert_allclose(got[role][s], want[s], rtol=1e-6, atol=0, err_msg=role + s)
        assert float(got[role]["amax"]) == float(jnp.max(jnp.abs(op)))  # amax after rotation
    assert float(got["wgrad_x"]["amax"]) != float(got["fprop_x"]["amax"])


def test_stochastic_roles_depend_on_the_key_rne_roles_do_not():
    data = _gemm_data()
    recipe = get_recipe("nvfp4")
    a = gemm_operand_stats(*data, recipe, jax.random.key(1))
    b = gemm_operand_stats(*data, recipe, jax.random.key(2))
    for role in ("dgrad_dy", "wgrad_dy"):
        assert float(a[role]["rel_error"]) != float(b[role]["rel_error"])
    for role in ("fprop_x", "fprop_w", "wgrad_x"):
        assert float(a[role]["rel_error"]) == float(b[role]["rel_error"])
    dy_pad = data[2][None]
    want = operand_stats(dy_pad, recipe.grad, split_keys(jax.random.key(1))["dgrad_dy"])
    np.testing.assert_array_equal(a["dgrad_dy"]["rel_error"], want["rel_error"])
    with pytest.raises(ValueError, match="needs a PRNG key"):
        gemm_operand_stats(*data, recipe)


def test_jit_matches_eager():
    data = _gemm_data(lead=(2,), m=16)  # leading batch dims flatten into 32 tokens
    recipe = get_recipe("nvfp4-no-2d")
    key = jax.random.key(5)
    eager = gemm_operand_stats(*data, recipe, key)
    jitted = jax.jit(gemm_operand_stats, static_argnums=3)(*data, recipe, key)
    assert set(jitted) == set(eager)
    for role in eager:
        for s in STATS:
            np.testing.assert_allclose(jitted[role][s], eager[role][s], rtol=1e-6, atol=0)
    one = jax.jit(operand_stats, static_argnums=1)(data[0], NV_2D)
    assert float(one["underflow"]) == 0.0 and 0 < float(one["rel_error"]) < 0.3


def test_padding_is_not_in_the_denominators():
    """K = 40 pads to 48: real elements 16 x 40 = 640, real nonzero blocks 16 x 3 = 48."""
    x = np.ones((16, 40), np.float32)
    x[0, 0] = 2688.0  # s_enc = 1 (see _scale_rounds_down_block)
    x[1, 17] = 6.3  # block 1: scale rounds down, clips
    x[2, 33] = 6.3  # last block, half padding: clips
    x[3, 32:40] = 1e-30  # last block, half padding: underflows
    x = jnp.asarray(x)
    expect_sat, expect_under = np.float32(2) / 640, np.float32(1) / 48
    direct = operand_stats(x, NV_1D)  # pads K to 16 itself
    assert float(direct["saturation"]) == expect_sat
    assert float(direct["underflow"]) == expect_under
    w = _normal((40, 32), seed=4) * 0.1
    got = gemm_operand_stats(
        x, w, _normal((16, 32), seed=5), get_recipe("nvfp4"), jax.random.key(0)
    )
    assert float(got["fprop_x"]["saturation"]) == expect_sat
    assert float(got["fprop_x"]["underflow"]) == expect_under
    padded = pad_to(x, (16, 32))  # more padding (as for MXFP4's alignment) changes nothing
    assert {s: float(v) for s, v in operand_stats(padded, NV_1D).items()} == {
        s: float(v) for s, v in direct.items()
    }


def test_bf16_fprop_reports_the_reused_weight_as_dgrad_w():
    recipe = get_recipe("nvfp4")
    data, key = _gemm_data(), jax.random.key(9)
    plain = gemm_operand_stats(*data, recipe, key)
    bf = gemm_operand_stats(*data, recipe.with_bf16_fprop(), key)
    assert set(bf) == {"dgrad_dy", "dgrad_w", "wgrad_x", "wgrad_dy"}
    assert {s: float(v) for s, v in bf["dgrad_w"].items()} == {
        s: float(v) for s, v in plain["fprop_w"].items()
    }
    no2d = gemm_operand_stats(*data, get_recipe("nvfp4-no-2d").with_bf16_fprop(), key)
    assert set(no2d) == {"dgrad_dy", "dgrad_w", "wgrad_x", "wgrad_dy"}


def test_bad_arguments():
    x, w, dy = _gemm_data()
    with pytest.raises(ValueError, match="dy must be"):
        gemm_operand_stats(x, w, dy[:, :16], get_recipe("nvfp4-no-sr"))
    with pytest.raises(ValueError, match="x must be"):
        gemm_operand_stats(x[:, :16], w, dy, get_recipe("nvfp4-no-sr"))
    with pytest.raises(TypeError, match="recipe must be a Recipe"):
        gemm_operand_stats(x, w, dy, "nvfp4")
    with pytest.raises(TypeError, match="tq must be a TensorQuant"):
        operand_stats(x, "nvfp4")
