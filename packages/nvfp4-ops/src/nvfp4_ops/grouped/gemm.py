"""The three GEMMs of a grouped call, per backend: static shapes, batched GEMMs, no loop.

Two shapes of grouped GEMM:
- `rows`: Fprop and Dgrad. lhs tiles [tiles, a, C] (x or dY in the padded buffer), rhs per group
  [E, Q, C]; every row of group e is contracted over C with rhs[e]: out tiles [tiles, a, Q].
- `wgrad`: lhs tiles [tiles, R1, a] and rhs tiles [tiles, R2, a] (x^T, dY^T); each group is
  contracted over its own tokens: out [E, R1, R2].

Nothing here has a data-dependent shape or trip count (no `while`, no `cond`): on XLA:GPU a loop
whose trip count is data copies its predicate to the host on every iteration, and XLA:GPU
rewrites a `ragged_dot` into a masked dense dot over every group unless its output is BF16/F16
and the experimental cuDNN fusion is on (docs/ops.md, "Grouped GEMM"). The machinery, for any
`product`:
- `rows_by_group`: each group's tiles in blocks of m tiles (`blocks`), ONE batched GEMM over the
  blocks with each block's group's rhs (gathered per block): every row computed once, plus at
  most E (m - 1) padding tiles; a one-row group of an alignment-1 recipe once more on its own.
- `by_group`: each group in ONE window from its first tile, zeros after it: the groups sorted
  by size fill slots whose static windows bound the i-th largest group
  (`GroupShape.wgrad_levels`), one batched GEMM per window length: up to ~1.19 tiles H_E of
  work (H_E = 1 + 1/2 + ... + 1/E), the price of one window per group with static shapes.
- `by_block`: each block's partial product (one batched GEMM), summed per group
  (`segment_sum`): < 1.25x the tiles of work, then < 5 E partial results to add.

"emulated" (float32 operands, `operands.decode_*`): FP32 `dot_general`s (precision HIGHEST) of
the form the dense emulated GEMM runs (`gemm.emulated_gemm`: [1, P, C] . [1, Q, C] over the last
axes), batched over blocks (rows) or slots (Wgrad, `by_group`). The result is the dense calls'
bit for bit as long as XLA's FP32 dot gives (i) each output row independently of the other rows,
of how many there are (two or more: one row is a matrix-vector product) and of the batch it is
in, and (ii) the same sum when zeros are appended to a contraction of whole 16-row tiles (not
prepended: a window starts at its group). Both hold for XLA:CPU (checked bit for bit against the
dense calls in tests/test_grouped.py); elsewhere (GPU libraries choose kernels by shape) they are
assumed, untested, and a failure would change the FP32 summation order only.

"xla" (`operands.ScaledOperand`: each element times its block scale, a BF16 number for every
format but MXFP8, and FP32 outer scales): rows in one batched BF16 GEMM with FP32 accumulation
over the blocks (`rows_by_group`), Wgrad in per-block partial GEMMs summed per group
(`by_block`); each output row and column multiplied by its FP32 outer scales afterwards, as the
dense `gemm.xla_gemm` does. XLA lowers a batched `dot_general` to a batched GEMM (cuBLAS on
GPUs, tensor cores for BF16). Equal to "emulated" up to the FP32 summation order and the
rounding of the outer scales (applied to the sums, not to each decoded element). A GEMM with an
operand that is not exact in BF16 (MXFP8, unquantized FP32) runs as an FP32 dot instead, said
once in the log (`_fp32_note`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from nvfp4_ops.backends import log
from nvfp4_ops.grouped.blocks import from_blocks, group_blocks, to_blocks
from nvfp4_ops.grouped.layout import GroupLayout
from nvfp4_ops.grouped.operands import (
    ScaledOperand,
    decode_tokens,
    decode_weights,
    scaled_tokens,
    scaled_weights,
)

_LAST = (((2,), (2,)), ((0,), (0,)))
_MATRIX_LAST = (((1,), (1,)), ((), ()))


def _index(per_group: Any, e) -> Any:
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, e, keepdims=False), per_group)


def rows_by_group(
    lhs_tiles: Any,
    layout: GroupLayout,
    product: Callable[[Any, Any], jax.Array],
    out_tile: tuple[tuple[int, ...], Any],
) -> jax.Array:
    """Out tiles whose rows of group e are `product(rows [L, ...], e)` [L, Q]; `out_tile` =
    (shape of one out tile, dtype); zeros past the groups. `lhs_tiles`: [tiles, a, ...] or a
    pytree of such arrays; `product` runs batched over the blocks (`jax.vmap`).

    XLA computes a one-row dot as a matrix-vector product whose sums may differ from a row of a
    larger dot, so where a one-row group is a one-row product in its dense call
    (`GroupShape.one_row_groups`) its row is computed once more on its own (batched over the
    groups, kept for the groups of one row).
    """
    shape, dtype = out_tile
    blocks = group_blocks(layout)
    m, a = blocks.tiles_per_block, layout.shape.tile_rows
    rows = jax.tree.map(
        lambda b: b.reshape(b.shape[0], m * a, *b.shape[3:]), to_blocks(lhs_tiles, blocks)
    )
    value = jax.vmap(product)(rows, blocks.group).astype(dtype)
    out = from_blocks(value.reshape(value.shape[0], m, *shape), blocks)
    if not layout.shape.one_row_groups:
        return out
    firsts = jax.tree.map(
        lambda t: jnp.take(t, layout.tile_starts, axis=0, mode="fill", fill_value=0)[:, :1],
        lhs_tiles,
    )  # each group's first row [E, 1, ...]
    one_row = jax.vmap(product)(firsts, jnp.arange(layout.shape.groups, dtype=jnp.int32))
    replace = layout.per_tile(layout.sizes == 1, False) & (layout.tile_offset == 0)
    first_rows = jnp.where(replace[:, None], layout.per_tile(one_row[:, 0]), out[:, 0])
    return out.at[:, 0].set(first_rows.astype(dtype))


def tokens_last(tiles: jax.Array) -> jax.Array:
    """Window tiles [L/a, R, a] -> [R, L] (the tokens of the window in order, last)."""
    return jnp.swapaxes(tiles, 0, 1).reshape(tiles.shape[1], -1)


def _windows(tiles: Any, first: jax.Array, count: jax.Array, length: int, past: int) -> Any:
    """[S, length, ...]: `length` tiles of `tiles` [past, ...] from each `first`, zeros past
    each `count`."""
    i = jnp.arange(length, dtype=jnp.int32)
    index = jnp.where(i < count[:, None], first[:, None] + i, past)  # past the buffer: zeros
    return jax.tree.map(lambda t: jnp.take(t, index, axis=0, mode="fill", fill_value=0), tiles)


def by_group(
    lhs_tiles: Any,
    rhs_tiles: Any,
    layout: GroupLayout,
    product: Callable[[Any, Any], jax.Array],
    out: tuple[tuple[int, ...], Any],
) -> jax.Array:
    """[E, ...]: group e's entry is `product(lhs window tiles, rhs window tiles)` over ONE
    window from its first tile, zeros after the group (zeros for an empty group); `out` =
    (shape of one entry, dtype). The windows: `GroupShape.wgrad_levels` (the module
    docstring); `product` runs batched over a level's slots."""
    shape, dtype = out
    counts, groups = layout.tile_counts, layout.shape.groups
    order = jnp.argsort(-counts, stable=True).astype(jnp.int32)  # largest first
    parts, filled = [], 0
    for length, first_slot, end_slot in layout.shape.wgrad_levels:
        slot_groups = order[first_slot:end_slot]
        first, count = layout.tile_starts[slot_groups], counts[slot_groups]
        lhs, rhs = (
            _windows(t, first, count, length, layout.shape.tiles) for t in (lhs_tiles, rhs_tiles)
        )
        parts.append(jax.vmap(product)(lhs, rhs).astype(dtype))
        filled = end_slot
    parts.append(jnp.zeros((groups - filled, *shape), dtype))  # slots of empty groups
    by_slot = jnp.concatenate(parts)
    return jnp.take(by_slot, jnp.argsort(order), axis=0)


