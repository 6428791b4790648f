"""The recipe's three GEMMs through `nvfp4_ops.dot_general` against TE's reference recipe.

TE's reference recipe (`nvfp4_ref_rht_2d_factory`): x and dY 1x16 with RHT on their column-wise
(Wgrad) usage, W 16x16 tiles, its `qgemm` per GEMM type. For BF16 operands and the presets
"nvfp4-no-sr" and "nvfp4":
- every GEMM operand that `dot_general` quantizes (as `nvfp4_ops.telemetry.gemm_operands` lays
  them out, with `qdot`'s keys) is TE's, bit for bit; stochastically rounded ones have TE's scales
  bit for bit, codes on the two grid points around TE's scaled value, and are unbiased;
- y, dX and dW of `dot_general` are bit for bit our emulated GEMM of TE's operands, and within the
  FP32 summation bound of TE's own `qgemm` of them (the two sum in different orders).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import te_convert as tc

import nvfp4_format as nf
import nvfp4_ops
from nvfp4_ops.gemm import emulated_gemm
from nvfp4_ops.qdot import split_keys
from nvfp4_ops.quantizers import quantize_operand
from nvfp4_ops.telemetry import gemm_operands

M, K, N = 128, 256, 192
MATMUL = (((1,), (0,)), ((), ()))
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
U32 = float(np.finfo(np.float32).eps) / 2


def _data(seed: int = 0):
    bf16 = ml_dtypes.bfloat16
    x = tc.operand("outliers", (M, K), bf16, seed)
    w = (tc.operand("normal", (K, N), np.float32, seed + 1) * 0.05).astype(bf16)
    dy = (tc.operand("normal", (M, N), np.float32, seed + 2) * 1e-3).astype(bf16)
    return x, w, dy


def _te_quantized(reference, x, w, dy):
    """TE's reference quantization of x, W ([N, K], as TE stores it) and dY."""
    formats = getattr(reference, "reference_utils", None) or reference.utils
    make = reference.NVFP4QuantizerRef  # what nvfp4_ref_rht_2d_factory builds per role
    e2m1 = formats.Fp4Formats.E2M1
    activation = make(dtype=e2m1, quant_tile_shape=(1, 16), with_rht=True)
    weight = make(dtype=e2m1, quant_tile_shape=(16, 16), with_rht=False)
    gradient = make(dtype=e2m1, quant_tile_shape=(1, 16), with_rht=True)
    return (
        activation.quantize(tc.to_torch(x)),
        weight.quantize(tc.to_torch(np.ascontiguousarray(w.T))),
        gradient.quantize(tc.to_torch(dy)),
    )


def _te_operands(te_x, te_w, te_dy) -> dict[str, nf.NVFP4Array]:
    """TE's operand of each `gemm_operands` role, as NVFP4Arrays [rows, contraction]."""
    return {
        "fprop_x": tc.as_nvfp4(te_x.data, te_x.scale, te_x.global_amax_row, (1, 16)),
        "fprop_w": tc.as_nvfp4(te_w.data, te_w.scale, te_w.global_amax_row, (16, 16)),
        "dgrad_dy": tc.as_nvfp4(te_dy.data, te_dy.scale, te_dy.global_amax_row, (1, 16)),
        "wgrad_x": tc.as_nvfp4(te_x.data_t, te_x.scale_t, te_x.global_amax_col, (1, 16)),
        "wgrad_dy": tc.as_nvfp4(te_dy.data_t, te_dy.scale_t, te_dy.global_amax_col, (1, 16)),
    }


def _ours(x, w, dy, recipe, key) -> dict[str, tuple[nf.NVFP4Array, np.ndarray]]:
    """Each role's (quantized operand, unquantized operand), as dot_general prepares them."""
    keys = split_keys(key)
    roles = gemm_operands(jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy), recipe)
    out = {}
    for role, (operand, tq, slot) in roles.items():
        q = jax.jit(quantize_operand, static_argnums=1)(operand, tq, keys[slot])
        out[role] = (_unbatched(q), np.asarray(operand[0]))
    return out


def _unbatched(q) -> nf.NVFP4Array:
    """A [1, rows, cols] NVFP4Array from JAX as a NumPy [rows, cols] one."""
    return nf.NVFP4Array(
        np.asarray(q.packed)[0], np.asarray(q.block_scales)[0], np.asarray(q.global_scale),
        q.shape[1:], q.block_shape,
    )  # fmt: skip


def _grads(x, w, dy, recipe, key):
    @jax.jit
    def run(x, w, dy):
        f = lambda a, b: nvfp4_ops.dot_general(  # noqa: E731
            a, b, MATMUL, preferred_element_type=jnp.float32, recipe=recipe, key=key,
            backend="emulated",
        )  # fmt: skip
        y, pullback = jax.vjp(f, x, w)
        return (y, *pullback(dy.astype(jnp.float32)))

    outputs = run(jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy))
    return [np.asarray(a, np.float32) for a in outputs]


