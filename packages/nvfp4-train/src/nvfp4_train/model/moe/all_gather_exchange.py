"""Expert parallelism's token exchange by all-gather: every device gathers all T tokens.

`model.moe.dispatch: all_gather`. Inside the expert-parallel `shard_map`
(`model.expert_parallel`), per device:

    all-gather x, expert ids, weights     over the token axes: all T tokens, in order
    dispatch (sort by expert)              of all T tokens, the same on every device
    grouped GEMMs of its experts           on their rows of all T tokens, in a static buffer of
                                           every row they could take (`local_rows`)
    combine (float32, slot order)          [T, D], zero where a slot's expert is elsewhere
    reduce-scatter over the token axes     its own T_l tokens

The transposes are the backward pass: all-gather the output gradient (each expert sees the
gradient of all its rows), reduce-scatter dx. A token's k expert outputs (and input gradients)
are summed across devices by the reduce-scatter, in another way than one device's combine:
last-bit FP32/BF16 differences (measured: dx at top-3; 3 of 131,072 outputs at top-2, 8
experts, d_model 128). Each device moves
O(T d) per block whatever k is (the whole batch), where the all-to-all
(`all_to_all_exchange`) moves O(k T_l d).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nvfp4_train.model.moe.dispatch import Dispatch, combine, dispatch
from nvfp4_train.model.moe.expert_layout import ExpertLayout, ExpertSlice, device_slice


def _gather(x: jax.Array, token_axes: tuple[str, ...]) -> jax.Array:
    """All tokens' rows in global order (the transpose reduce-scatters the gradients: each
    device's are its experts' part)."""
    return jax.lax.all_gather(x, token_axes, tiled=True) if token_axes else x


def _scatter(partial_TxD: jax.Array, token_axes: tuple[str, ...]) -> jax.Array:
    """This device's tokens of the sum over all devices of `partial_TxD` [T, D] (each device's
    experts' part; the transpose all-gathers the output gradient of all T tokens)."""
    if not token_axes:
        return partial_TxD
    return jax.lax.psum_scatter(partial_TxD, token_axes, tiled=True)


def _local_assignments(d: Dispatch, num_experts: int, experts: ExpertSlice, rows: int):
    """(group sizes of this device's experts [count] (0 for another replica's), the positions
    of their rows in the expert order [rows] (past them: the out-of-range index A), whether each
    buffer row is one)."""
    sizes = jax.lax.dynamic_slice_in_dim(d.group_sizes, experts.offset, experts.count)
    sizes = jnp.where(experts.mine, sizes, 0)
    first = experts.offset + jnp.argmax(experts.mine)  # its own experts' rows start there
    start = jnp.sum(jnp.where(jnp.arange(num_experts) < first, d.group_sizes, 0))
    r = jnp.arange(rows, dtype=jnp.int32)
    valid = r < jnp.sum(sizes)
    return sizes, jnp.where(valid, start + r, d.order.shape[0]), valid


def all_gather_experts(layout: ExpertLayout, run_local, x_l, experts_l, weights_l):
    """This device's tokens' float32 output [T_l, D] and its experts' input amax, its experts
    run by `run_local(x_RxD, group_sizes [count]) -> (y_RxD, amax per linear)` (module doc).

    Args:
        layout: the call's `ExpertLayout`.
        run_local: this device's experts on its buffer.
        x_l: its tokens [T_l, D] in the compute dtype.
        experts_l: their experts [T_l, k] (int32), weights_l their combine weights [T_l, k].
    """
    token_axes, k = layout.token_axes, layout.k
    x, experts, weights = (_gather(v, token_axes) for v in (x_l, experts_l, weights_l))
    d = dispatch(experts, num_experts=layout.num_experts, capacity=layout.capacity)
    mine = device_slice(layout)
    sizes, positions, valid = _local_assignments(d, layout.num_experts, mine, layout.rows)
    assignment = d.order[jnp.minimum(positions, d.order.shape[0] - 1)]
    x_RxD = jnp.where(valid[:, None], x[assignment // k], 0).astype(x.dtype)
    y_RxD, amax = run_local(x_RxD, sizes)
    y_AxD = jnp.zeros((d.order.shape[0], y_RxD.shape[1]), y_RxD.dtype)
    y_AxD = y_AxD.at[positions].set(y_RxD, mode="drop")
    return _scatter(combine(y_AxD, weights, d, jnp.float32), token_axes), amax
