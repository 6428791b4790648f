"""The three GEMMs of a grouped call on decoded operands, per backend.

Two shapes of grouped GEMM (operands float32, as the dense GEMMs decode them):
- `rows`: Fprop and Dgrad. lhs tiles [tiles, a, C] (x or dY in the padded buffer), rhs per group
  [E, Q, C]; every row of group e is contracted over C with rhs[e]: out tiles [tiles, a, Q].
- `wgrad`: lhs tiles [tiles, R1, a] and rhs tiles [tiles, R2, a] (x^T, dY^T); each group is
  contracted over its own tokens: out [E, R1, R2].

"emulated" (`EMULATED`): each group is one FP32 `dot_general` (precision HIGHEST) of exactly the
form the dense emulated GEMM runs (`gemm.emulated_gemm`: [1, P, C] . [1, Q, C] over the last
axes), on a window of the padded buffer that starts at the group's first tile
(`over_groups`). A window has one of a few static lengths (`GroupShape.window_tiles`, the
smallest that holds the group, at most ~1.42x its tiles), and its rows past the group are zero.
So the grouped result is the dense one bit for bit as long as XLA's FP32 dot gives (i) each
output row independently of the other rows and (ii) the same sum when zeros are appended to the
contraction. Both hold for XLA:CPU (checked bit for bit against the dense calls in
tests/test_grouped.py); elsewhere (GPU libraries choose kernels by shape) they are assumed,
untested, and a failure would change the FP32 summation order only. Cost: E GEMMs over ~1.2 T
rows in all: about one dense GEMM over the T rows, not E of them.

"xla" (`XLA`): the decoded operands to `jax.lax.ragged_dot_general` (ragged rows for Fprop and
Dgrad, ragged contraction for Wgrad, precision HIGHEST) with the padded group sizes, which XLA
lowers to its grouped GEMM on GPU and TPU; on CPU jax expands it to a masked dense dot over all
groups (E times the work of one dense GEMM). Equal to "emulated" up to FP32 summation order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from nvfp4_ops.grouped.layout import GroupLayout

_LAST = (((2,), (2,)), ((0,), (0,)))


@dataclasses.dataclass(frozen=True)
class Window:
    """`tiles` (static) consecutive tiles from a group's first; the first `count` are its own."""

    tiles: int
    first: jax.Array
    count: jax.Array

    def _indices(self, total: int) -> jax.Array:
        i = jnp.arange(self.tiles, dtype=jnp.int32)
        return jnp.where(i < self.count, self.first + i, total)  # `total`: out of bounds

    def take(self, tiles: jax.Array) -> jax.Array:
        """The window's tiles of `tiles` [n, ...]: [self.tiles, ...], zeros past the group."""
        return jnp.take(tiles, self._indices(tiles.shape[0]), axis=0, mode="fill", fill_value=0)

    def put(self, tiles: jax.Array, values: jax.Array) -> jax.Array:
        """`tiles` [n, ...] with the group's tiles of `values` [self.tiles, ...] written in."""
        return tiles.at[self._indices(tiles.shape[0])].set(values, mode="drop")


def over_groups(layout: GroupLayout, step: Callable[[Window, Any, Any], Any], init: Any) -> Any:
    """`carry = step(window, e, carry)` for the groups e = 0..E-1 in order (a `fori_loop`), each
    in the shortest static window that holds it; an empty group leaves `carry` as it is."""
    lengths = layout.shape.window_tiles
    counts = layout.tile_counts
    choice = jnp.where(counts == 0, 0, 1 + jnp.searchsorted(jnp.asarray(lengths), counts))

    def branch(length: int) -> Callable[[Any, Any], Any]:
        def run(e, carry):
            window = Window(length, layout.tile_starts[e], counts[e])
            return step(window, e, carry)

        return run

    branches = [lambda e, carry: carry, *(branch(n) for n in lengths)]
    body = lambda e, carry: jax.lax.switch(choice[e], branches, e, carry)  # noqa: E731
    return jax.lax.fori_loop(0, layout.shape.groups, body, init)


def _index(per_group: jax.Array, e) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(per_group, e, keepdims=False)


def rows_by_group(
    lhs_tiles: jax.Array,
    layout: GroupLayout,
    product: Callable[[jax.Array, Any], jax.Array],
    out_tile: tuple[tuple[int, ...], Any],
) -> jax.Array:
    """Out tiles whose rows of group e are `product(rows [L, C], e)` [L, Q] of that group's
    window (`over_groups`); `out_tile` = (shape of one out tile, dtype)."""
    shape, dtype = out_tile
    a = layout.shape.alignment

    def step(window: Window, e, out):
        rows = window.take(lhs_tiles)
        rows = rows.reshape(window.tiles * a, *rows.shape[2:])
        return window.put(out, product(rows, e).reshape(window.tiles, *shape))

    return over_groups(layout, step, jnp.zeros((layout.shape.tiles, *shape), dtype))


