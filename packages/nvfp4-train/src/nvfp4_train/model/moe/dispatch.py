"""Dropless (or capacity-bounded) dispatch of routed tokens to experts, and the combine back.

The `T * k` assignments of a batch (token t's j-th expert is assignment `t * k + j`) are sorted
by expert, keeping token order inside each expert, so that one grouped GEMM
(`nvfp4_ops.ragged_dot`) runs every expert on its contiguous rows. With a capacity, an expert's
assignments past it (the later tokens) are dropped: they are moved behind every kept row, where
the grouped GEMM gives zeros, and their combine weight is zero. The combine is a gather (no
scatter-add), summing each token's k expert outputs in slot order, so it is deterministic; its
weights' gradient sums over d_model in a fixed order, so a token's bits do not depend on how many
tokens a call combines (expert parallelism combines each device's own).

Example:
    >>> d = dispatch(jnp.array([[1, 0], [1, 2]]), num_experts=3, capacity=4)
    >>> d.order.tolist(), d.group_sizes.tolist()
    ([1, 0, 2, 3], [1, 2, 1])
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Dispatch(NamedTuple):
    """The assignments of a batch in expert order.

    Attributes:
        order: int32 [A]: assignment indices (`t * k + j`) sorted by expert, token order within
            an expert, dropped assignments last.
        group_sizes: int32 [E]: kept assignments per expert (rows of each expert, in order).
        kept: bool [A], in `order`: whether the assignment is within its expert's capacity.
    """

    order: jax.Array
    group_sizes: jax.Array
    kept: jax.Array


def assignment_counts(experts_TxK: jax.Array, num_experts: int) -> jax.Array:
    """int32 [E]: the assignments of `experts_TxK` [T, k] to each expert."""
    return jnp.zeros((num_experts,), jnp.int32).at[experts_TxK.reshape(-1)].add(1)


def dispatch(experts_TxK: jax.Array, *, num_experts: int, capacity: int | jax.Array) -> Dispatch:
    """Sorts the assignments of `experts_TxK` [T, k] by expert; an expert keeps at most
    `capacity` of them (the earliest tokens): one number for all, or int32 [E] per expert."""
    flat_A = experts_TxK.reshape(-1)
    count = flat_A.shape[0]
    order = jnp.argsort(flat_A, stable=True).astype(jnp.int32)
    expert_sorted = flat_A[order]
    counts_E = assignment_counts(flat_A, num_experts)
    starts_E = jnp.cumsum(counts_E) - counts_E
    rank = jnp.arange(count, dtype=jnp.int32) - starts_E[expert_sorted]
    per_expert = not isinstance(capacity, int)
    kept = rank < (capacity[expert_sorted] if per_expert else capacity)
    if per_expert or capacity < count:  # dropped ones behind every kept one, order otherwise kept
        behind = jnp.argsort(jnp.where(kept, expert_sorted, num_experts), stable=True)
        order, kept = order[behind], kept[behind]
    return Dispatch(order, jnp.minimum(counts_E, capacity), kept)


def gather_rows(x_TxD: jax.Array, d: Dispatch, k: int) -> jax.Array:
    """[A, D]: each assignment's token row, in expert order."""
    return x_TxD[d.order // k]


def combine(y_AxD: jax.Array, weights_TxK: jax.Array, d: Dispatch, dtype) -> jax.Array:
    """[T, D] in `dtype`: each token's expert outputs (rows of `y_AxD`, in expert order) times
    their combine weights, summed over its k slots in slot order (float32)."""
    t, k = weights_TxK.shape
    inverse = jnp.zeros_like(d.order).at[d.order].set(jnp.arange(d.order.shape[0], dtype=jnp.int32))
    kept_A = jnp.zeros(d.kept.shape, bool).at[d.order].set(d.kept)
    y_TxKxD = y_AxD[inverse].reshape(t, k, -1).astype(jnp.float32)
    w_TxK = jnp.where(kept_A.reshape(t, k), weights_TxK, 0.0)
    return _slot_sum(y_TxKxD, w_TxK).astype(dtype)


@jax.custom_vjp
def _slot_sum(y_TxKxD: jax.Array, w_TxK: jax.Array) -> jax.Array:
    """[T, D]: sum over the k slots of y * w, in slot order. Backward: dy = ct w (as autodiff's),
    dw = the sum over D of ct y in a fixed pairwise order (`_pairwise_sum`): XLA:CPU's reduce
    adds a row in an order that depends on how many rows there are, so an expert-parallel
    device's T_l tokens would get other bits than one device's T."""
    out = y_TxKxD[:, 0] * w_TxK[:, 0, None]
    for j in range(1, w_TxK.shape[1]):
        out = out + y_TxKxD[:, j] * w_TxK[:, j, None]
    return out


def _slot_sum_bwd(residuals, ct_TxD):
    y_TxKxD, w_TxK = residuals
    return ct_TxD[:, None] * w_TxK[..., None], _pairwise_sum(y_TxKxD * ct_TxD[:, None])


_slot_sum.defvjp(lambda y, w: (_slot_sum(y, w), (y, w)), _slot_sum_bwd)


def _pairwise_sum(x: jax.Array) -> jax.Array:
    """The sum over the last axis by halving (elementwise adds, whose order XLA keeps: the same
    bits for a row whatever the other dimensions are)."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        head = x[..., :half] + x[..., half : 2 * half]
        x = jnp.concatenate([head, x[..., 2 * half :]], axis=-1) if x.shape[-1] % 2 else head
    return x[..., 0]
