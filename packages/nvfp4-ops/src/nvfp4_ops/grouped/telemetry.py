"""Quantization statistics of a grouped call, per group: `ragged_operand_stats`.

The statistics of `nvfp4_ops.telemetry` (`STATS`: amax, underflow, saturation, rel_error, with
the same definitions and nonzero-only denominators), computed from the operands the grouped GEMMs
of `ragged_dot` really quantize: the token operands (x, dY and the Wgrad's rotated x^T, dY^T) as
`operands.quantize_tokens` quantizes them in the padded tile buffer (each group's outer scale, each
group's stochastic-rounding numbers, the RHT inside each group's tiles), the weights as
`operands.quantize_weights` quantizes each expert's. Each tile is counted on its own and the
counts are summed over each group's tiles, so group e's numbers are those of
`gemm_operand_stats(x_e, w[e], dY_e, recipe, fold_in(key, e))` on its rows alone (the dense call
`ragged_dot` equals group by group): equal counts and amax; `rel_error` summed in another order
(float32, a few ulps).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from nvfp4_ops.formats import FORMAT_OPS
from nvfp4_ops.gemm_table import OperandQuant, as_key, operand_view, quantizations
from nvfp4_ops.grouped.layout import GroupLayout, GroupShape, group_layout, to_tiles
from nvfp4_ops.grouped.operands import decode_tokens, quantize_tokens
from nvfp4_ops.grouped.random_bits import check_threefry, expert_keys
from nvfp4_ops.recipe import Recipe, as_recipe
from nvfp4_ops.telemetry import _fraction, operand_stats


def ragged_operand_stats(
    x: jax.Array,
    w: jax.Array,
    dy: jax.Array,
    group_sizes: jax.Array,
    recipe: Recipe | str,
    key: jax.Array | None = None,
) -> dict[str, dict[str, jax.Array]]:
    """`operand_stats` of every quantized operand of `ragged_dot(x, w, group_sizes)`, per group.

    Args:
      x: [T, K] activations, rows sorted by group (as `ragged_dot`'s; rows past
        sum(group_sizes) are padding and not counted).
      w: [E, K, N] one weight per group.
      dy: [T, N] the gradient of the output.
      group_sizes: int32 [E] rows per group.
      recipe: a `Recipe` or a preset name.
      key: the key passed to `ragged_dot` (required when the recipe rounds stochastically).

    Returns:
      {role: {stat: float32 [E]}}, roles and stats as `gemm_operand_stats` names them ("bf16"
      roles left out). A group without rows gets 0 for every statistic of its x and dY roles.

    Example:
      >>> x, w, dy = jnp.ones((40, 32)), jnp.ones((3, 32, 16)), jnp.ones((40, 16))
      >>> s = ragged_operand_stats(x, w, dy, jnp.array([20, 0, 16], jnp.int32), "nvfp4-no-sr")
      >>> s["fprop_x"]["amax"].tolist(), s["fprop_w"]["amax"].tolist()
      ([1.0, 0.0, 1.0], [1.0, 1.0, 1.0])
    """
    recipe = as_recipe(recipe)
    _check_shapes(x, w, dy, group_sizes, recipe)
    key = as_key(key, recipe)
    if key is not None and any(
        op.spec.tensor != "w" and op.tq.rounding == "stochastic"
        for op in quantizations(recipe).values()
    ):
        check_threefry(key)
    return _stats(x, w, dy, group_sizes, key, recipe)


@functools.partial(jax.jit, static_argnums=(5,))
def _stats(x, w, dy, group_sizes, key, recipe: Recipe):
    layout = group_layout(group_sizes, GroupShape(x.shape[0], w.shape[0], recipe.alignment))
    keys = expert_keys(key, w.shape[0])
    tiles = {"x": to_tiles(x, layout), "dy": to_tiles(dy.astype(x.dtype), layout)}
    out = {}
    for role, op in quantizations(recipe).items():
        if not op.tq.quantized:
            continue
        with jax.named_scope(f"nvfp4/ragged_telemetry_{role}"):
            if op.spec.tensor == "w":
                out[role] = _weight_stats(op, w, keys[op.key_slot])
            else:
                out[role] = _token_stats(op, tiles[op.spec.tensor], layout, keys)
    return out


def _weight_stats(op: OperandQuant, w: jax.Array, key: jax.Array | None):
    """Each expert's weight viewed as its dense operand [1, ., .] (`quantize_weights`), with
    its group's key."""

    def one(w_kn: jax.Array, k: jax.Array | None):
        return operand_stats(operand_view(op, w_kn[None]), op.tq, k)

    if key is None:
        return jax.vmap(functools.partial(one, k=None))(w)
    return jax.vmap(one)(w, key)


def _token_stats(op: OperandQuant, tiles: jax.Array, layout: GroupLayout, keys):
    """x or dY as tiles, quantized as the grouped GEMM quantizes them; counted per tile, summed
    per group."""
    tq = op.tq
    view = operand_view(op, tiles).astype(jnp.float32)
    q = quantize_tokens(op, tiles, layout, keys)
    decoded = decode_tokens(q, op)
    counts = jax.vmap(lambda v, qt, d: FORMAT_OPS[tq.fmt].counts(v, qt, d, tq))(view, q, decoded)
    underflow, saturated, blocks, elements = (_per_group(c, layout) for c in counts)
    error2 = _per_group(jnp.sum(jnp.square(view - decoded), axis=(1, 2)), layout)
    norm2 = _per_group(jnp.sum(jnp.square(view), axis=(1, 2)), layout)
    tile_amax = jnp.max(jnp.abs(view), axis=(1, 2))
    amax = jax.ops.segment_max(tile_amax, layout.tile_group, num_segments=layout.shape.groups + 1)
    rel_error = jnp.where(norm2 > 0, jnp.sqrt(error2) / jnp.sqrt(jnp.where(norm2 > 0, norm2, 1)), 0)
    return {
        "amax": jnp.maximum(amax[:-1], 0.0),  # an empty group: max over no tiles is -inf
        "underflow": _fraction(underflow, blocks),
        "saturation": _fraction(saturated, elements),
        "rel_error": rel_error.astype(jnp.float32),
    }


def _per_group(per_tile: jax.Array, layout: GroupLayout) -> jax.Array:
    """[E]: the sum over each group's tiles (tiles past the last group dropped)."""
    groups = layout.shape.groups
    return jax.ops.segment_sum(per_tile, layout.tile_group, num_segments=groups + 1)[:groups]


def _check_shapes(x, w, dy, group_sizes, recipe: Recipe) -> None:
    """ValueError / TypeError naming the argument, the expected and the actual value."""
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"x must be [T, K] and w [E, K, N] with the same K, got x {x.shape}, w {w.shape}"
        )
    if dy.shape != (x.shape[0], w.shape[2]):
        raise ValueError(f"dy must be [T, N] = {(x.shape[0], w.shape[2])}, got {dy.shape}")
    if group_sizes.shape != (w.shape[0],) or group_sizes.dtype != jnp.int32:
        raise ValueError(
            f"group_sizes must be int32 [E] = ({w.shape[0]},), got {group_sizes.dtype} "
            f"{group_sizes.shape}"
        )
    a = recipe.alignment
    if x.shape[1] % a or w.shape[2] % a:
        raise ValueError(
            f"K and N must be multiples of {a} (recipe {recipe.name!r}'s alignment, as for "
            f"ragged_dot), got K={x.shape[1]}, N={w.shape[2]}"
        )
