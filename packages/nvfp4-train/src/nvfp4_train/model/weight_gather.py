"""What a linear's kernel travels as when FSDP gathers it (`precision.gather`).

Under FSDP (`mesh.fsdp` > 1) every device holds a slice of each float32 master kernel and the
product needs the whole of it (along `fsdp`; a `tensor` split stays). Three modes:

- "master": the float32 kernel is cast to the compute dtype inside the step and XLA's SPMD
  partitioner places the gather (on XLA:CPU and, unless a pass moves the cast, on GPUs: the
  float32 master travels, 4 bytes per element).
- "compute": each device casts its slice to the compute dtype and an explicit all-gather moves
  that (2 bytes per element for BF16).
- "quantized": each device quantizes its slice of the kernel with the recipe's 16x16 weight tiles,
  the tensor scale from the GLOBAL amax (one max-reduction of a scalar over the devices holding
  slices), and an explicit all-gather moves the packed FP4 codes (uint8, 2 per byte) and the E4M3
  tile scales (0.5625 bytes per element); Fprop and Dgrad read the gathered codes
  (`nvfp4_ops.prequantized_dot_general`). Quantized linears whose recipe cannot use a quantized
  weight (a BF16 Fprop phase, 1x16 weight blocks: `nvfp4_ops.prequantized_unsupported`) gather
  as "compute".

Unquantized (BF16-policy) linears gather as "compute" under "compute" and "quantized" (there is
nothing to quantize): the gathered BF16 slices are the BF16 cast of the gathered float32 kernel
element by element (a cast commutes with a gather), and the product is the same expression. What
differs is that "master" leaves XLA's partitioner free to not gather the kernel: it may split the
contraction over `fsdp` and all-reduce float32 partial products (another summation order; the
loss then moves in the 6th digit), or lay the activations around the layer out otherwise (a
reduction behind it summed in another order). Measured in docs/distributed.md; the quantized
linears' products, custom_vjps, are the same bits in every mode.

Both explicit gathers run in a `jax.shard_map` over the context mesh (`mesh.sharding.
trace_context`) on a `stop_gradient` of the kernel; the kernel's gradient bypasses them: the
product is a custom_vjp whose weight cotangent goes to the local cast (the recipe's Wgrad, from x
and dY: `nvfp4_ops.prequantized_dot_general`, `product_with_gathered`), so XLA reduces it onto
the kernel's slices as in "master".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import nvfp4_format
import nvfp4_ops
from nvfp4_train.errors import ConfigError
from nvfp4_train.mesh_axes import AXES, FSDP_AXIS, fit_axes

GATHER_MODES = ("master", "compute", "quantized")
TILE = 16


@dataclasses.dataclass(frozen=True)
class GatherPlan:
    """How one kernel [K, N] is split on the context mesh, and what the gather keeps split.

    Attributes:
        mesh: the context mesh (abstract).
        spec: the kernel's PartitionSpec entries (K, N).
        gathered: the same with `fsdp` removed (what the product reads).
        fsdp_dim: the kernel dimension `fsdp` splits (0: K, 1: N).
    """

    mesh: jax.sharding.AbstractMesh
    spec: tuple
    gathered: tuple
    fsdp_dim: int


def _names(entry) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def gather_plan(axes: tuple | None, shape: tuple[int, int]) -> GatherPlan | None:
    """The plan of a kernel with mesh `axes` (`mesh.sharding.kernel_axes`) on the context mesh,
    or None when nothing gathers it along `fsdp` (no mesh, `fsdp` 1, or not dividing)."""
    mesh = jax.sharding.get_abstract_mesh()
    if axes is None or mesh.empty or mesh.shape.get(FSDP_AXIS, 1) <= 1:
        return None
    spec = fit_axes(axes, shape, dict(mesh.shape))
    dims = [d for d, entry in enumerate(spec) if FSDP_AXIS in _names(entry)]
    if not dims:
        return None
    gathered = tuple(
        None if FSDP_AXIS in _names(e) and len(_names(e)) == 1
        else tuple(a for a in _names(e) if a != FSDP_AXIS) or None
        for e in spec
    )  # fmt: skip
    return GatherPlan(mesh, spec, gathered, dims[0])


def check_tiles(plan: GatherPlan, shape: tuple[int, int], what: str) -> None:
    """ConfigError unless every slice of the kernel is whole 16x16 tiles (each split dimension's
    slice, and each whole dimension, a multiple of 16)."""
    for dim, (size, entry) in enumerate(zip(shape, plan.spec, strict=True)):
        parts = 1
        for name in _names(entry):
            parts *= plan.mesh.shape[name]
        if (size // parts) % TILE:
            split = f" split {parts} ways over {_names(entry)}" if parts > 1 else ""
            raise ConfigError(
                f"precision.gather=quantized: {what} {tuple(shape)} dimension {dim} "
                f"({size}{split}) gives slices of {size // parts}, not a multiple of {TILE} "
                "(each device quantizes its slice in 16x16 tiles); use precision.gather=compute "
                "or a mesh whose slices are multiples of 16"
            )


def mode_for(gather: str, recipe: nvfp4_ops.Recipe) -> str:
    """The mode a linear of `recipe` gathers in under `precision.gather=gather`: an unquantized
    linear as "compute" under "quantized" (nothing to quantize; see the module docstring), and
    so does a quantized recipe that cannot use a quantized weight."""
    if not recipe.quantized:
        return "master" if gather == "master" else "compute"
    if gather == "quantized" and nvfp4_ops.prequantized_unsupported(recipe) is not None:
        return "compute"
    return gather


def linear_product(x, w, key, recipe: nvfp4_ops.Recipe, backend) -> jax.Array:
    """x [..., K] @ w [K, N] through `nvfp4_ops.dot_general` with `recipe`, float32 out."""
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    return nvfp4_ops.dot_general(
        x, w, dims, preferred_element_type=jnp.float32, recipe=recipe, key=key, backend=backend
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def product_with_gathered(x, w, gathered, key, recipe: nvfp4_ops.Recipe, backend) -> jax.Array:
    """`linear_product(x, gathered, ...)` whose weight gradient is `w`'s (`gathered`: the whole
    of `w`, computed from a stop_gradient of it, `gather_compute`).

    The backward pass is `jax.vjp` of the same product, with its weight cotangent handed to `w`:
    the weight gradient is the same expression of x and dY as without the gather, and XLA reduces
    it onto the kernel's slices where it does without one (the same bits)."""
    del w
    return linear_product(x, gathered, key, recipe, backend)


