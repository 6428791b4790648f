"""GEMM blocks: each group's tiles cut into blocks of m tiles, for batched GEMMs.

A grouped GEMM with static shapes and no loop: group e's tiles (`layout`) are cut into
ceil(count_e / m) blocks of m = `GroupShape.block_tiles` tiles, the last one zero-padded, and
the blocks of all groups sit in one static array of `GroupShape.blocks` blocks (enough for any
group sizes, as the tile buffer is for rows). Every block belongs to one group, so a GEMM over
the blocks is ONE batched `dot_general` with each block's operand from its group (the weight of
its expert, gathered per block): XLA runs that as a batched GEMM (cuBLAS on GPUs), on tensor
cores for BF16 operands, with no data-dependent shape or trip count. Blocks past the last group
belong to group E (none): they read zeros and their results are dropped.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from nvfp4_ops.grouped.layout import GroupLayout


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Blocks:
    """One call's GEMM blocks (arrays traced; `tiles_per_block` static).

    Attributes:
      group: int32 [blocks], each block's group (E past the last group).
      first: int32 [blocks], each block's first tile in the buffer.
      count: int32 [blocks], how many of its tiles are its group's (1..m; 0 past the groups).
      tile_block: int32 [tiles], the block of each tile (`blocks` past the last group).
      tile_slot: int32 [tiles], each tile's index inside its block.
      tiles_per_block: m.
    """

    group: jax.Array
    first: jax.Array
    count: jax.Array
    tile_block: jax.Array
    tile_slot: jax.Array
    tiles_per_block: int = dataclasses.field(metadata={"static": True})


def group_blocks(layout: GroupLayout) -> Blocks:
    """The blocks of `layout`'s groups (module docstring)."""
    shape = layout.shape
    m, n, e = shape.block_tiles, shape.blocks, shape.groups
    per_group = (layout.tile_counts + m - 1) // m
    ends = jnp.cumsum(per_group)
    starts = ends - per_group
    block = jnp.arange(n, dtype=jnp.int32)
    group = jnp.searchsorted(ends, block, side="right", method="scan_unrolled").astype(jnp.int32)
    at_group = lambda a: jnp.take(a, group, mode="fill", fill_value=0)  # noqa: E731
    rank = block - at_group(starts)
    first = at_group(layout.tile_starts) + rank * m
    count = jnp.clip(at_group(layout.tile_counts) - rank * m, 0, m)
    in_group = layout.tile_group < e
    start = jnp.take(starts, layout.tile_group, mode="fill", fill_value=0)
    tile_block = jnp.where(in_group, start + layout.tile_offset // m, n)
    return Blocks(group, first, count, tile_block, layout.tile_offset % m, m)


def to_blocks(tiles, blocks: Blocks):
    """Tiles [tiles, ...] (or a pytree of them) -> [blocks, m, ...]: each block's tiles, zeros
    past its group's."""
    i = jnp.arange(blocks.tiles_per_block, dtype=jnp.int32)
    past = blocks.tile_block.shape[0]  # past the buffer: a zero tile
    index = jnp.where(i < blocks.count[:, None], blocks.first[:, None] + i, past)
    return jax.tree.map(lambda t: jnp.take(t, index, axis=0, mode="fill", fill_value=0), tiles)


def from_blocks(values: jax.Array, blocks: Blocks) -> jax.Array:
    """Block results [blocks, m, ...] -> tiles [tiles, ...] (zeros past the last group)."""
    m = blocks.tiles_per_block
    flat = values.reshape(values.shape[0] * m, *values.shape[2:])
    index = blocks.tile_block * m + blocks.tile_slot  # past the blocks for tiles past the groups
    return jnp.take(flat, index, axis=0, mode="fill", fill_value=0)
