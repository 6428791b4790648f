"""Stochastic rounding (spec section 4): exact rule, unbiasedness, RNE == SR on the grid.

Statistical tolerance: with N independent draws the mean of a two-point variable taking lo / hi
with P(hi) = p has standard deviation sigma = (hi - lo) * sqrt(p (1 - p) / N). Every check allows
5 sigma (two-sided false-alarm probability 5.7e-7 per value); seeds are fixed, so the tests are
deterministic, and a biased rule (e.g. RNE, or p off by a constant) misses by many sigma.
"""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref

from nvfp4_format import decode_e2m1, dequantize, encode_e2m1, quantize

GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)
N_DRAWS = 20_000


def _neighbours(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """lo, hi grid points around magnitudes a < 6 and P(up) = (a - lo) / (hi - lo)."""
    k = np.searchsorted(GRID, a, side="right") - 1
    lo, hi = GRID[k], GRID[k + 1]
    return lo, hi, (a - lo) / (hi - lo)


def test_encode_is_unbiased():
    xs = np.array(
        [0.1, 0.3, 0.6, 0.9, 1.1, 1.6, 1.9, 2.2, 2.9, 3.3, 3.9, 4.5, 5.1, 5.9], np.float32
    )
    xs = np.concatenate([xs, -xs])
    u = np.random.default_rng(1234).random((N_DRAWS, xs.size), dtype=np.float32)
    x = np.broadcast_to(xs, u.shape)
    q = np.asarray(decode_e2m1(encode_e2m1(x, rounding="stochastic", uniform=u)), np.float64)
    lo, hi, p = _neighbours(np.abs(xs.astype(np.float64)))
    sigma = (hi - lo) * np.sqrt(p * (1 - p) / N_DRAWS)
    err = np.abs(q.mean(axis=0) - xs.astype(np.float64))
    assert (err <= 5 * sigma).all(), list(
        zip(xs.tolist(), err.tolist(), sigma.tolist(), strict=True)
    )
    # each value only ever lands on its two neighbours, with the sign of x
    np.testing.assert_array_equal(np.abs(q) == lo, np.abs(q) != hi)
    assert (np.signbit(q) == np.signbit(xs)).all()


@pytest.mark.parametrize(
    ("x", "u", "code"),
    [
        (0.625, 0.25, 1),  # p = (0.625-0.5)/0.5 = 0.25; u < p is false -> down to 0.5
        (0.625, float(np.nextafter(np.float32(0.25), np.float32(0))), 2),  # u < p -> up to 1
        (2.25, 0.25, 4),  # p = 0.25 between 2 and 3
        (2.25, 0.0, 5),
        (5.5, 0.75, 6),  # p = 0.75 between 4 and 6
        (5.5, float(np.nextafter(np.float32(0.75), np.float32(0))), 7),
        (-5.5, 0.5, 15),
        (-0.125, 0.25, 8),  # p = 0.25 between 0 and 0.5, u = p -> down to -0
        (-0.125, 0.2, 9),
        (1.5, 0.0, 3),  # on grid: p = 0, never up
        (0.0, 0.0, 0),
        (-0.0, 0.0, 8),
        (6.0, 0.0, 7),
        (6.5, 0.999, 7),  # saturates
        (-1e30, 0.5, 15),
    ],
)
def test_exact_rule_round_up_iff_u_below_p(x, u, code):
    got = encode_e2m1(
        np.array([x], np.float32), rounding="stochastic", uniform=np.array([u], np.float32)
    )
    assert np.asarray(got).tolist() == [code]


def test_encode_matches_reference(dist, dtype):
    x = ref.sample(dist, (32, 48), dtype, 7)
    if dist == "tiny":  # bring into the E2M1 range (encode_e2m1 does no scaling)
        x = (x.astype(np.float32) / np.abs(x.astype(np.float32)).max() * 7).astype(dtype)
    u = np.random.default_rng(8).random(x.shape, dtype=np.float32)
    got = np.asarray(encode_e2m1(x, rounding="stochastic", uniform=u))
    np.testing.assert_array_equal(got, ref.encode_e2m1(x, "stochastic", u))


def test_rne_equals_sr_on_grid_elements(dtype):
    rng = np.random.default_rng(9)
    x = np.asarray(decode_e2m1(rng.integers(0, 16, (64, 32)).astype(np.uint8))).astype(dtype)
    u = rng.random(x.shape, dtype=np.float32)
    sr = np.asarray(encode_e2m1(x, rounding="stochastic", uniform=u))
    np.testing.assert_array_equal(sr, np.asarray(encode_e2m1(x)))


def _on_grid_tensor(rng) -> np.ndarray:
    """Blocks of grid values times 2^k, each block holding +-6*2^k, k in [-9, 8].

    With global_amax = 2688 (s_enc = s_dec = 1), sb = f32(6*2^k * f32(1/6)) = 2^k exactly, so
    enc_b = 2^-k and every scaled element is exactly a grid point.
    """
    codes = rng.integers(0, 16, (40, 64)).astype(np.uint8)
    codes[:, ::16] = rng.choice([7, 15], (40, 4))
    k = rng.integers(-9, 9, (40, 4)).astype(np.float64)
    return (ref.decode_e2m1(codes) * np.repeat(2.0**k, 16, axis=1)).astype(np.float32)


def test_quantize_rne_equals_sr_for_on_grid_inputs():
    rng = np.random.default_rng(10)
    x = _on_grid_tensor(rng)
    u = rng.random(x.shape, dtype=np.float32)
    rne = quantize(x, global_amax=2688.0)
    sr = quantize(x, global_amax=2688.0, rounding="stochastic", uniform=u)
    np.testing.assert_array_equal(np.asarray(sr.packed), np.asarray(rne.packed))
    np.testing.assert_array_equal(np.asarray(dequantize(sr)), x)


def test_quantize_is_unbiased_over_draws():
    """One row repeated N times (same scales in every row); mean of dequantize -> x.

    Elements whose scaled value y = x * enc_b exceeds 6 saturate and must give exactly 6*sb*s_dec.
    """
    n = 4096
    x = ref.sample("normal", (1, 64), np.float32, 11)
    u = np.random.default_rng(12).random((n, 64), dtype=np.float32)
    a = quantize(np.repeat(x, n, axis=0), rounding="stochastic", uniform=u)
    dq = np.asarray(dequantize(a), np.float64)
    codes, scales, s_dec = ref.quantize(x)
    step = np.repeat(scales.astype(np.float64), 16, axis=1) * float(s_dec)  # sb * s_dec
    y = np.abs(x.astype(np.float64)) / step
    sat = y >= 6
    lo, hi, p = _neighbours(np.minimum(y, 5.999))
    sigma = (hi - lo) * step * np.sqrt(p * (1 - p) / n)
    err = np.abs(dq.mean(axis=0) - x.astype(np.float64))[~sat]
    assert (err <= 5 * sigma[~sat] + 1e-6 * np.abs(x[~sat])).all()
    six = ref.dequantize(np.full(x.shape, 7, np.uint8), scales, s_dec).astype(np.float64)
    np.testing.assert_array_equal(np.abs(dq[:, sat[0]]), np.broadcast_to(six[sat], (n, sat.sum())))
    assert sat.any()  # the block maxima of this sample do saturate (y in [5.65, 6.4])
    # the draws really vary (stochastic, not deterministic) for off-grid elements
    mid = ((p > 0.05) & (p < 0.95) & ~sat)[0]
    assert mid.sum() > 20 and (dq.std(axis=0)[mid] > 0).all()
