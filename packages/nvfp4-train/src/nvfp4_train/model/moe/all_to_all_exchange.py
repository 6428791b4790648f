"""Expert parallelism's token exchange by ragged all-to-all (dropless): each assignment's row
goes to the one device that computes its expert, and its output comes back.

`model.moe.dispatch: all_to_all` (the default). Inside the expert-parallel `shard_map`
(`model.expert_parallel`), per device, with its T_l tokens and A_l = T_l k assignments:

    sort its assignments by expert       token order within an expert (`dispatch`)
    all-gather the counts                int32 [n, E] per device and expert over the token axes
                                         (n devices): every device computes every offset
    capacity (capacity_factor > 0)       an expert keeps the earliest `capacity` assignments of
                                         the global batch: device s keeps clip(capacity - the
                                         earlier devices' count, 0, its count) of them
    ragged all-to-all the rows           [A_l, D] -> [R, D]: one chunk per (device, expert)
    grouped GEMMs of its experts         on [R, D], R = `local_rows` (below)
    ragged all-to-all the outputs back   [R, D] -> [A_l, D], the same chunks reversed
    combine (float32, slot order)        its T_l tokens, as one device's combine

The receiver's buffer is expert-major: for each of its experts, the chunks of the sources in
device order, each source's rows in its token order. The batch is split contiguously over the
token axes, so that is the expert's rows of the global batch in global token order: its tensor
scales, 1x16 Wgrad blocks and stochastic-rounding keys (`group_offset`) are one device's. The
combine and the input gradient's scatter-add run on the token's own device in one device's order
(the local sort keeps the global relative order of a token's k assignments), so a token's k
outputs and input gradients are summed as on one device, bit for bit for any k.

Static buffers (dropless; XLA needs static shapes): the receive buffer is the most rows this
device's `count` experts can take from the T tokens of the batch, R = min(T min(k, count),
count capacity) (`local_rows`, as the all-gather exchange's): a router that sends every token
to one device's experts fits, so nothing is dropped however unbalanced the routing is. A
balanced router fills T k count / E of it (1 / E_l of it with one expert per device:
1/16 for 128 experts over 8 shards); `capacity_factor` > 0 bounds R by count x capacity. Sent per
device and direction: its kept assignments, at most A_l rows of D (the all-gather exchange
receives all T rows): an all-to-all moves less when k < n - 1.

`ragged_all_to_all` is `jax.lax.ragged_all_to_all` on GPUs and an exact emulation on XLA:CPU,
which has none (`model.ragged_all_to_all`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from nvfp4_train.model.moe.dispatch import assignment_counts, combine, dispatch
from nvfp4_train.model.moe.expert_layout import ExpertLayout, expert_table
from nvfp4_train.model.moe.ragged_all_to_all import ragged_all_to_all


def _exclusive_cumsum(x: jax.Array, axis: int) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def kept_counts(counts_NxE: jax.Array, capacity: int) -> jax.Array:
    """int32 [n, E]: the assignments of each device (rows, in token order) to each expert that
    the expert keeps: its earliest `capacity` of the global batch, whose rows the devices hold
    in order.

    Example:
        >>> kept_counts(jnp.array([[3, 1], [2, 4]]), capacity=4).tolist()
        [[3, 1], [1, 3]]
    """
    before = _exclusive_cumsum(counts_NxE, 0)
    return jnp.clip(capacity - before, 0, counts_NxE).astype(jnp.int32)


class _Routes(NamedTuple):
    """Per source s, destination d, slot c of d (d's c-th expert), [n, n, count] int32."""

    rows: jax.Array  # rows s sends to d for that expert (0 for a slot d does not own)
    read: jax.Array  # where they start in s's sorted assignments
    write: jax.Array  # where they start in d's receive buffer


def _routes(layout: ExpertLayout, kept_NxE: jax.Array) -> tuple[_Routes, jax.Array]:
    """Every chunk's rows and offsets (module doc), and each device's group sizes [n, count]."""
    experts_DxC, owned_DxC = expert_table(layout)
    rows = jnp.where(owned_DxC, kept_NxE[:, experts_DxC], 0)  # [s, d, c]
    sizes_DxC = jnp.sum(rows, axis=0)
    base_DxC = _exclusive_cumsum(sizes_DxC, 1)  # where each expert's rows start on d
    write = base_DxC[None] + _exclusive_cumsum(rows, 0)  # sources in device order
    read = _exclusive_cumsum(kept_NxE, 1)[:, experts_DxC]
    return _Routes(rows, read, write), sizes_DxC


def _exchange(operand, output, routes: _Routes, me, *, back: bool, layout: ExpertLayout,
              chunk_rows: int) -> jax.Array:  # fmt: skip
    """The ragged all-to-all of the rows to their experts' devices (`back` False: me as the
    source) or of the outputs back to their tokens' devices (`back`: me as the destination)."""
    rows, read, write = routes
    if back:  # chunk (s, c): my slot c's rows of source s, back where s read them
        chunks = (write[:, me], rows[:, me], read[:, me], rows[me])
    else:  # chunk (d, c): my rows for d's slot c, where d puts them
        chunks = (read[me], rows[me], write[me], rows[:, me])
    flat = (c.reshape(-1).astype(jnp.int32) for c in chunks)
    return ragged_all_to_all(operand, output, *flat, axis_name=layout.token_axes,
                             chunk_rows=chunk_rows)  # fmt: skip


def all_to_all_experts(layout: ExpertLayout, run_local, x_l, experts_l, weights_l):
    """This device's tokens' float32 output [T_l, D] and its experts' input amax, its experts
    run by `run_local(x_RxD, group_sizes [count]) -> (y_RxD, amax per linear)` (module doc).

    Args:
        layout: the call's `ExpertLayout`.
        run_local: this device's experts on its buffer.
        x_l: its tokens [T_l, D] in the compute dtype.
        experts_l: their experts [T_l, k] (int32), weights_l their combine weights [T_l, k].
    """
    tokens, k, num_experts = experts_l.shape[0], layout.k, layout.num_experts
    counts_NxE = jax.lax.all_gather(assignment_counts(experts_l, num_experts), layout.token_axes)
    kept_NxE = kept_counts(counts_NxE, layout.capacity)
    me = jax.lax.axis_index(layout.token_axes)
    d = dispatch(experts_l, num_experts=num_experts, capacity=kept_NxE[me])
    routes, sizes_DxC = _routes(layout, kept_NxE)
    # a source sends an expert at most one row per token
    exchange = dict(me=me, layout=layout, chunk_rows=min(tokens, layout.capacity))
    x_AxD = x_l[d.order // k]
    x_RxD = _exchange(x_AxD, jnp.zeros((layout.rows, x_l.shape[1]), x_l.dtype), routes,
                      back=False, **exchange)  # fmt: skip
    y_RxD, amax = run_local(x_RxD, sizes_DxC[me])
    y_AxD = _exchange(y_RxD, jnp.zeros((tokens * k, y_RxD.shape[1]), y_RxD.dtype), routes,
                      back=True, **exchange)  # fmt: skip
    return combine(y_AxD, weights_l, d, jnp.float32), amax