def _product_fwd(x, w, gathered, key, recipe, backend):
    del w
    return linear_product(x, gathered, key, recipe, backend), (x, gathered, key)


def _product_bwd(recipe, backend, residuals, ct):
    x, gathered, key = residuals
    _, vjp = jax.vjp(lambda x, w: linear_product(x, w, key, recipe, backend), x, gathered)
    dx, dw = vjp(ct)
    return dx, dw, None, None


product_with_gathered.defvjp(_product_fwd, _product_bwd)


def _shard_map(plan: GatherPlan, body, out_specs):
    return jax.shard_map(
        body, mesh=plan.mesh, in_specs=P(*plan.spec), out_specs=out_specs,
        axis_names=frozenset(AXES), check_vma=False,
    )  # fmt: skip


def gather_compute(w_KxN: jax.Array, plan: GatherPlan) -> jax.Array:
    """The kernel (already in the compute dtype, split per `plan.spec`) gathered along `fsdp`
    in that dtype, without a gradient (`product_with_gathered` gives `w_KxN` one)."""
    body = functools.partial(
        jax.lax.all_gather, axis_name=FSDP_AXIS, axis=plan.fsdp_dim, tiled=True
    )
    return _shard_map(plan, body, P(*plan.gathered))(jax.lax.stop_gradient(w_KxN))


def gather_quantized(w_KxN: jax.Array, plan: GatherPlan, recipe: nvfp4_ops.Recipe):
    """`nvfp4_ops.quantize_weight(w_KxN, recipe)` computed slice by slice (each device its own,
    the tensor scale from the max over all slices) and gathered along `fsdp` as packed codes and
    tile scales: an `NVFP4Array` of w^T [1, N, K], split along `plan.gathered` (transposed)."""
    split_axes = tuple(a for e in plan.spec for a in _names(e))
    along = 2 if plan.fsdp_dim == 0 else 1  # w^T [1, N, K]: K is the last axis

    def body(w_local):
        amax = jax.lax.pmax(nvfp4_ops.weight_amax(w_local), split_axes)
        q = nvfp4_ops.quantize_weight(w_local, recipe, amax=amax)
        gather = functools.partial(jax.lax.all_gather, axis_name=FSDP_AXIS, axis=along, tiled=True)
        return gather(q.packed), gather(q.block_scales), q.global_scale

    k_axes, n_axes = plan.gathered
    pieces = P(None, n_axes, k_axes)
    packed, scales, global_scale = _shard_map(plan, body, (pieces, pieces, P()))(
        jax.lax.stop_gradient(w_KxN)
    )
    k, n = w_KxN.shape
    return nvfp4_format.NVFP4Array(packed, scales, global_scale, (1, n, k), (TILE, TILE))