def _batched(q: nf.NVFP4Array) -> nf.NVFP4Array:
    """A NumPy [rows, cols] NVFP4Array as a JAX [1, rows, cols] one (dot_general's layout)."""
    return nf.NVFP4Array(
        jnp.asarray(q.packed)[None], jnp.asarray(q.block_scales)[None],
        jnp.asarray(q.global_scale), (1, *q.shape), q.block_shape,
    )  # fmt: skip


def _replay(qa: nf.NVFP4Array, qb: nf.NVFP4Array, *, b_transposed: bool = False) -> np.ndarray:
    """Our emulated GEMM (the code dot_general runs) of two operands, float32 [P, Q]."""
    tq = nvfp4_ops.TensorQuant("nvfp4", (1, 16))
    gemm = jax.jit(lambda a, b: emulated_gemm(a, tq, b, tq, b_transposed=b_transposed))
    return np.asarray(gemm(_batched(qa), _batched(qb)))[0]


def _gemm_types(reference):
    module = getattr(reference, "gemm", None) or reference.quantization
    return module.GEMMType


def _te_qgemm(reference, te_x, te_w, te_dy) -> dict[str, np.ndarray]:
    """TE's reference GEMMs (`qgemm`) as its custom_gemm calls them, float32."""
    types, f32 = _gemm_types(reference), __import__("torch").float32
    q = te_x._quantizer
    return {
        "y": q.qgemm(te_x.data, te_w.data, None, f32, te_x.scale, te_w.scale, None,
                     gemm_type=types.FPROP, qresult_x=te_x, qresult_w=te_w),
        "dx": q.qgemm(te_dy.data, te_w.data_t, None, f32, te_dy.scale, te_w.scale_t, None,
                      gemm_type=types.DGRAD, qresult_x=te_dy, qresult_w=te_w),
        "dw_nk": q.qgemm(te_dy.data_t, te_x.data_t, None, f32, te_dy.scale_t, te_x.scale_t,
                         None, gemm_type=types.WGRAD, qresult_x=te_dy, qresult_w=te_x),
    }  # fmt: skip


def _summation_bound(qa: nf.NVFP4Array, qb: nf.NVFP4Array) -> np.ndarray:
    """|fl(sum a_i b_i) - sum a_i b_i| summed two ways (ours, TE's) plus TE's alpha rounding."""
    a = nf.dequantize(qa).astype(np.float64)
    b = nf.dequantize(qb).astype(np.float64)
    k = a.shape[-1]
    gamma = k * U32 / (1 - k * U32)
    return (2 * gamma + 8 * U32) * (np.abs(a) @ np.abs(b).T) + 1e-30


def _assert_same(ours: nf.NVFP4Array, theirs: nf.NVFP4Array, x: np.ndarray) -> None:
    diff = tc.differences(ours, theirs, x)
    assert diff == {**diff, "block_scales": 0, "global_scale": 0, "codes": 0}, diff


