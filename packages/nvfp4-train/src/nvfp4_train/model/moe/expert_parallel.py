"""Expert parallelism: an MoE block's routed experts on a mesh whose `expert` axis splits them.

The numerics are those of one device: every expert takes ALL the global batch's assignments
routed to it, in token order, with its own global index for the stochastic-rounding keys
(`nvfp4_ops.ragged_dot(..., group_offset=)`), so its per-expert tensor scales, its 1x16 token
blocks for Wgrad and its random bits are the ones a single device computes. That fixes the
dispatch: one explicit `jax.shard_map` over the mesh, an all-gather of the tokens and a
reduce-scatter of the outputs (`docs/distributed.md` has the measured alternative, XLA's SPMD
partitioner over the global dispatch, which gathers every expert's weights to every device).

The `expert` axis splits the experts' weights: a shard of E_l = E / |expert| experts per index.
The devices of one shard in the (data, fsdp) groups are its replicas; they split its experts
(ceil(E_l / |data fsdp|) consecutive experts each, some none when there are more replicas than
experts), so each expert is computed on one device. Forward, per device:

    all-gather x, expert ids, weights          over (data, fsdp, expert): all T tokens, in order
    all-gather its shard's kernels             over `fsdp` (in the compute dtype), its experts
                                               sliced out
    dispatch (sort by expert), as one device   the same on every device
    grouped GEMMs of its experts               on their rows of all T tokens (a static buffer
                                               of every row they could take: `local_rows`)
    combine (float32, slot order)              [T, D], zero where a slot's expert is elsewhere
    reduce-scatter over (data, fsdp, expert)   its own T / |data fsdp expert| tokens

The backward pass is the transposes: all-gather the output gradient (each expert sees the
gradient of all its rows), reduce-scatter dx, reduce-scatter the kernel gradients over `fsdp`
and all-reduce them over `data` (one device's gradient per expert plus zeros: exact). A token's
k expert outputs and input gradients are summed across devices in another order than on one
device: exact for top-2 (a + b either way), FP32/BF16 rounding of the sum beyond.

The shard_map runs with `check_vma=False` (nvfp4_ops' grouped GEMM loops are not typed for
device-varying values); the devices along `tensor` compute the same thing, so two custom
transposes keep their gradients one device's (`_one_copy_gradient`, `_tensor_columns`). The
experts' outputs, input gradients, kernel gradients and input amax equal a single device's bit
for bit (tests/test_expert_parallel.py).

The expert-parallel path is taken when the function is traced under a mesh context
(`jax.sharding.use_abstract_mesh`, which the train and eval steps set from their `mesh`:
`mesh.sharding.trace_context`) whose `expert` axis is > 1; otherwise the caller runs the
global dispatch (`model.dispatch`).

Example (8 devices, data=2 x expert=4):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        logits = model(tokens)   # each MoEMLP calls sharded_routed_experts
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from nvfp4_train.mesh_axes import AXES, EXPERT_AXIS, FSDP_AXIS, TENSOR_AXIS, TOKEN_AXES
from nvfp4_train.model.moe.dispatch import combine, dispatch
from nvfp4_train.model.moe.routing import Routing

ExpertsFn = Callable[..., tuple[jax.Array, tuple[jax.Array, ...]]]
"""`run(x_RxD, group_sizes [El], kernels, keys, group_offset) -> (y_RxD, per-linear amax [El])`:
the routed experts of one device (its kernels [El, ...]; `group_offset` the global index of its
first expert)."""


def expert_mesh() -> AbstractMesh | None:
    """The context mesh when it splits the experts (an `expert` axis > 1), else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get(EXPERT_AXIS, 1) <= 1:
        return None
    return mesh


def local_rows(tokens: int, k: int, local_experts: int, capacity: int) -> int:
    """Rows of one device's grouped-GEMM buffer: the most assignments its `local_experts` can
    take from `tokens` tokens (a token picks k distinct experts; each expert at most
    `capacity`).

    Example:
        >>> local_rows(64, k=2, local_experts=1, capacity=128)
        64
    """
    return min(tokens * min(k, local_experts), local_experts * capacity)


