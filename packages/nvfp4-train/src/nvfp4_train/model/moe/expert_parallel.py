"""Expert parallelism: an MoE block's routed experts on a mesh whose `expert` axis splits them.

The numerics are those of one device: every expert takes ALL the global batch's assignments
routed to it, in token order, with its own global index for the stochastic-rounding keys
(`nvfp4_ops.ragged_dot(..., group_offset=)`), so its per-expert tensor scales, its 1x16 token
blocks for Wgrad and its random bits are the ones a single device computes. That fixes the
dispatch: one explicit `jax.shard_map` over the mesh (`docs/distributed.md` has the measured
alternative, XLA's SPMD partitioner over the global dispatch, which gathers every expert's
weights to every device), with one of two token exchanges (`model.moe.dispatch`):

- `all_to_all` (default, `all_to_all_exchange`): each device sends each of its assignments' rows
  to the device of its expert by a ragged all-to-all (after an all-gather of the per-device,
  per-expert counts) and gets the outputs back the same way: O(k T_l d) per device;
- `all_gather` (`all_gather_exchange`): each device all-gathers all T tokens, runs its experts
  on their rows and reduce-scatters the outputs: O(T d) per device, whatever k.

The `expert` axis splits the experts' weights: a shard of E_l = E / |expert| experts per index;
its replicas in the (data, fsdp) groups split its experts, so each expert is computed on one
device (`expert_layout`). Per device, besides the exchange: all-gather its shard's kernels over
`fsdp` (in the compute dtype) and slice its experts out; backward, reduce-scatter the kernel
gradients over `fsdp` and all-reduce them over `data` (one device's gradient per expert plus
zeros: exact).

The shard_map runs with `check_vma=False` (nvfp4_ops' grouped GEMM loops are not typed for
device-varying values); the devices along `tensor` compute the same thing, so two custom
transposes keep their gradients one device's (`_one_copy_gradient`, `_tensor_columns`). The
experts' outputs, input gradients, routing-weight and kernel gradients and input amax equal a
single device's bit for bit with the all-to-all exchange; the all-gather one sums a token's
outputs and input gradients across devices (last-bit differences; tests/test_expert_parallel.py).

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
from nvfp4_train.model.moe.all_gather_exchange import all_gather_experts
from nvfp4_train.model.moe.all_to_all_exchange import all_to_all_experts
from nvfp4_train.model.moe.expert_layout import (
    ExpertLayout,
    ExpertSlice,
    device_slice,
    local_rows,
)
from nvfp4_train.model.moe.routing import Routing

ExpertsFn = Callable[..., tuple[jax.Array, tuple[jax.Array, ...]]]
"""`run(x_RxD, group_sizes [El], kernels, keys, group_offset) -> (y_RxD, per-linear amax [El])`:
the routed experts of one device (its kernels [El, ...]; `group_offset` the global index of its
first expert)."""

EXCHANGES = {"all_to_all": all_to_all_experts, "all_gather": all_gather_experts}
"""`model.moe.dispatch` -> the token exchange (`all_to_all_exchange`, `all_gather_exchange`)."""


def expert_mesh() -> AbstractMesh | None:
    """The context mesh when it splits the experts (an `expert` axis > 1), else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get(EXPERT_AXIS, 1) <= 1:
        return None
    return mesh


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


def _kernel_spec(shape: tuple[int, ...], fsdp_dim: int, sizes: dict[str, int]) -> P:
    """A kernel [E, ...]'s split: experts over `expert`, its d_model dimension over `fsdp` (as
    `mesh.sharding` stores it) when `fsdp` divides it. The axes of size 1 are named with
    `expert` (an unnamed axis gets a psum of the gradient in the transpose)."""
    spec: list[Any] = [None] * len(shape)
    if sizes[FSDP_AXIS] > 1 and shape[fsdp_dim] % sizes[FSDP_AXIS] == 0:
        spec[fsdp_dim] = FSDP_AXIS
    spec[0] = (EXPERT_AXIS, *(a for a in AXES if sizes[a] == 1 and a not in spec))
    return P(*spec)