def test_rne_recipe_operands_and_gemms_are_te_reference(reference):
    x, w, dy = _data()
    recipe, key = nvfp4_ops.get_recipe("nvfp4-no-sr"), jax.random.key(0)
    te_x, te_w, te_dy = _te_quantized(reference, x, w, dy)
    theirs = _te_operands(te_x, te_w, te_dy)
    ours = _ours(x, w, dy, recipe, key)
    assert set(ours) == set(theirs)
    for role, (q, operand) in ours.items():
        _assert_same(q, theirs[role], operand)
    # Dgrad's W is Fprop's, transposed: TE's column-wise 16x16 tiles are its row-wise ones.
    w_t = tc.as_nvfp4(te_w.data_t, te_w.scale_t, te_w.global_amax_col, (16, 16))
    np.testing.assert_array_equal(np.asarray(w_t.codes()), np.asarray(theirs["fprop_w"].codes()).T)

    y, dx, dw = _grads(x, w, dy, recipe, key)
    replay = {
        "y": _replay(theirs["fprop_x"], theirs["fprop_w"]),
        "dx": _replay(theirs["dgrad_dy"], theirs["fprop_w"], b_transposed=True),
        "dw": _replay(theirs["wgrad_x"], theirs["wgrad_dy"]),
    }
    np.testing.assert_array_equal(y, replay["y"])
    np.testing.assert_array_equal(dx, replay["dx"].astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(dw, replay["dw"].astype(ml_dtypes.bfloat16).astype(np.float32))

    te = {k: tc.to_numpy(v) for k, v in _te_qgemm(reference, te_x, te_w, te_dy).items()}
    bounds = {
        "y": _summation_bound(theirs["fprop_x"], theirs["fprop_w"]),
        "dx": _summation_bound(theirs["dgrad_dy"], w_t),
        "dw_nk": _summation_bound(theirs["wgrad_dy"], theirs["wgrad_x"]),
    }
    ours_gemm = {"y": replay["y"], "dx": replay["dx"], "dw_nk": replay["dw"].T}
    for name, bound in bounds.items():
        err = np.abs(ours_gemm[name].astype(np.float64) - te[name])
        assert (err <= bound).all(), (name, float((err / bound).max()))


def _scaled(x: np.ndarray, q: nf.NVFP4Array) -> np.ndarray:
    """TE's pre-rounding value clip(x * enc_b, -6, 6), enc_b = min(1 / (sb * s_dec), FLT_MAX)."""
    sb = np.repeat(np.asarray(q.block_scales).astype(np.float32), 16, axis=-1)
    with np.errstate(divide="ignore"):
        enc = np.minimum(np.float32(1.0) / (sb * np.float32(q.global_scale)), tc.FLT_MAX)
    return np.clip(x.astype(np.float32) * enc, -6.0, 6.0)


def test_stochastic_rounding_has_te_scales_and_support_and_is_unbiased(reference):
    x, w, dy = _data(seed=3)
    recipe = nvfp4_ops.get_recipe("nvfp4")
    te_x, te_w, te_dy = _te_quantized(reference, x, w, dy)  # TE's reference has RNE only
    theirs = _te_operands(te_x, te_w, te_dy)
    draws = [_ours(x, w, dy, recipe, jax.random.key(s)) for s in range(64)]
    for role in ("fprop_x", "fprop_w", "wgrad_x"):  # round to nearest in this preset too
        q, operand = draws[0][role]
        _assert_same(q, theirs[role], operand)
    for role in ("dgrad_dy", "wgrad_dy"):
        operand = draws[0][role][1]
        scaled = _scaled(operand, theirs[role])
        lo = E2M1_GRID[np.searchsorted(E2M1_GRID, np.abs(scaled), side="right") - 1]
        hi = E2M1_GRID[np.minimum(np.searchsorted(E2M1_GRID, np.abs(scaled), side="left"), 7)]
        values = []
        for draw in draws:
            q = draw[role][0]
            assert tc.differences(q, theirs[role], operand)["block_scales"] == 0
            assert np.float32(q.global_scale) == np.float32(theirs[role].global_scale)
            v = E2M1_GRID[np.asarray(q.codes()) & 7]
            assert ((v == lo) | (v == hi)).all(), role
            values.append(np.sign(scaled) * v)
        mean = np.mean(values, axis=0)
        gap = hi - lo
        sigma = gap / 2 / np.sqrt(len(draws))
        assert (np.abs(mean - scaled) <= 5 * sigma + gap / 512 + 1e-7).all(), role
        assert (np.std(values, axis=0) > 0).mean() > 0.5  # the draws really differ


BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
CALL_PATTERNS = {
    # name: (x dtype, w dtype, preferred_element_type, how the cotangent arrives)
    "bf16-out-bf16-cotangent": (BF16, BF16, None, "as-output"),
    "f32-out-f32-cotangent": (BF16, BF16, F32, "as-output"),
    "f32-out-f32-cotangent-finer-than-bf16": (BF16, BF16, F32, "finer"),
    "f32-out-cast-to-bf16": (BF16, BF16, F32, "through-bf16-cast"),
    "bf16-out-explicit": (BF16, BF16, BF16, "as-output"),
    "f32-master-weight": (BF16, F32, None, "as-output"),
    "f32-master-weight-bf16-out": (BF16, F32, BF16, "as-output"),
}
"""The ways training code calls `dot_general` on BF16 activations. TE's dense receives dY in its
input's dtype whatever happens after it, so in each pattern both rotated Wgrad operands are
TE's bf16-rounded ones."""


@pytest.fixture(scope="module")
def te_rne_operands(reference):
    x, w, dy = _data()
    return (x, w, dy), _te_operands(*_te_quantized(reference, x, w, dy))


@pytest.mark.parametrize("pattern", list(CALL_PATTERNS))
def test_every_call_pattern_rounds_both_rotated_wgrad_operands_as_te(te_rne_operands, pattern):
    (x, w, dy), theirs = te_rne_operands
    x_dtype, w_dtype, preferred, cotangent = CALL_PATTERNS[pattern]
    recipe, key = nvfp4_ops.get_recipe("nvfp4-no-sr"), jax.random.key(0)

    def linear(a, b):
        y = nvfp4_ops.dot_general(
            a, b, MATMUL, preferred_element_type=preferred, recipe=recipe, key=key,
            backend="emulated",
        )  # fmt: skip
        return y.astype(BF16) if cotangent == "through-bf16-cast" else y

    @jax.jit
    def run(x, w, dy):
        y, pullback = jax.vjp(linear, x.astype(x_dtype), w.astype(w_dtype))
        g = dy.astype(y.dtype)
        if cotangent == "finer":  # below half a BF16 ulp: TE's BF16 output would round it away
            g = g * jnp.float32(1 + 2**-12)
        return (y, *pullback(g))

    _, dx, dw = run(jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy))
    assert (dx.dtype, dw.dtype) == (x_dtype, w_dtype)
    replay = {
        "dw": _replay(theirs["wgrad_x"], theirs["wgrad_dy"]).astype(w_dtype),
        "dx": _replay(theirs["dgrad_dy"], theirs["fprop_w"], b_transposed=True).astype(x_dtype),
    }
    np.testing.assert_array_equal(np.asarray(dw), replay["dw"], err_msg=f"{pattern}: dW")
    np.testing.assert_array_equal(np.asarray(dx), replay["dx"], err_msg=f"{pattern}: dX")
