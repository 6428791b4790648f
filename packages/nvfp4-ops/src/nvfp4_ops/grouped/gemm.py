"""The three GEMMs of a grouped call on decoded operands, per backend.

Two shapes of grouped GEMM (operands float32, as the dense GEMMs decode them):
- `rows`: Fprop and Dgrad. lhs tiles [tiles, a, C] (x or dY in the padded buffer), rhs per group
  [E, Q, C]; every row of group e is contracted over C with rhs[e]: out tiles [tiles, a, Q].
- `wgrad`: lhs tiles [tiles, R1, a] and rhs tiles [tiles, R2, a] (x^T, dY^T); each group is
  contracted over its own tokens: out [E, R1, R2].

"emulated": FP32 `dot_general`s (precision HIGHEST) of exactly the form the dense emulated GEMM
runs (`gemm.emulated_gemm`: [1, P, C] . [1, Q, C] over the last axes), in static-length pieces
of the padded buffer, one loop per length (no data-dependent shapes):
- rows: each group's tiles in power-of-two pieces (`row_pieces`): every row computed once
  (`rows_by_group`; a one-row group of an alignment-1 recipe once more as a one-row product);
- Wgrad: each group in ONE window from its first tile (`wgrad_windows`), the shortest of
  `GroupShape.window_tiles` that holds it (<= 1.19x its tokens past 8 tiles), zeros after it.
The result is the dense calls' bit for bit as long as XLA's FP32 dot gives (i) each output row
independently of the other rows and of how many there are (two or more: one row is a
matrix-vector product), and (ii) the same sum when zeros are appended to the contraction (not
prepended: the window starts at the group; for a one-row group of an FP8 or "bf16" recipe, from
1 to 16 terms). Both hold for
XLA:CPU (checked bit for bit against the dense calls in tests/test_grouped.py); elsewhere (GPU
libraries choose kernels by shape) they are assumed, untested, and a failure would change the
FP32 summation order only. Cost: the rows' GEMMs are exactly the groups' rows, Wgrad at most
~1.19x: about one dense call's GEMMs over the T rows, not E of them.

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
    """`tiles` (static) consecutive tiles from tile `first`; the first `count` are the group's."""

    tiles: int
    first: jax.Array
    count: jax.Array

    def take(self, tiles: jax.Array) -> jax.Array:
        """The window's tiles of `tiles` [n, ...]: [self.tiles, ...], zeros past the group
        (also where the window runs past the buffer)."""
        i = jnp.arange(self.tiles, dtype=jnp.int32)
        index = jnp.where(i < self.count, self.first + i, tiles.shape[0])  # past n: zeros
        return jnp.take(tiles, index, axis=0, mode="fill", fill_value=0)


def _each(selected: jax.Array, step: Callable[[Any, Any], Any], carry: Any) -> Any:
    """`carry = step(e, carry)` for the groups e where `selected` [E] holds, in order (a while
    loop with as many trips as there are such groups)."""
    order = jnp.argsort(~selected, stable=True).astype(jnp.int32)
    count = jnp.sum(selected, dtype=jnp.int32)
    return jax.lax.fori_loop(0, count, lambda i, c: step(order[i], c), carry)


def row_pieces(layout: GroupLayout, step: Callable[[Window, Any, Any], Any], init: Any) -> Any:
    """`carry = step(window, e, carry)` over every group's tiles cut into power-of-two pieces
    (its count's binary digits, largest first: 5 tiles -> 4 + 1), one static loop per piece
    length (`GroupShape.piece_tiles`). Every tile of every group is in exactly one piece, and a
    piece never leaves its group (so no masking, no work past the groups)."""
    counts, carry = layout.tile_counts, init
    for length in layout.shape.piece_tiles:
        k = length.bit_length() - 1
        above = (counts >> (k + 1)) << (k + 1)  # the tiles of the larger pieces before it

        def piece(e, c, length=length, above=above):
            window = Window(length, layout.tile_starts[e] + above[e], jnp.int32(length))
            return step(window, e, c)

        carry = _each(((counts >> k) & 1) == 1, piece, carry)
    return carry


