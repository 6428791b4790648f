"""`ragged_dot` with non-finite input marks the entries its per-group dense calls mark.

- A NaN in one token of a 33-row group (in x, then in dY): the group's tensor scale is NaN in
  its dense call, so all its rows are; the grouped call must not mark only the NaN's tile. K = N
  = 128 because XLA:CPU's vectorised max dropped the NaN from tile amaxes (and 1x32 block amaxes)
  of that size (`nvfp4_ops.fp8.abs_max`).
- A NaN and an Inf in the weight of an expert that gets no token: no output row is that expert's,
  so every other group stays its dense call ("xla" multiplied the masked weight by zero).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_grouped import assert_bitwise_equal, dense_loop, grouped_step

F32 = jnp.float32
T, K, N = 40, 128, 128
SIZES = (33, 0, 7)  # the NaN's group spans three 16-row tiles; the second expert is empty
NAN_ROW = 20  # in the group's second tile


def _operands():
    kx, kw, kd = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (T, K), F32)
    w = jax.random.normal(kw, (len(SIZES), K, N), F32) * 0.1
    return x, w, jax.random.normal(kd, (T, N), F32)


def _nonfinite(outputs) -> list[np.ndarray]:
    return [~np.isfinite(np.asarray(v)) for v in outputs]


@pytest.mark.parametrize(
    ("recipe", "backend"), [("nvfp4", "emulated"), ("nvfp4", "xla"), ("mxfp4", "emulated")]
)
def test_a_nan_token_marks_what_the_dense_calls_mark(recipe, backend):
    x, w, dy = _operands()
    key, sizes = jax.random.key(5), jnp.array(SIZES, jnp.int32)
    grouped, dense = grouped_step(recipe, backend), dense_loop(recipe, SIZES)
    for name, args in (
        ("x", (x.at[NAN_ROW, 3].set(jnp.nan), w, dy)),
        ("dY", (x, w, dy.at[NAN_ROW, 3].set(jnp.nan))),
    ):
        got = _nonfinite(grouped(args[0], args[1], sizes, key, args[2]))
        want = _nonfinite(dense(*args[:2], key, args[2]))
        for part, g, d in zip(("y", "dx", "dw"), got, want, strict=True):
            assert np.array_equal(g, d), (
                f"NaN in {name}: {part} non-finite in {g.sum()} elements, the dense calls' in "
                f"{d.sum()}"
            )
        marked = want[0] if name == "x" else want[1]  # nothing vacuous: Fprop / Dgrad's rows
        assert marked[NAN_ROW].all() and (recipe == "mxfp4" or marked[: SIZES[0]].all())
        assert not marked[SIZES[0] :].any()


@pytest.mark.parametrize("backend", ["emulated", "xla"])
def test_a_non_finite_weight_of_an_empty_expert_changes_no_other_group(backend):
    x, w, dy = _operands()
    key, sizes = jax.random.key(5), jnp.array(SIZES, jnp.int32)
    bad = w.at[1, 2, 3].set(jnp.nan).at[1, 5, 7].set(jnp.inf)
    step = grouped_step("nvfp4", backend)
    got = step(x, bad, sizes, key, dy)
    assert all(np.isfinite(np.asarray(v)).all() for v in got)
    want = dense_loop("nvfp4", SIZES)(x, bad, key, dy) if backend == "emulated" else None
    if backend == "xla":  # XLA's sums differ from the dense calls' in order: its clean call
        want = step(x, w, sizes, key, dy)
    assert_bitwise_equal(got, want, f"{backend}, non-finite weight of the empty expert")