def tokens_last(tiles: jax.Array) -> jax.Array:
    """Window tiles [L/a, R, a] -> [R, L] (the tokens of the window in order, last)."""
    return jnp.swapaxes(tiles, 0, 1).reshape(tiles.shape[1], -1)


def by_group(
    lhs_tiles: jax.Array,
    rhs_tiles: jax.Array,
    layout: GroupLayout,
    product: Callable[[jax.Array, jax.Array], jax.Array],
    out: tuple[tuple[int, ...], Any],
) -> jax.Array:
    """[E, ...]: group e's entry is `product(lhs window tiles, rhs window tiles)` (zeros for an
    empty group); `out` = (shape of one entry, dtype)."""
    shape, dtype = out

    def step(window: Window, e, acc):
        value = product(window.take(lhs_tiles), window.take(rhs_tiles))
        return jax.lax.dynamic_update_index_in_dim(acc, value.astype(dtype), e, 0)

    return over_groups(layout, step, jnp.zeros((layout.shape.groups, *shape), dtype))


def _fp32_last(a: jax.Array, b: jax.Array) -> jax.Array:
    """The dense emulated GEMM's product: [1, P, C] . [1, Q, C] -> float32 [1, P, Q]."""
    return jax.lax.dot_general(
        a, b, _LAST, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )


def emulated_rows(lhs_tiles: jax.Array, rhs: jax.Array, layout: GroupLayout) -> jax.Array:
    """Fprop / Dgrad: lhs tiles [tiles, a, C] . rhs[e] [Q, C] per group -> [tiles, a, Q]."""
    a, q = layout.shape.alignment, rhs.shape[1]

    def product(rows, e):
        return _fp32_last(rows[None], _index(rhs, e)[None])[0]

    with jax.named_scope("nvfp4/grouped_gemm_emulated"):
        return rows_by_group(lhs_tiles, layout, product, ((a, q), jnp.float32))


def emulated_wgrad(lhs_tiles: jax.Array, rhs_tiles: jax.Array, layout: GroupLayout) -> jax.Array:
    """Wgrad: [tiles, R1, a] and [tiles, R2, a], contracted over each group's tokens ->
    [E, R1, R2]."""

    def product(lhs, rhs):
        return _fp32_last(tokens_last(lhs)[None], tokens_last(rhs)[None])[0]

    shape = (lhs_tiles.shape[1], rhs_tiles.shape[1])
    with jax.named_scope("nvfp4/grouped_gemm_emulated"):
        return by_group(lhs_tiles, rhs_tiles, layout, product, (shape, jnp.float32))


def xla_rows(lhs_tiles: jax.Array, rhs: jax.Array, layout: GroupLayout) -> jax.Array:
    """`emulated_rows` through `jax.lax.ragged_dot_general` (ragged rows, rhs [E, Q, C])."""
    n, a, c = lhs_tiles.shape
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())),
        lhs_ragged_dimensions=(0,),
        rhs_group_dimensions=(0,),
    )
    with jax.named_scope("nvfp4/grouped_gemm_xla"):
        out = jax.lax.ragged_dot_general(
            lhs_tiles.reshape(n * a, c), rhs, layout.padded_sizes, dims,
            precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
        )  # fmt: skip
        return out.reshape(n, a, rhs.shape[1])


def xla_wgrad(lhs_tiles: jax.Array, rhs_tiles: jax.Array, layout: GroupLayout) -> jax.Array:
    """`emulated_wgrad` through `jax.lax.ragged_dot_general` (ragged contraction)."""
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (1,)), ((), ())),
        lhs_ragged_dimensions=(1,),
        rhs_group_dimensions=(),
    )
    with jax.named_scope("nvfp4/grouped_gemm_xla"):
        return jax.lax.ragged_dot_general(
            tokens_last(lhs_tiles), tokens_last(rhs_tiles), layout.padded_sizes, dims,
            precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class GroupedGemms:
    """One backend's grouped GEMMs (see the module docstring)."""

    rows: Callable[[jax.Array, jax.Array, GroupLayout], jax.Array]
    wgrad: Callable[[jax.Array, jax.Array, GroupLayout], jax.Array]


GROUPED_GEMMS = {
    "emulated": GroupedGemms(emulated_rows, emulated_wgrad),
    "xla": GroupedGemms(xla_rows, xla_wgrad),
}