def _split_axes(mesh: AbstractMesh) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the token axes of size > 1, those of them besides `expert`: the replicas of each expert
    shard, which split its experts among them)."""
    tokens = tuple(a for a in TOKEN_AXES if mesh.shape.get(a, 1) > 1)
    return tokens, tuple(a for a in tokens if a != EXPERT_AXIS)


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _one_copy_gradient(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """`x` (forward); backward: the gradient on the first device along `axes`, zero on the
    others (the shard_map sums a replicated input's gradient over them: one copy plus zeros)."""
    return x


_one_copy_gradient.defvjp(
    lambda x, axes: (x, None),
    lambda axes, _, ct: (jnp.where(jax.lax.axis_index(axes) == 0, ct, jnp.zeros_like(ct)),),
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _tensor_columns(x: jax.Array, tensor: int) -> jax.Array:
    """This device's 1/tensor of the columns of [T, D] (forward); backward: all columns' gradient
    gathered (an output replicated over `tensor` would get its gradient divided by it)."""
    cols = x.shape[1] // tensor
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(TENSOR_AXIS) * cols, cols, axis=1)


_tensor_columns.defvjp(
    lambda x, tensor: (_tensor_columns(x, tensor), None),
    lambda tensor, _, ct: (jax.lax.all_gather(ct, TENSOR_AXIS, axis=1, tiled=True),),
)


class _Slice(NamedTuple):
    """The experts one device computes: `count` experts of its shard from `start` (its replica's
    share, clamped into the shard; `mine` masks the ones of another replica's share)."""

    start: jax.Array
    count: int
    mine: jax.Array


def _replica_slice(local: int, count: int, replica_axes: tuple[str, ...]) -> _Slice:
    """The share of this device's replica (its (data, fsdp) index) of the shard's `local`
    experts: `count` (ceil(local / replicas)) consecutive experts each."""
    first = jax.lax.axis_index(replica_axes) * count if replica_axes else jnp.int32(0)
    start = jnp.minimum(first, local - count)
    relative = start + jnp.arange(count)
    return _Slice(start, count, (relative >= first) & (relative < first + count))


def _local_assignments(d, num_experts: int, experts: _Slice, rows: int):
    """(group sizes of this device's experts [count] (0 for another replica's), the global index
    of the first, the positions of their rows in the expert order [rows] (past them: the
    out-of-range index A), whether each buffer row is one)."""
    local = num_experts // jax.lax.axis_size(EXPERT_AXIS)
    offset = jax.lax.axis_index(EXPERT_AXIS) * local + experts.start
    sizes = jax.lax.dynamic_slice_in_dim(d.group_sizes, offset, experts.count)
    sizes = jnp.where(experts.mine, sizes, 0)
    first = offset + jnp.argmax(experts.mine)  # its own experts' rows start there
    start = jnp.sum(jnp.where(jnp.arange(num_experts) < first, d.group_sizes, 0))
    r = jnp.arange(rows, dtype=jnp.int32)
    valid = r < jnp.sum(sizes)
    return sizes, offset, jnp.where(valid, start + r, d.order.shape[0]), valid


def _kernel_spec(shape: tuple[int, ...], fsdp_dim: int, sizes: dict[str, int]) -> P:
    """A kernel [E, ...]'s split: experts over `expert`, its d_model dimension over `fsdp` (as
    `mesh.sharding` stores it) when `fsdp` divides it. The axes of size 1 are named with
    `expert` (an unnamed axis gets a psum of the gradient in the transpose)."""
    spec: list[Any] = [None] * len(shape)
    if sizes[FSDP_AXIS] > 1 and shape[fsdp_dim] % sizes[FSDP_AXIS] == 0:
        spec[fsdp_dim] = FSDP_AXIS
    spec[0] = (EXPERT_AXIS, *(a for a in AXES if sizes[a] == 1 and a not in spec))
    return P(*spec)


def _local_kernel(w_l: jax.Array, spec: P, dtype, experts: _Slice, tensor) -> jax.Array:
    """The kernel of this device's experts in `dtype`: cast, all-gathered over `fsdp` (the
    transpose reduce-scatters the gradient, then cast to float32), its `experts` sliced out."""
    w = w_l.astype(dtype)
    if FSDP_AXIS in tuple(spec):
        w = jax.lax.all_gather(w, FSDP_AXIS, axis=tuple(spec).index(FSDP_AXIS), tiled=True)
    w = jax.lax.dynamic_slice_in_dim(w, experts.start, experts.count)
    return _one_copy_gradient(w, tensor) if tensor else w


def _shard_amax(amax: jax.Array, experts: _Slice, local: int, replica_axes) -> jax.Array:
    """The input amax of the shard's `local` experts [local], from this device's share: the max
    over the replicas (another replica's experts have 0 here: no rows)."""
    full = jax.lax.dynamic_update_slice_in_dim(jnp.zeros((local,), amax.dtype), amax,
                                               experts.start, 0)  # fmt: skip
    full = jax.lax.stop_gradient(full)  # a statistic (pmax has no derivative)
    return jax.lax.pmax(full, replica_axes) if replica_axes else full


def sharded_routed_experts(
    mesh: AbstractMesh,
    x_TxD: jax.Array,
    routing: Routing,
    kernels: tuple[tuple[jax.Array, int], ...],
    keys: tuple[Any, ...],
    run_experts: ExpertsFn,
    *,
    capacity: int,
    dtype: Any,
) -> tuple[jax.Array, tuple[jax.Array, ...]] | None:
    """The routed experts' float32 output [T, D] (each token's weighted sum over its experts,
    before the cast to the compute dtype) and each expert linear's input amax [E], computed
    expert-parallel on `mesh` (see the module doc); None when the T tokens do not split evenly
    over the mesh's token axes (the caller then runs the global dispatch).

    Args:
        mesh: the context mesh (`expert_mesh()`).
        x_TxD: the tokens in the compute dtype, [T, D].
        routing: their routing (`model.routing.route`), computed outside.
        kernels: (kernel [E, ...] in float32, the index of its d_model dimension) of each expert
            linear, in the order `run_experts` takes them.
        keys: the expert linears' stochastic-rounding keys (or None each).
        run_experts: one device's experts (`ExpertsFn`).
        capacity: `moe_config.expert_capacity` of the T tokens.
        dtype: the compute dtype the kernels enter the GEMMs in.
    """
    tokens, k = routing.experts_TxK.shape
    plan = _plan(mesh, tokens, k, kernels, x_TxD.shape[1], capacity, dtype)
    if plan is None:
        return None
    tensor = plan.tensor
    # All mesh axes manual (XLA:CPU crashes promoting a bf16 reduction of a partly manual
    # shard_map), every one named in the token spec even of size 1 (an unnamed one gets a psum
    # of the gradient in the transpose); a tensor axis > 1 splits the output's columns.
    tokens_spec = P(TOKEN_AXES if tensor else (*TOKEN_AXES, TENSOR_AXIS))
    sharded = jax.shard_map(
        functools.partial(_device_experts, plan, run_experts),
        mesh=mesh,
        in_specs=(tokens_spec, tokens_spec, tokens_spec, plan.kernel_specs, P()),
        out_specs=(P(TOKEN_AXES, TENSOR_AXIS) if tensor else tokens_spec, P(EXPERT_AXIS)),
        axis_names=frozenset(AXES),
        check_vma=False,  # nvfp4_ops' grouped GEMM loops are not typed for varying values
    )
    kernel_values = tuple(w for w, _ in kernels)
    return sharded(x_TxD, routing.experts_TxK, routing.weights_TxK, kernel_values, keys)


class _Plan(NamedTuple):
    """The static layout of one expert-parallel call, the same on every device."""

    num_experts: int  # E
    local: int  # the experts of one `expert` shard, E / |expert|
    count: int  # the experts one device computes, ceil(local / replicas)
    rows: int  # its grouped-GEMM buffer rows (`local_rows`)
    k: int  # experts per token
    capacity: int  # `moe_config.expert_capacity` of the T tokens
    dtype: Any  # the compute dtype the kernels enter the GEMMs in
    token_axes: tuple[str, ...]  # `_split_axes`
    replica_axes: tuple[str, ...]
    tensor_size: int  # |tensor|
    kernel_specs: tuple[P, ...]  # `_kernel_spec` of each expert linear's kernel

    @property
    def tensor(self) -> tuple[str, ...]:
        """(`tensor`,) when the tensor axis splits the output's columns, else ()."""
        return (TENSOR_AXIS,) if self.tensor_size > 1 else ()


def _plan(
    mesh: AbstractMesh,
    tokens: int,
    k: int,
    kernels: tuple[tuple[jax.Array, int], ...],
    width: int,
    capacity: int,
    dtype: Any,
) -> _Plan | None:
    """The call's `_Plan` on `mesh`; None when the tokens do not split evenly over the token axes
    or the tensor axis does not divide the width D."""
    num_experts = kernels[0][0].shape[0]
    sizes = {a: mesh.shape.get(a, 1) for a in AXES}
    if tokens % math.prod(sizes[a] for a in TOKEN_AXES) or width % sizes[TENSOR_AXIS]:
        return None
    local = num_experts // sizes[EXPERT_AXIS]
    token_axes, replica_axes = _split_axes(mesh)
    count = -(-local // math.prod(sizes[a] for a in replica_axes))  # experts per device
    return _Plan(
        num_experts=num_experts,
        local=local,
        count=count,
        rows=local_rows(tokens, k, count, capacity),
        k=k,
        capacity=capacity,
        dtype=dtype,
        token_axes=token_axes,
        replica_axes=replica_axes,
        tensor_size=sizes[TENSOR_AXIS],
        kernel_specs=tuple(_kernel_spec(w.shape, dim, sizes) for w, dim in kernels),
    )


def _device_experts(
    plan: _Plan, run_experts: ExpertsFn, x_l, experts_l, weights_l, kernels_l, keys_l
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """One device's part (the shard_map body, the module doc's forward): its tokens' output
    [T_l, D] (its 1/tensor of the columns when the tensor axis splits them) and the input amax of
    its shard's experts."""
    tensor, token_axes, k = plan.tensor, plan.token_axes, plan.k
    if tensor:  # the same tokens on every tensor device: one gradient copy
        x_l, weights_l = (_one_copy_gradient(v, tensor) for v in (x_l, weights_l))
    x, experts, weights = (_gather(v, token_axes) for v in (x_l, experts_l, weights_l))
    mine = _replica_slice(plan.local, plan.count, plan.replica_axes)
    kernels_l = tuple(
        _local_kernel(w, spec, plan.dtype, mine, tensor)
        for w, spec in zip(kernels_l, plan.kernel_specs, strict=True)
    )
    d = dispatch(experts, num_experts=plan.num_experts, capacity=plan.capacity)
    sizes_l, offset, positions, valid = _local_assignments(d, plan.num_experts, mine, plan.rows)
    assignment = d.order[jnp.minimum(positions, d.order.shape[0] - 1)]
    x_RxD = jnp.where(valid[:, None], x[assignment // k], 0).astype(x.dtype)
    y_RxD, amax = run_experts(x_RxD, sizes_l, kernels_l, keys_l, offset)
    amax = tuple(_shard_amax(a, mine, plan.local, plan.replica_axes) for a in amax)
    y_AxD = jnp.zeros((d.order.shape[0], y_RxD.shape[1]), y_RxD.dtype)
    y_AxD = y_AxD.at[positions].set(y_RxD, mode="drop")
    out_l = _scatter(combine(y_AxD, weights, d, jnp.float32), token_axes)
    return (_tensor_columns(out_l, plan.tensor_size) if tensor else out_l), amax