def _local_kernel(w_l: jax.Array, spec: P, dtype, experts: ExpertSlice, tensor) -> jax.Array:
    """The kernel of this device's experts in `dtype`: cast, all-gathered over `fsdp` (the
    transpose reduce-scatters the gradient, then cast to float32), its `experts` sliced out."""
    w = w_l.astype(dtype)
    if FSDP_AXIS in tuple(spec):
        w = jax.lax.all_gather(w, FSDP_AXIS, axis=tuple(spec).index(FSDP_AXIS), tiled=True)
    w = jax.lax.dynamic_slice_in_dim(w, experts.start, experts.count)
    return _one_copy_gradient(w, tensor) if tensor else w


def _shard_amax(amax: jax.Array, experts: ExpertSlice, local: int, replica_axes) -> jax.Array:
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
    exchange: str = "all_to_all",
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
        exchange: `model.moe.dispatch`, a key of `EXCHANGES`.
    """
    tokens, k = routing.experts_TxK.shape
    plan = _plan(mesh, tokens, k, kernels, x_TxD.shape[1], capacity, dtype, exchange)
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
    """The static plan of one expert-parallel call, the same on every device."""

    layout: ExpertLayout
    exchange: str  # a key of `EXCHANGES`
    dtype: Any  # the compute dtype the kernels enter the GEMMs in
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
    exchange: str,
) -> _Plan | None:
    """The call's `_Plan` on `mesh`; None when the tokens do not split evenly over the token axes
    or the tensor axis does not divide the width D."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {sorted(EXCHANGES)}, got {exchange!r}")
    num_experts = kernels[0][0].shape[0]
    sizes = {a: mesh.shape.get(a, 1) for a in AXES}
    devices = math.prod(sizes[a] for a in TOKEN_AXES)
    if tokens % devices or width % sizes[TENSOR_AXIS]:
        return None
    local = num_experts // sizes[EXPERT_AXIS]
    token_axes = tuple(a for a in TOKEN_AXES if sizes[a] > 1)
    replica_axes = tuple(a for a in token_axes if a != EXPERT_AXIS)
    count = -(-local // math.prod(sizes[a] for a in replica_axes))  # experts per device
    layout = ExpertLayout(
        num_experts=num_experts, local=local, count=count,
        rows=local_rows(tokens, k, count, capacity), k=k, capacity=capacity,
        token_axes=token_axes, replica_axes=replica_axes, devices=devices,
        shards=sizes[EXPERT_AXIS],
    )  # fmt: skip
    return _Plan(
        layout=layout,
        exchange=exchange,
        dtype=dtype,
        tensor_size=sizes[TENSOR_AXIS],
        kernel_specs=tuple(_kernel_spec(w.shape, dim, sizes) for w, dim in kernels),
    )


def _device_experts(
    plan: _Plan, run_experts: ExpertsFn, x_l, experts_l, weights_l, kernels_l, keys_l
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """One device's part (the shard_map body): its tokens' output [T_l, D] (its 1/tensor of the
    columns when the tensor axis splits them) and the input amax of its shard's experts."""
    tensor, layout = plan.tensor, plan.layout
    if tensor:  # the same tokens on every tensor device: one gradient copy
        x_l, weights_l = (_one_copy_gradient(v, tensor) for v in (x_l, weights_l))
    mine = device_slice(layout)
    kernels_l = tuple(
        _local_kernel(w, spec, plan.dtype, mine, tensor)
        for w, spec in zip(kernels_l, plan.kernel_specs, strict=True)
    )

    def run_local(x_RxD, sizes):
        return run_experts(x_RxD, sizes, kernels_l, keys_l, mine.offset)

    out_l, amax = EXCHANGES[plan.exchange](layout, run_local, x_l, experts_l, weights_l)
    amax = tuple(_shard_amax(a, mine, layout.local, layout.replica_axes) for a in amax)
    return (_tensor_columns(out_l, plan.tensor_size) if tensor else out_l), amax
