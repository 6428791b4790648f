"""`ragged_dot`: the grouped call is a loop of per-group dense `dot_general` calls, bit for bit.

The claim: for every preset, `ragged_dot(x, w, group_sizes, key=key)` equals, forward and both
gradients, the dense calls `dot_general(x_g, w[e], key=fold_in(key, e))` on each group's rows
(the dense call pads each group to the alignment itself), with zero rows past sum(group_sizes).
The groups: uneven, an empty one, one of a single row, 7 padding rows; group_sizes is traced
(one compiled function serves other sizes). The GEMM machinery is checked on its own where it
needs more rows: a group of 9 tiles computed in pieces of 8 + 1 tiles (Fprop, Dgrad) and in a
10-tile window reaching into the next group (Wgrad). Shapes are the smallest that show each
claim; each preset compiles one grouped and one dense function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_ops
from nvfp4_ops import backends
from nvfp4_ops.backends import Call, select_backend, unsupported
from nvfp4_ops.grouped.gemm import emulated_rows, emulated_wgrad
from nvfp4_ops.grouped.layout import GroupShape, from_tiles, group_layout, to_tiles
from nvfp4_ops.recipe import as_recipe
from nvfp4_ops.te_backend import TE_GROUPED_UNSUPPORTED

F32 = jnp.float32
T, K, N = 48, 32, 32
SIZES = (23, 0, 1, 17)  # uneven, empty, one row; sum 41: 7 rows of padding
E = len(SIZES)
OTHER_SIZES = (0, 30, 16, 1)  # sum 47: one padding row
MATMUL = (((1,), (0,)), ((), ()))


def _operands(tokens: int, seed: int = 0):
    kx, kw, kd, kk = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(kx, (tokens, K), F32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (E, K, N), F32) * 0.1).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (tokens, N), F32)
    return x, w, dy, kk


X, W, DY, KEY = _operands(T)


def grouped_step(recipe: str, backend: str = "emulated"):
    """jit((x, w, group_sizes, key, dy) -> (y, dx, dw)) of `ragged_dot` (sizes traced)."""

    @jax.jit
    def run(x, w, group_sizes, key, dy):
        def f(a, b):
            return nvfp4_ops.ragged_dot(
                a, b, group_sizes, recipe=recipe, key=key, backend=backend,
                preferred_element_type=F32,
            )  # fmt: skip

        y, pullback = jax.vjp(f, x, w)
        return (y, *pullback(dy))

    return run


def dense_loop(recipe: str, sizes: tuple[int, ...], fold=lambda key, e: jax.random.fold_in(key, e)):
    """jit((x, w, key, dy) -> (y, dx, dw)) of one dense `dot_general` per group (static sizes)."""

    @jax.jit
    def run(x, w, key, dy):
        def f(a, b):
            outs, start = [], 0
            for e, g in enumerate(sizes):
                k = None if key is None else fold(key, e)
                outs.append(nvfp4_ops.dot_general(
                    a[start : start + g], b[e], MATMUL, preferred_element_type=F32,
                    recipe=recipe, key=k, backend="emulated",
                ))  # fmt: skip
                start += g
            return jnp.concatenate([*outs, jnp.zeros((a.shape[0] - start, b.shape[2]), F32)])

        y, pullback = jax.vjp(f, x, w)
        return (y, *pullback(dy))

    return run


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_bitwise_equal(got, want, what: str) -> None:
    for name, g, w in zip(("y", "dx", "dw"), got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, (what, name, g.dtype, w.dtype)
        differ = int(np.sum(_bits(g) != _bits(w)))
        assert differ == 0, f"{what}: {name} differs from the dense loop in {differ} elements"


def _key(recipe):
    return KEY if as_recipe(recipe).needs_key else None


LATE_SWITCH = nvfp4_ops.get_recipe("nvfp4").with_bf16_fprop()  # the trainer's late BF16 Fprop


@pytest.mark.parametrize(
    "recipe", [*nvfp4_ops.RECIPES, LATE_SWITCH], ids=lambda r: getattr(r, "name", r)
)
def test_grouped_equals_the_dense_loop_bit_for_bit(recipe):
    key = _key(recipe)
    got = grouped_step(recipe)(X, W, jnp.array(SIZES, jnp.int32), key, DY)
    want = dense_loop(recipe, SIZES)(X, W, key, DY)
    assert_bitwise_equal(got, want, recipe)
    y, dx, dw = (np.asarray(v, np.float32) for v in got)
    used = sum(SIZES)
    assert np.all(y[used:] == 0) and np.all(dx[used:] == 0)  # padding rows
    assert np.all(dw[1] == 0)  # the empty group
    assert np.all(y[:used].any(axis=1)) and dx[:used].any() and dw[3].any()  # nothing vacuous


def test_group_sizes_are_traced_and_stochastic_rounding_uses_the_key():
    step = grouped_step("nvfp4")  # the preset test's program (compiled once per process)
    for sizes in (SIZES, OTHER_SIZES):
        got = step(X, W, jnp.array(sizes, jnp.int32), KEY, DY)
        assert_bitwise_equal(got, dense_loop("nvfp4", sizes)(X, W, KEY, DY), f"sizes {sizes}")
    assert step._cache_size() == 1
    _, dx, dw = step(X, W, jnp.array(OTHER_SIZES, jnp.int32), jax.random.key(7), DY)
    assert np.any(_bits(got[1]) != _bits(dx)) and np.any(_bits(got[2]) != _bits(dw))


def test_the_gemm_pieces_and_windows_are_the_dense_gemm_bit_for_bit():
    # Decoded operands straight into the emulated grouped GEMMs: group 0 has 9 tiles (pieces
    # 8 + 1; a Wgrad window of 10 tiles whose last one is group 2's, masked), group 1 is empty.
    shape = GroupShape(208, 4, 16)
    assert 10 in shape.window_tiles and 9 not in shape.window_tiles
    sizes = jnp.array([140, 0, 5, 40], jnp.int32)
    ka, kb, kc = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(ka, (208, 32), F32)
    dy = jax.random.normal(kb, (208, 16), F32)
    w_t = jax.random.normal(kc, (4, 16, 32), F32)  # per group [Q, C]

    @jax.jit
    def grouped(x, dy, w_t, sizes):
        layout = group_layout(sizes, shape)
        x_tiles, dy_tiles = to_tiles(x, layout), to_tiles(dy, layout)
        y = from_tiles(emulated_rows(x_tiles, w_t, layout), layout)
        return y, emulated_wgrad(jnp.swapaxes(x_tiles, 1, 2), jnp.swapaxes(dy_tiles, 1, 2), layout)

    y, dw = grouped(x, dy, w_t, sizes)
    last = (((2,), (2,)), ((0,), (0,)))
    dense = jax.jit(lambda a, b: jax.lax.dot_general(
        a[None], b[None], last, precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=F32,
    )[0])  # fmt: skip
    start = 0
    for e, g in enumerate(np.asarray(sizes)):
        padded = -(-int(g) // 16) * 16
        xg = jnp.pad(x[start : start + g], ((0, padded - g), (0, 0)))
        dyg = jnp.pad(dy[start : start + g], ((0, padded - g), (0, 0)))
        want_y, want_dw = dense(xg, w_t[e]), dense(xg.T, dyg.T)
        assert np.array_equal(_bits(y[start : start + g]), _bits(want_y[:g])), e
        assert np.array_equal(_bits(dw[e]), _bits(want_dw)), e
        start += int(g)


def test_a_slice_of_the_experts_with_its_group_offset_equals_those_groups_bit_for_bit():
    """Expert parallelism: a device holding experts [2, 4) calls ragged_dot on their rows with
    group_offset=2 (traced, as `jax.lax.axis_index` gives it) and gets the full call's y, dx and
    dw of those groups; without the offset its stochastic roundings differ."""
    full = grouped_step("nvfp4")(X, W, jnp.array(SIZES, jnp.int32), KEY, DY)

    @jax.jit
    def sliced(x, w, group_sizes, dy, group_offset):
        def f(a, b):
            return nvfp4_ops.ragged_dot(a, b, group_sizes, recipe="nvfp4", key=KEY,
                                        backend="emulated", preferred_element_type=F32,
                                        group_offset=group_offset)  # fmt: skip

        y, pullback = jax.vjp(f, x, w)
        return (y, *pullback(dy))

    start, stop = sum(SIZES[:2]), sum(SIZES)  # rows of groups 2 and 3, then 7 padding rows
    sizes = jnp.array(SIZES[2:], jnp.int32)
    got = sliced(X[start:], W[2:], sizes, DY[start:], jnp.int32(2))
    rows = stop - start
    want = (full[0][start:stop], full[1][start:stop], full[2][2:])
    assert_bitwise_equal((got[0][:rows], got[1][:rows], got[2]), want, "groups 2-3")
    assert np.all(np.asarray(got[0][rows:]) == 0)
    _, dx, dw = sliced(X[start:], W[2:], sizes, DY[start:], jnp.int32(0))
    assert np.any(_bits(dx[:rows]) != _bits(want[1])) and np.any(_bits(dw) != _bits(want[2]))
    with pytest.raises(ValueError, match="group_offset must be >= 0, got -1"):
        nvfp4_ops.ragged_dot(X, W, sizes.repeat(2), recipe="nvfp4", key=KEY, group_offset=-1)
    with pytest.raises(TypeError, match="group_offset must be an int or an integer scalar"):
        nvfp4_ops.ragged_dot(X, W, sizes.repeat(2), recipe="nvfp4", key=KEY, group_offset=1.0)


def test_the_non_partitionable_threefry_draws_are_rebuilt_too():
    with jax.threefry_partitionable(False):
        got = grouped_step("nvfp4")(X, W, jnp.array(SIZES, jnp.int32), KEY, DY)
        want = dense_loop("nvfp4", SIZES)(X, W, KEY, DY)
    assert_bitwise_equal(got, want, "jax_threefry_partitionable=False")


def test_stochastic_rounding_needs_a_threefry_key():
    key = jax.random.key(0, impl="rbg")
    with pytest.raises(ValueError, match="must be a threefry2x32 key, got a rbg key"):
        nvfp4_ops.ragged_dot(X, W, jnp.array(SIZES, jnp.int32), recipe="nvfp4", key=key)
    # round to nearest draws nothing: any key is fine
    nvfp4_ops.ragged_dot(X, W, jnp.array(SIZES, jnp.int32), recipe="nvfp4-no-sr", key=key)


@pytest.mark.parametrize("recipe", ["nvfp4-no-sr", "nvfp4-naive", "fp8"])
def test_xla_agrees_with_emulated_for_round_to_nearest(recipe):
    # The same quantized operands; the xla GEMMs sum in another order and apply the outer scales
    # to the sums (the statistical comparison of stochastic presets is verify_backend's).
    sizes = jnp.array(SIZES, jnp.int32)
    got = grouped_step(recipe, "xla")(X, W, sizes, None, DY)
    want = grouped_step(recipe)(X, W, sizes, None, DY)
    ax, aw, ady = (np.abs(np.asarray(v, np.float32)) for v in (X, W, DY))
    scale = {"y": np.zeros((T, N)), "dx": np.zeros((T, K)), "dw": np.zeros((E, K, N))}
    start = 0
    for e, g in enumerate(SIZES):
        rows = slice(start, start + g)
        scale["y"][rows], scale["dx"][rows] = ax[rows] @ aw[e], ady[rows] @ aw[e].T
        scale["dw"][e], start = ax[rows].T @ ady[rows], start + g
    for (name, bound), a, b in zip(scale.items(), got, want, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        rounding = 0.0 if name == "y" else 2.0**-8 * (np.abs(a) + np.abs(b))  # BF16: one each
        assert np.all(np.abs(a - b) <= 1e-5 * bound + rounding + 1e-30), name


def _largest_intermediate(jaxpr) -> int:
    """The most elements of any value in `jaxpr` and every jaxpr nested in it."""
    most = 0
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            most = max(most, int(np.prod(getattr(v.aval, "shape", ()), dtype=np.int64)))
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    most = max(most, _largest_intermediate(inner))
    return most


def test_padding_and_work_grow_with_e_times_alignment_not_e_times_t():
    rng = np.random.default_rng(0)
    for tokens, groups, alignment in ((48, 4, 16), (4096, 64, 16), (4096, 64, 32), (10, 8, 1)):
        shape = GroupShape(tokens, groups, alignment)
        a = shape.tile_rows  # the alignment, at least 16 rows
        assert a == max(alignment, 16)
        assert tokens + groups * (a - 1) - a < shape.rows <= tokens + groups * (a - 1)
        worst = [1] * (groups - 1) + [tokens - groups + 1]  # every group 1 row past a tile
        drawn = [rng.multinomial(tokens, np.ones(groups) / groups) for _ in range(100)]
        for sizes in (worst, *drawn):
            assert sum(-(-int(g) // a) for g in sizes) <= shape.tiles  # room for any sizes
        lengths = np.array(shape.window_tiles)
        assert lengths[-1] == shape.tiles and lengths[0] == 1
        large = lengths[lengths >= 8]  # Wgrad windows: <= 1.25x a group
        assert np.all(large[1:] / large[:-1] <= 1.25)
    # the whole step (forward, both gradients) at T = 512, E = 32: nothing of E x T x K
    tokens, groups = 512, 32
    x = jnp.zeros((tokens, K), jnp.bfloat16)
    w = jnp.zeros((groups, K, N), jnp.bfloat16)
    sizes = jnp.full((groups,), tokens // groups, jnp.int32)

    def step(x, w, sizes, key):
        f = lambda a, b: nvfp4_ops.ragged_dot(a, b, sizes, recipe="nvfp4", key=key)  # noqa: E731
        y, pullback = jax.vjp(f, x, w)
        return pullback(y)

    jaxpr = jax.make_jaxpr(step)(x, w, sizes, KEY).jaxpr
    padded = GroupShape(tokens, groups, 16).rows
    assert _largest_intermediate(jaxpr) <= max(padded * max(K, N), groups * K * N) * 4
    assert groups * tokens * K > 8 * max(padded * max(K, N), groups * K * N)


@pytest.mark.parametrize(
    "x_shape, w_shape, sizes, error, match",
    [
        ((T, K), (K, N), [T], ValueError, r"w must be 3-D \[E, K, N\].*got shape \(32, 32\)"),
        ((T, K, 1), (E, K, N), SIZES, ValueError, r"x must be 2-D \[T, K\].*\(48, 32, 1\)"),
        ((T, 48), (E, K, N), SIZES, ValueError, r"share K: x.shape\[1\] = 48, w.shape\[1\] = 32"),
        ((T, 40), (E, 40, N), SIZES, ValueError, r"K must be a multiple of 16 .* got K=40"),
        ((T, K), (E, K, 24), SIZES, ValueError, r"N must be a multiple of 16 .* got N=24"),
        ((T, K), (E, K, N), SIZES[:3], ValueError, r"shape \(E,\) = \(4,\).* got shape \(3,\)"),
        ((T, K), (E, K, N), np.array(SIZES, np.float32), TypeError, r"int32.*got float32"),
    ],
)
def test_errors_name_the_argument_the_expected_and_the_actual(
    x_shape, w_shape, sizes, error, match
):
    x, w = jnp.ones(x_shape, jnp.bfloat16), jnp.ones(w_shape, jnp.bfloat16)
    with pytest.raises(error, match=match):
        nvfp4_ops.ragged_dot(x, w, jnp.asarray(sizes), recipe="nvfp4-no-sr")


def test_mxfp4_needs_k_and_n_in_its_32_alignment():
    x, w = jnp.ones((T, 48), jnp.bfloat16), jnp.ones((E, 48, N), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"K must be a multiple of 32 \(recipe 'mxfp4'"):
        nvfp4_ops.ragged_dot(x, w, jnp.array(SIZES, jnp.int32), recipe="mxfp4", key=KEY)


def test_te_refuses_grouped_calls_and_auto_falls_back(monkeypatch):
    caps = {name: (True, f"{name} (fake)") for name in nvfp4_ops.BACKENDS}
    monkeypatch.setattr(backends, "backend_capability", caps.__getitem__)
    monkeypatch.setattr(backends, "auto_order", lambda: ("te", "xla", "emulated"))
    monkeypatch.setattr(backends, "_VERIFIED", {"te": (True, "fake"), "xla": (True, "fake")})
    nvfp4 = nvfp4_ops.get_recipe("nvfp4")
    assert unsupported("te", Call(nvfp4, grouped=True)) == TE_GROUPED_UNSUPPORTED
    assert unsupported("te", Call(nvfp4)) is None  # the dense call still goes to TE
    assert select_backend("auto", Call(nvfp4, grouped=True)) == "xla"
    with pytest.raises(ValueError, match="grouped GEMM .* takes no NVFP4 operands"):
        nvfp4_ops.ragged_dot(X, W, jnp.array(SIZES, jnp.int32), recipe="nvfp4", key=KEY,
                             backend="te")  # fmt: skip
