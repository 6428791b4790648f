"""Where each group's rows go: the padded, tile-aligned layout of a grouped (MoE) GEMM.

x [T, K] holds the groups' rows back to back, group e in rows starts[e] .. starts[e] + sizes[e];
rows from sum(sizes) on are padding (they give zero output rows and get zero gradients). The
Wgrad operands are blocked along the tokens (1x16 blocks and the 16-point RHT; 1x32 for MXFP4),
and no block may take rows of two groups, so every group is padded with zero rows to a multiple
of the alignment (`Recipe.alignment`: 16, or 32 for MXFP4), as the dense call pads one group.
The padded rows are cut into tiles of `GroupShape.tile_rows` rows (the alignment; 16 for the
recipes without blocks along the tokens, FP8 and "bf16", whose dense calls pad nothing: zero
rows change nothing there and the GEMMs then run on whole tiles): group e holds tiles
tile_starts[e] .. tile_starts[e] + tile_counts[e] of a buffer of `GroupShape.tiles` tiles.
Since sum_e ceil(g_e / a) a <= T + E (a - 1) for tiles of a rows, that static buffer
(floor((T + E (a - 1)) / a) tiles) holds any traced `group_sizes`: at most E (a - 1) rows more
than x, never E x T.

Every array here is traced (group_sizes is a runtime value inside `jax.jit`); only `GroupShape`
(T, E, alignment) is static.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

MIN_TILE_ROWS = 16
"""The fewest rows in a tile (`GroupShape.tile_rows`)."""

BLOCKS_PER_GROUP = 4
"""GEMM blocks per average group (`GroupShape.block_tiles`). A block is m = ceil(tiles / 4E) tiles
of one group, and each group pads its last block, so the blocked GEMMs compute at most E (m - 1)
< tiles / 4 tiles more than the groups hold (~1/8 more for random sizes), on at most
(tiles + E (m - 1)) / m < 5 E blocks, each with its expert's weight gathered (up to 5x the
weights, transient)."""


@dataclasses.dataclass(frozen=True)
class GroupShape:
    """The static side of a grouped GEMM: T tokens, E groups, the recipe's alignment (hashable)."""

    tokens: int
    groups: int
    alignment: int

    @property
    def tile_rows(self) -> int:
        """Rows per tile, a: the alignment, at least `MIN_TILE_ROWS` (FP8 and "bf16" have an
        alignment of 1: their groups are padded to 16 rows here, which changes no result)."""
        return max(self.alignment, MIN_TILE_ROWS)

    @property
    def one_row_groups(self) -> bool:
        """Whether a group of one row is a one-row product in its dense call (alignment 1: the
        dense call pads nothing, and XLA computes a one-row dot as a matrix-vector product)."""
        return self.alignment == 1

    @property
    def tiles(self) -> int:
        """Tiles of the padded buffer: floor((T + E (a - 1)) / a), enough for any group sizes
        (sum_e ceil(g_e / a) is an integer <= (T + E (a - 1)) / a when sum_e g_e <= T)."""
        a = self.tile_rows
        return max(1, (self.tokens + self.groups * (a - 1)) // a)

    @property
    def rows(self) -> int:
        """Rows of the padded buffer (tiles x a)."""
        return self.tiles * self.tile_rows

    @property
    def window_tiles(self) -> tuple[int, ...]:
        """The static window lengths (in tiles) an exact Wgrad rounds its windows up to
        (`wgrad_levels`): ceil(2^(j/4)) for j = 0, 1, ... (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14,
        16, 20, 23, 27, 32, ...) below `tiles`, and `tiles`: at most 2^(1/4) ~ 1.19x a length
        once it is past 8 tiles, exact up to 8."""
        sizes, j = {self.tiles}, 0
        while (size := _ceil_root4(2**j)) < self.tiles:
            sizes.add(size)
            j += 1
        return tuple(sorted(sizes))

    @property
    def wgrad_levels(self) -> tuple[tuple[int, int, int], ...]:
        """(window tiles, first slot, end slot) of the exact Wgrad (`gemm.by_group`).

        The groups sorted by tiles, largest first, take slots 0, 1, ...: the group in slot i
        has at most floor(tiles / (i + 1)) tiles (the i + 1 largest hold at most `tiles`), so
        its window is that bound rounded up to a `window_tiles` length, and consecutive slots
        with the same window form one level (one batched GEMM). Slots whose bound is 0 hold
        empty groups and are in no level. The work is sum_i window_i <= ~1.19 tiles H_E
        (H_E = 1 + 1/2 + ... + 1/E): 2.8x the tiles at E = 8 and T = 2048, 4.3x at E = 32 and
        T = 4096, 5.9x at E = 128 and T = 262,144.
        """
        lengths, levels = self.window_tiles, []
        for slot in range(min(self.groups, self.tiles)):
            bound = self.tiles // (slot + 1)
            window = next(n for n in lengths if n >= bound)
            if levels and levels[-1][0] == window:
                levels[-1] = (window, levels[-1][1], slot + 1)
            else:
                levels.append((window, slot, slot + 1))
        return tuple(levels)

    @property
    def block_tiles(self) -> int:
        """Tiles per GEMM block, m (`blocks.group_blocks`): ceil(tiles / (4 E)), a quarter of
        an average group's tiles rounded up (`BLOCKS_PER_GROUP`)."""
        return -(-self.tiles // (BLOCKS_PER_GROUP * self.groups))

    @property
    def blocks(self) -> int:
        """GEMM blocks of the buffer: floor((tiles + E (m - 1)) / m), enough for any group sizes
        (each group's tiles in ceil(count / m) blocks of m tiles, as tiles hold rows)."""
        m = self.block_tiles
        return max(1, (self.tiles + self.groups * (m - 1)) // m)


def _ceil_root4(n: int) -> int:
    """ceil(n^(1/4)) for an integer n >= 1, exactly."""
    m = max(1, round(n**0.25))
    while m**4 < n:
        m += 1
    while m > 1 and (m - 1) ** 4 >= n:
        m -= 1
    return m


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """One call's groups in the padded buffer (arrays traced; `shape` static).

    Attributes:
      sizes: int32 [E], the rows of each group in x (group_sizes, clipped so that their sum is at
        most T).
      starts: int32 [E], each group's first row in x.
      tile_starts: int32 [E], each group's first tile in the padded buffer.
      tile_counts: int32 [E], ceil(sizes / a): the group's tiles (its padded rows / a).
      tile_group: int32 [tiles], the group of each tile; E for tiles past the last group.
      tile_offset: int32 [tiles], each tile's index inside its group (0 past the last group).
      shape: the static `GroupShape`.
    """

    sizes: jax.Array
    starts: jax.Array
    tile_starts: jax.Array
    tile_counts: jax.Array
    tile_group: jax.Array
    tile_offset: jax.Array
    shape: GroupShape = dataclasses.field(metadata={"static": True})

    def per_tile(self, per_group: jax.Array, fill=0) -> jax.Array:
        """A per-group array [E, ...] read at each tile's group ([tiles, ...]; `fill` past the
        last group)."""
        return jnp.take(per_group, self.tile_group, axis=0, mode="fill", fill_value=fill)

    @property
    def padded_sizes(self) -> jax.Array:
        """int32 [E], each group's rows padded to whole tiles (the dense call's M when the
        alignment is 16 or more)."""
        return self.tile_counts * self.shape.tile_rows


def group_layout(group_sizes: jax.Array, shape: GroupShape) -> GroupLayout:
    """The layout of `group_sizes` (int32 [E], traced) in the padded buffer of `shape`.

    Negative sizes count as 0 and sizes past T rows are cut (lax.ragged_dot leaves such inputs
    unspecified; here no row is read twice and no index leaves x).
    """
    a, n = shape.tile_rows, shape.tiles
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), shape.tokens)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    sizes = ends - starts
    tile_counts = (sizes + a - 1) // a
    tile_ends = jnp.cumsum(tile_counts)
    tile_starts = tile_ends - tile_counts
    tiles = jnp.arange(n, dtype=jnp.int32)
    tile_group = jnp.searchsorted(tile_ends, tiles, side="right", method="scan_unrolled").astype(
        jnp.int32
    )
    first = jnp.take(tile_starts, tile_group, mode="fill", fill_value=0)
    tile_offset = jnp.where(tile_group < shape.groups, tiles - first, 0)
    return GroupLayout(sizes, starts, tile_starts, tile_counts, tile_group, tile_offset, shape)


def to_tiles(x: jax.Array, layout: GroupLayout) -> jax.Array:
    """x [T, C] -> the padded buffer as tiles [tiles, a, C]: each group's rows from its first
    tile on, zeros after them (to its alignment) and in every tile past the last group."""
    shape = layout.shape
    a = shape.tile_rows
    rows = jnp.arange(shape.rows, dtype=jnp.int32)
    tile, within = rows // a, rows % a
    group = layout.tile_group[tile]
    local = layout.tile_offset[tile] * a + within
    valid = local < jnp.take(layout.sizes, group, mode="fill", fill_value=0)
    source = jnp.take(layout.starts, group, mode="fill", fill_value=0) + local
    source = jnp.where(valid, source, shape.tokens)  # out of bounds: a zero row
    out = jnp.take(x, source, axis=0, mode="fill", fill_value=0)
    return out.reshape(shape.tiles, a, *x.shape[1:])


def from_tiles(tiles: jax.Array, layout: GroupLayout) -> jax.Array:
    """The padded buffer [tiles, a, C] -> x's rows [T, C] (zero rows past sum(sizes))."""
    shape = layout.shape
    a = shape.tile_rows
    flat = tiles.reshape(shape.rows, *tiles.shape[2:])
    token = jnp.arange(shape.tokens, dtype=jnp.int32)
    ends = layout.starts + layout.sizes
    group = jnp.searchsorted(ends, token, side="right", method="scan_unrolled").astype(jnp.int32)
    valid = group < shape.groups
    local = token - jnp.take(layout.starts, group, mode="fill", fill_value=0)
    target = jnp.take(layout.tile_starts, group, mode="fill", fill_value=0) * a + local
    target = jnp.where(valid, target, shape.rows)  # out of bounds: a zero row
    return jnp.take(flat, target, axis=0, mode="fill", fill_value=0)


def group_max(per_tile: jax.Array, layout: GroupLayout) -> jax.Array:
    """The maximum over each group's tiles of `per_tile` [tiles, ...], read back at every tile
    (the maximum is exact, so a group's amax is the dense call's amax of that group)."""
    groups = jax.ops.segment_max(
        per_tile, layout.tile_group, num_segments=layout.shape.groups + 1
    )  # the extra segment: tiles past the last group (zeros)
    return jnp.take(groups, layout.tile_group, axis=0)


def tile_positions(layout: GroupLayout) -> tuple[jax.Array, jax.Array]:
    """(each tile's index inside its group, its group's padded rows), int32 [tiles] each."""
    padded = layout.per_tile(layout.padded_sizes)
    return layout.tile_offset, padded