def by_block(
    lhs_tiles: Any,
    rhs_tiles: Any,
    layout: GroupLayout,
    product: Callable[[Any, Any], jax.Array],
    out: tuple[tuple[int, ...], Any],
) -> jax.Array:
    """[E, ...]: the sum of `product(lhs block tiles, rhs block tiles)` over group e's blocks
    (zeros for an empty group), in float32, then `out`'s dtype; `out` = (shape, dtype).

    The sum is a `segment_sum` (a scatter-add): on XLA:GPU its order of additions is not fixed
    unless `--xla_gpu_deterministic_ops=true` (as every scatter-add of the model's, docs/moe.md).
    """
    _, dtype = out
    blocks = group_blocks(layout)
    lhs, rhs = to_blocks(lhs_tiles, blocks), to_blocks(rhs_tiles, blocks)
    partial = jax.vmap(product)(lhs, rhs).astype(jnp.float32)
    groups = layout.shape.groups
    summed = jax.ops.segment_sum(
        partial, blocks.group, num_segments=groups + 1, indices_are_sorted=True
    )  # the extra segment: blocks past the last group
    return summed[:groups].astype(dtype)


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


@functools.cache
def _fp32_note(why: str, platform: str) -> None:
    """Say once per process and reason that an "xla" grouped GEMM runs as an FP32 dot: a
    warning on a GPU (where BF16 tensor cores were expected), information elsewhere."""
    level = logging.WARNING if platform == "gpu" else logging.INFO
    log.log(level, "nvfp4_ops: an xla grouped GEMM runs as an FP32 dot, not on BF16 tensor "
            "cores: %s", why)  # fmt: skip