def wgrad_windows(layout: GroupLayout, step: Callable[[Window, Any, Any], Any], init: Any) -> Any:
    """`carry = step(window, e, carry)` for every non-empty group, in ONE window from its first
    tile: the shortest of `GroupShape.window_tiles` that holds it (zeros past the group), one
    static loop per window length."""
    lengths = layout.shape.window_tiles
    counts, carry = layout.tile_counts, init
    choice = jnp.searchsorted(jnp.asarray(lengths, jnp.int32), counts)  # shortest >= count
    for j, length in enumerate(lengths):

        def whole(e, c, length=length):
            return step(Window(length, layout.tile_starts[e], counts[e]), e, c)

        carry = _each((choice == j) & (counts > 0), whole, carry)
    return carry


def _index(per_group: jax.Array, e) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(per_group, e, keepdims=False)


def rows_by_group(
    lhs_tiles: jax.Array,
    layout: GroupLayout,
    product: Callable[[jax.Array, Any], jax.Array],
    out_tile: tuple[tuple[int, ...], Any],
) -> jax.Array:
    """Out tiles whose rows of group e are `product(rows [L, C], e)` [L, Q]; `out_tile` = (shape
    of one out tile, dtype); zeros past the groups.

    The rows go in power-of-two pieces of each group (`row_pieces`: every row once, at least 16
    rows a piece). XLA computes a one-row dot as a matrix-vector product whose sums may differ
    from a row of a larger dot, so where a one-row group is a one-row product in its dense call
    (`GroupShape.one_row_groups`) its row is computed once more on its own.
    """
    shape, dtype = out_tile
    a = layout.shape.tile_rows

    def piece(window: Window, e, out):
        rows = jax.lax.dynamic_slice_in_dim(lhs_tiles, window.first, window.tiles, axis=0)
        rows = rows.reshape(window.tiles * a, *rows.shape[2:])
        value = product(rows, e).reshape(window.tiles, *shape).astype(dtype)
        return jax.lax.dynamic_update_slice_in_dim(out, value, window.first, axis=0)

    def one_row(e, out):
        first = layout.tile_starts[e]
        row = jax.lax.dynamic_slice_in_dim(lhs_tiles, first, 1, axis=0)[0, :1]
        value = product(row, e).astype(dtype)  # [1, Q]
        tile = jax.lax.dynamic_index_in_dim(out, first, keepdims=False).at[:1].set(value)
        return jax.lax.dynamic_update_index_in_dim(out, tile, first, 0)

    out = row_pieces(layout, piece, jnp.zeros((layout.shape.tiles, *shape), dtype))
    if layout.shape.one_row_groups:
        out = _each(layout.sizes == 1, one_row, out)
    return out


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
    """[E, ...]: group e's entry is `product(lhs window tiles, rhs window tiles)` over its one
    window (`wgrad_windows`; zeros for an empty group); `out` = (shape of one entry, dtype)."""
    shape, dtype = out

    def step(window: Window, e, acc):
        value = product(window.take(lhs_tiles), window.take(rhs_tiles))
        return jax.lax.dynamic_update_index_in_dim(acc, value.astype(dtype), e, 0)

    return wgrad_windows(layout, step, jnp.zeros((layout.shape.groups, *shape), dtype))


def _fp32_last(a: jax.Array, b: jax.Array) -> jax.Array:
    """The dense emulated GEMM's product: [1, P, C] . [1, Q, C] -> float32 [1, P, Q]."""
    return jax.lax.dot_general(
        a, b, _LAST, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )


def emulated_rows(lhs_tiles: jax.Array, rhs: jax.Array, layout: GroupLayout) -> jax.Array:
    """Fprop / Dgrad: lhs tiles [tiles, a, C] . rhs[e] [Q, C] per group -> [tiles, a, Q]."""
    a, q = layout.shape.tile_rows, rhs.shape[1]

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
    """`emulated_rows` through `jax.lax.ragged_dot_general` (ragged rows, rhs [E, Q, C]).

    The weights of empty groups are zeroed first: XLA:CPU computes the ragged dot as a masked
    dot over all groups (0 * NaN = NaN), so a non-finite weight of an expert with no rows made
    every output non-finite; an empty group has no output rows, its dense call no product."""
    n, a, c = lhs_tiles.shape
    rhs = jnp.where((layout.padded_sizes > 0)[:, None, None], rhs, 0)
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
