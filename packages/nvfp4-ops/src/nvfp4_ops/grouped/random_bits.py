"""Stochastic-rounding keys and random numbers of a grouped GEMM: each group's are the ones the
dense call of that group alone draws.

The key split: group e is the dense call `dot_general(x_e, w[e], ..., key=fold_in(key, e))`, so
its per-operand keys are `split_keys(jax.random.fold_in(key, e))` (`expert_keys`). A weight
operand is quantized per group under `jax.vmap`, with its group's key: `sr_uniform` draws there
exactly what the dense call draws.

The token operands (x, dY, and their Wgrad transposes) are quantized for all groups at once, in
the padded buffer. The dense call of group e draws, for an operand of shape [P, Q] (its padded
rows Mp_e included), the bytes of `jax.random.bits(k_e, (P Q / 4,), uint32)`: byte i of the
operand, in row-major order, is byte i % 4 of word i // 4. With jax's default threefry
(`jax_threefry_partitionable=True`), word j is threefry2x32(k_e, (0, j)) with its two outputs
XOR-ed: it depends on j alone, not on the array's length. So each tile of the buffer computes
the words of its own elements from their index in its group's dense operand:

- x, dY (blocks along K or N; [Mp_e, C] per group): row m of the group, word (m C + c) / 4;
- x^T, dY^T (blocks along the tokens; [R, Mp_e] per group): feature r, token m, word
  (r Mp_e + m) / 4,

threefry on explicit counters (`jax.extend.random.threefry2x32_p`), one word per 4 elements as
the dense draw: O(T) work, the same as one dense call. With `jax_threefry_partitionable=False`
word j comes from the counter pair (j, j + n/2) or (j - n/2, j) of the whole draw's n words,
also computed here. Other PRNG implementations (rbg, unsafe_rbg) draw bits that depend on the
draw's shape: a grouped call that rounds a token operand stochastically refuses them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.random import threefry2x32_p

from nvfp4_ops.gemm_table import KEY_SLOTS, split_keys
from nvfp4_ops.grouped.layout import GroupLayout, tile_positions
from nvfp4_ops.quantizers import words_as_uniform

THREEFRY = "threefry2x32"


def expert_keys(
    key: jax.Array | None, groups: int, group_offset: jax.Array | int = 0
) -> dict[str, jax.Array | None]:
    """{key slot: the keys of groups 0..E-1, [E]}: group e's are
    `split_keys(fold_in(key, group_offset + e))` (`group_offset`: the global index of group 0
    when the groups are a slice of all experts).

    Example:
      >>> keys = expert_keys(jax.random.key(0), 3)
      >>> keys["dgrad_dy"].shape
      (3,)
    """
    if key is None:
        return dict.fromkeys(KEY_SLOTS)
    by_group = jax.vmap(lambda e: split_keys(jax.random.fold_in(key, e)))
    offset = jnp.asarray(group_offset).astype(jnp.uint32)
    return by_group(jnp.arange(groups, dtype=jnp.uint32) + offset)


def check_threefry(key: jax.Array) -> None:
    """ValueError unless `key` is a threefry2x32 key (the only implementation whose bits the
    grouped call can reproduce from counters)."""
    impl = str(jax.random.key_impl(key))
    if impl != THREEFRY:
        raise ValueError(
            "ragged_dot rounds token operands stochastically with each group's dense draw, "
            f"rebuilt from threefry counters; key must be a {THREEFRY} key, got a {impl} key"
        )


def token_uniform(
    keys: jax.Array, layout: GroupLayout, tiles_shape: tuple[int, ...], tokens_last: bool
) -> jax.Array:
    """`sr_uniform`'s numbers for a token operand in tiles, each group's being its dense draw.

    Args:
      keys: the operand's key slot for every group, [E] (`expert_keys`).
      layout: the groups.
      tiles_shape: the operand as tiles: [tiles, a, C] (x, dY: blocks along C) or, with
        `tokens_last`, [tiles, R, a] (x^T, dY^T: blocks along the tokens).
      tokens_last: which of the two.
    """
    n, rows, cols = tiles_shape
    if (rows * cols) % 4:
        raise ValueError(f"a tile of {rows}x{cols} elements is not whole 32-bit words")
    data = jax.random.key_data(keys)  # [E, 2] uint32
    data = jnp.concatenate([data, jnp.zeros((1, 2), jnp.uint32)])  # tiles past the last group
    tile_key = jnp.take(data, layout.tile_group, axis=0)[:, None, None, :]  # [tiles, 1, 1, 2]
    a = layout.shape.tile_rows
    offset, padded = (v.astype(jnp.uint32)[:, None, None] for v in tile_positions(layout))
    i, j = (jax.lax.broadcasted_iota(jnp.uint32, (n, rows, cols // 4), d) for d in (1, 2))
    if tokens_last:  # element (r, m): word (r Mp + m) / 4 with m = offset a + 4 j + byte
        counter = (offset * (a // 4) + j) + i * (padded // 4)
        words = padded * (rows // 4)
    else:  # element (m, c): word (m C + c) / 4 with m = offset a + i, c = 4 j + byte
        counter = offset * (a * cols // 4) + (i * (cols // 4) + j)
        words = padded * (cols // 4)
    bits = _threefry_words(tile_key, counter, words)  # uint32: any group below 2^34 elements
    return words_as_uniform(bits, tiles_shape)


def _threefry_words(key: jax.Array, counter: jax.Array, words: jax.Array) -> jax.Array:
    """Word `counter` of `jax.random.bits(key, (words,), uint32)` for threefry key data
    [..., 2]; key and words have counter's rank, with size-1 axes where they are the same
    along counter's (per tile), which threefry broadcasts without materialising them."""
    k1, k2 = key[..., 0], key[..., 1]
    if jax.config.jax_threefry_partitionable:  # word j: threefry(k, (0, j)), outputs XOR-ed
        hi, lo = threefry2x32_p.bind(k1, k2, jnp.zeros_like(counter), counter)
        return hi ^ lo
    half = words // 2  # the whole draw's counters, halved
    low = counter < half
    first = jnp.where(low, counter, counter - half)
    second = jnp.where(low, counter + half, counter)
    out1, out2 = threefry2x32_p.bind(k1, k2, first, second)
    return jnp.where(low, out1, out2)