def _matmul(lhs: ScaledOperand, rhs: ScaledOperand) -> Callable[..., jax.Array]:
    """float32 [P, Q] = lhs values [P, C] . rhs values [Q, C]: a BF16 GEMM with FP32
    accumulation when both operands are BF16, else an FP32 dot (said once, `_fp32_note`)."""
    why = "; ".join(w for w in (lhs.inexact, rhs.inexact) if w)
    if why:
        _fp32_note(why, jax.default_backend())
    precision = jax.lax.Precision.HIGHEST if why else jax.lax.Precision.DEFAULT
    dtype = jnp.float32 if why else jnp.bfloat16

    def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
        return jax.lax.dot_general(
            a.astype(dtype), b.astype(dtype), _MATRIX_LAST, precision=precision,
            preferred_element_type=jnp.float32,
        )  # fmt: skip

    return matmul


def xla_rows(lhs_tiles: ScaledOperand, rhs: ScaledOperand, layout: GroupLayout) -> jax.Array:
    """`emulated_rows` as batched BF16 GEMMs over the blocks, outer scales on the output."""
    a, q = layout.shape.tile_rows, rhs.values.shape[1]
    matmul = _matmul(lhs_tiles, rhs)

    def product(rows: ScaledOperand, e):
        w = _index(rhs, e)
        return matmul(rows.values, w.values) * (rows.scale * jnp.swapaxes(w.scale, -1, -2))

    with jax.named_scope("nvfp4/grouped_gemm_xla"):
        return rows_by_group(lhs_tiles, layout, product, ((a, q), jnp.float32))


def xla_wgrad(lhs_tiles: ScaledOperand, rhs_tiles: ScaledOperand, layout: GroupLayout) -> jax.Array:
    """`emulated_wgrad` as per-block BF16 GEMMs summed per group, outer scales per block (one
    per group, or per feature and group: the same on every tile of a group)."""
    matmul = _matmul(lhs_tiles, rhs_tiles)

    def product(lhs: ScaledOperand, rhs: ScaledOperand):
        out = matmul(tokens_last(lhs.values), tokens_last(rhs.values))
        return out * (lhs.scale[0] * jnp.swapaxes(rhs.scale[0], -1, -2))

    shape = (lhs_tiles.values.shape[1], rhs_tiles.values.shape[1])
    with jax.named_scope("nvfp4/grouped_gemm_xla"):
        return by_block(lhs_tiles, rhs_tiles, layout, product, (shape, jnp.float32))


@dataclasses.dataclass(frozen=True)
class GroupedGemms:
    """One backend's grouped GEMMs (see the module docstring), and how it takes its operands:
    `tokens(q, op)` and `weights(q, op, transposed)` turn `operands.quantize_*`'s results into
    what `rows` and `wgrad` contract."""

    rows: Callable[[Any, Any, GroupLayout], jax.Array]
    wgrad: Callable[[Any, Any, GroupLayout], jax.Array]
    tokens: Callable[..., Any] = decode_tokens
    weights: Callable[..., Any] = decode_weights


GROUPED_GEMMS = {
    "emulated": GroupedGemms(emulated_rows, emulated_wgrad),
    "xla": GroupedGemms(xla_rows, xla_wgrad, scaled_tokens, scaled_weights),
}
