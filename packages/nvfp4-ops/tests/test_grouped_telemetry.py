"""`ragged_operand_stats`: each group's statistics are `gemm_operand_stats` of its dense call.

The groups of `test_grouped` (uneven, an empty one, a single row, 7 padding rows), for the paper
recipe (16x16 weights, stochastic rounding, the RHT; alignment 16) and MXFP4 (no outer scale,
alignment 32). Counts and amax are equal; rel_error is summed per tile, then per group, so it
may differ from the dense sum in the last float32 bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_ops

F32 = jnp.float32
T, K, N = 48, 32, 32
SIZES = (23, 0, 1, 17)
E = len(SIZES)


def _operands():
    kx, kw, kd, kk = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (T, K), F32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (E, K, N), F32) * 0.1).astype(jnp.bfloat16)
    dy = (jax.random.normal(kd, (T, N), F32) * 1e-3).astype(jnp.bfloat16)
    return x, w, dy, kk


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_each_group_is_its_dense_calls_statistics(recipe):
    x, w, dy, key = _operands()
    r = nvfp4_ops.get_recipe(recipe)
    got = nvfp4_ops.ragged_operand_stats(x, w, dy, jnp.array(SIZES, jnp.int32), r, key)
    assert set(got) == set(nvfp4_ops.gemm_operand_stats(x, w[0], dy, r, key))
    start = 0
    for e, rows in enumerate(SIZES):
        group = slice(start, start + rows)
        start += rows
        if not rows:  # no tokens: zeros for x and dY, the weight's statistics as ever
            weight = nvfp4_ops.gemm_operand_stats(
                x[:1], w[e], dy[:1], r, jax.random.fold_in(key, e)
            )
            for role, stats in got.items():
                for stat, values in stats.items():
                    want = weight[role][stat] if role.endswith("_w") else 0.0
                    np.testing.assert_allclose(values[e], want, rtol=1e-6, err_msg=role)
            continue
        want = nvfp4_ops.gemm_operand_stats(
            x[group], w[e], dy[group], r, jax.random.fold_in(key, e)
        )  # fmt: skip
        for role, stats in want.items():
            for stat, value in stats.items():
                where = f"group {e} {role} {stat}"
                if stat == "rel_error":
                    np.testing.assert_allclose(got[role][stat][e], value, rtol=1e-6, err_msg=where)
                else:
                    assert float(got[role][stat][e]) == float(value), where
    assert float(got["fprop_x"]["rel_error"][0]) > 0  # nothing vacuous


def test_padding_rows_are_not_counted():
    x, w, dy, key = _operands()
    sizes = jnp.array(SIZES, jnp.int32)
    got = nvfp4_ops.ragged_operand_stats(x, w, dy, sizes, "nvfp4", key)
    loud = x.at[sum(SIZES) :].set(1e4)  # only the padding rows change
    again = nvfp4_ops.ragged_operand_stats(loud, w, dy, sizes, "nvfp4", key)
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), got, again)
    assert all(jax.tree.leaves(same))


def test_bf16_and_bad_arguments():
    x, w, dy, key = _operands()
    sizes = jnp.array(SIZES, jnp.int32)
    assert nvfp4_ops.ragged_operand_stats(x, w, dy, sizes, "bf16") == {}
    with pytest.raises(ValueError, match=r"dy must be \[T, N\] = \(48, 32\), got \(48, 16\)"):
        nvfp4_ops.ragged_operand_stats(x, w, dy[:, :16], sizes, "nvfp4", key)
    with pytest.raises(ValueError, match="group_sizes must be int32"):
        nvfp4_ops.ragged_operand_stats(x, w, dy, sizes[:3], "nvfp4", key)
    with pytest.raises(ValueError, match="key"):
        nvfp4_ops.ragged_operand_stats(x, w, dy, sizes, "nvfp4")
