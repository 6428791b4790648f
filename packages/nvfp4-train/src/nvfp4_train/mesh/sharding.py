"""The device mesh and the sharding rules of parameters, optimizer state, batches and activations.

The mesh has four named axes (`mesh_axes.AXES`): `data` (pure data parallelism: parameters
replicated), `fsdp` (data parallelism with parameters and optimizer state sharded), `expert` (the
routed experts of the MoE blocks split along their expert axis; data parallelism everywhere
else), `tensor` (the output features of `attn.qkv` / `mlp.gate_up` / `lm_head` and the input
features of `attn.o` / `mlp.down`). The batch axis is sharded over `("data", "fsdp", "expert")`.
Rules are logical: a dimension that an axis does not divide stays replicated along that axis.
Everything else is JAX's SPMD partitioner (jit with in/out shardings); the one collective written
by hand is the MoE blocks' expert-parallel dispatch (`model.expert_parallel`). The NVFP4
per-tensor amax is `jnp.max` over the GLOBAL array inside jit, so sharded and unsharded runs
compute the same global scale.

Example:
    >>> mesh = make_mesh(MeshConfig(data=-1), jax.devices())
    >>> dict(mesh.shape)
    {'data': 1, 'fsdp': 1, 'expert': 1, 'tensor': 1}
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nvfp4_train.errors import ConfigError
from nvfp4_train.mesh_axes import AXES, EXPERT_AXIS, TOKEN_AXES, fit_axes
from nvfp4_train.model.config import block_kinds
from nvfp4_train.model.stacking import is_stacked
from nvfp4_train.tree_paths import key_names

BATCH_AXES = TOKEN_AXES

# kernel [in, out] rules by the last path component of its module (embedding is [vocab, d_model])
_RULES = {
    "embedding": ("tensor", "fsdp"),
    "qkv": ("fsdp", "tensor"),
    "gate_up": ("fsdp", "tensor"),
    "lm_head": ("fsdp", "tensor"),
    "o": ("tensor", "fsdp"),
    "down": ("tensor", "fsdp"),
    "router": ("fsdp", None),
    "up": ("fsdp", "tensor"),
    "in_proj": ("fsdp", None),
    "out_proj": (None, "fsdp"),
    "fc1_latent_proj": ("fsdp", None),
    "fc2_latent_proj": (None, "fsdp"),
    "eh_proj": ("fsdp", None),
}
# Mamba's in_proj / out_proj: d_model over `fsdp` only (the mixer has no tensor parallelism:
# `check_tensor_split` refuses it); conv1d, A_log, D, dt_bias and the norm are replicated.
# LatentMoE's projections and the MTP input projection: d_model over `fsdp`, never `tensor`
# the routed experts' kernels [E, in, out] (`mlp.experts.{gate_up,up,down}`): experts over `expert`,
# d_model over `fsdp` (as the dense MLP's), the expert's hidden units whole (never `tensor`)
_EXPERT_RULES = {
    "gate_up": (EXPERT_AXIS, "fsdp", None),
    "up": (EXPERT_AXIS, "fsdp", None),
    "down": (EXPERT_AXIS, None, "fsdp"),
}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes; their product is the number of devices (all processes together).

    Attributes:
        data: data-parallel replicas; -1 = all devices the other axes leave.
        fsdp: fully-sharded data parallelism (parameters and optimizer state split); -1 as above.
        tensor: tensor parallelism inside the linears; -1 as above.
        expert: expert parallelism: the routed experts of every MoE block split over this many
            devices (`model.moe.num_experts` a multiple of it), which are data-parallel
            everywhere else; -1 as above.
    """

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1

    def __post_init__(self) -> None:
        sizes = {a: getattr(self, a) for a in AXES}
        for axis, size in sizes.items():
            if size == 0 or size < -1:
                raise ValueError(f"mesh.{axis} must be >= 1 or -1 (all remaining), got {size}")
        if list(sizes.values()).count(-1) > 1:
            raise ValueError(f"at most one mesh axis may be -1, got {sizes}")

    def resolve(self, device_count: int) -> tuple[int, int, int, int]:
        """(data, fsdp, expert, tensor) sizes (`AXES` order) for `device_count` devices.

        Raises:
            ConfigError: the sizes do not multiply to `device_count`.
        """
        sizes = [getattr(self, a) for a in AXES]
        fixed = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if device_count % fixed:
                raise ConfigError(
                    f"mesh: the fixed axes ({fixed} devices) must divide the {device_count} "
                    f"devices, got {dict(zip(AXES, sizes, strict=True))}"
                )
            sizes = [device_count // fixed if s == -1 else s for s in sizes]
        if math.prod(sizes) != device_count:
            raise ConfigError(
                f"mesh: data * fsdp * expert * tensor must equal the {device_count} devices, got "
                f"{dict(zip(AXES, sizes, strict=True))}"
            )
        return tuple(sizes)


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device]) -> Mesh:
    """The `(data, fsdp, expert, tensor)` mesh over `devices` (e.g. `jax.devices()`, all processes).

    Raises:
        ConfigError: `cfg` does not fit `len(devices)` devices (`MeshConfig.resolve`).
    """
    shape = cfg.resolve(len(devices))
    return Mesh(np.asarray(devices).reshape(shape), AXES)


def _fit(spec: Sequence[str | tuple | None], shape: Sequence[int], mesh: Mesh) -> P:
    """`spec` with every axis that does not divide its dimension dropped (that dim replicated)."""
    return P(*fit_axes(spec, shape, dict(mesh.shape)))


def kernel_axes(module: str) -> tuple[str | None, ...] | None:
    """The mesh axes of a linear's kernel [in, out] by the module's name ("qkv", "o", "gate_up",
    "down", "lm_head", ...; what `param_spec` splits it by, before fitting), None for another."""
    rule = _RULES.get(module)
    return None if module in ("embedding", "router") else rule


def param_spec(path: Sequence[str], shape: Sequence[int], mesh: Mesh) -> P:
    """The PartitionSpec of the parameter at `path` (e.g. `("layers", "0", "attn", "qkv",
    "kernel")`); norm scales and unknown leaves are replicated. A routed expert's kernel
    `mlp.experts.*.kernel` [E, in, out] is split along E over `expert` (`_EXPERT_RULES`). A
    stacked block's parameter (`("layers", "1-30", ...)`, or `("layers", "1-30/2", "0", ...)`
    in a repeating group; a leading layer axis) is split like one layer's, never along the
    layer axis."""
    if is_stacked(path) and len(shape) >= 1:
        return P(None, *param_spec(path[-3:], shape[1:], mesh))
    owner = path[-2] if len(path) >= 2 and path[-1] in ("kernel", "embedding") else None
    if path and path[-1] == "embedding":
        owner = "embedding"
    if len(path) >= 3 and path[-3] == "experts" and len(shape) == 3:
        return _fit(_EXPERT_RULES.get(owner, (EXPERT_AXIS, None, None)), shape, mesh)
    rule = _RULES.get(owner) if owner else None
    if rule is None or len(shape) != 2:
        return P()
    return _fit(rule, shape, mesh)


def check_expert_split(num_experts: int, expert: int) -> None:
    """ConfigError unless the `expert` axis divides `num_experts` routed experts (a dense model,
    `num_experts` 0, fits any)."""
    if num_experts and expert > 0 and num_experts % expert:
        raise ConfigError(
            f"model.moe.num_experts={num_experts} must be a multiple of mesh.expert={expert} "
            "(each expert-parallel device holds num_experts / mesh.expert experts)"
        )


def check_tensor_split(model_cfg, tensor: int) -> None:
    """ConfigError when `tensor` > 1 and the model has Mamba blocks: the Mamba-2 mixer has no
    tensor (or sequence) parallelism (its heads would need in_proj split per z/x/B/C/dt part and
    the scan's state kept per head shard); use fsdp or data instead."""
    if tensor > 1 and "mamba" in block_kinds(model_cfg):
        raise ConfigError(
            f"mesh.tensor={tensor}: the Mamba-2 mixer of model.pattern's M blocks has no tensor "
            "parallelism; use mesh.fsdp or mesh.data for these devices"
        )


def tree_shardings(tree: Any, params: Any, mesh: Mesh) -> Any:
    """NamedShardings for `tree` (params, a train state, ...): a leaf whose key path ends with a
    parameter's path and has its shape gets that parameter's spec (so Adam's `mu`/`nu` follow the
    parameters); every other leaf (counters, scalars) is replicated."""
    by_path = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = key_names(key_path)
        by_path[names] = (tuple(leaf.shape), param_spec(names, leaf.shape, mesh))

    def sharding(key_path, leaf) -> NamedSharding:
        names = key_names(key_path)
        for start in range(len(names)):
            match = by_path.get(names[start:])
            if match is not None and match[0] == tuple(getattr(leaf, "shape", ())):
                return NamedSharding(mesh, match[1])
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(sharding, tree)


def batch_sharding(mesh: Mesh, batch_size: int) -> NamedSharding:
    """[batch, length] arrays: rows split over `data` x `fsdp` x `expert` (replicated if they do
    not divide)."""
    return NamedSharding(mesh, _fit((BATCH_AXES, None), (batch_size, 1), mesh))


def logits_sharding(mesh: Mesh, batch_size: int, vocab_size: int) -> NamedSharding:
    """[batch, length, vocab] activations: rows over `data` x `fsdp` x `expert`, vocab over
    `tensor`."""
    return NamedSharding(
        mesh, _fit((BATCH_AXES, None, "tensor"), (batch_size, 1, vocab_size), mesh)
    )


def bytes_per_device(tree: Any) -> int:
    """Bytes of `tree`'s leaves held by ONE device (the first addressable shard of each array)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shards = getattr(leaf, "addressable_shards", None)
        if shards:
            total += shards[0].data.nbytes
        else:
            total += np.asarray(leaf).nbytes
    return total


def shard_state(state: Any, mesh: Mesh) -> tuple[Any, Any]:
    """(state placed on `mesh` by `tree_shardings`, those shardings)."""
    shardings = tree_shardings(state, state.params, mesh)
    return jax.device_put(state, shardings), shardings


def global_batch(batch: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """The whole batch (the same host copy on every process) as global arrays with `sharding`;
    each process transfers only the rows its own devices hold."""
    return {
        k: jax.make_array_from_callback(v.shape, sharding, lambda index, v=v: v[index])
        for k, v in batch.items()
    }


def host_value(x: Any) -> np.ndarray:
    """A NumPy copy of a replicated (or single-process) array, on every process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)


def attention_specs(mesh: Mesh, batch_size: int, num_heads: int, num_kv_heads: int) -> tuple[P, P]:
    """(spec of q, k and v [B, L, heads, head_dim], spec of segment ids [B, L]) for the fused
    attention kernels: rows over data x fsdp x expert (as `batch_sharding`), heads over `tensor` only when
    it divides BOTH head counts, length and head_dim whole. TE's kernel pairs query head h with
    kv head h // (H / G) of the same device and its partition rule keeps the shardings it is
    given (q split over heads with k, v not: wrong pairs, no error); jax's cuDNN rule raises
    unless q, k and v are split alike.

    Example:
        >>> mesh = jax.sharding.AbstractMesh((1, 1, 1, 4), AXES)
        >>> attention_specs(mesh, 8, num_heads=32, num_kv_heads=8)[0]
        P(None, None, 'tensor', None)
    """
    rows = _fit((BATCH_AXES, None), (batch_size, 1), mesh)
    tensor = mesh.shape["tensor"]
    split = tensor > 1 and num_heads % tensor == 0 and num_kv_heads % tensor == 0
    return P(rows[0], None, "tensor" if split else None, None), rows


def attention_heads_note(
    mesh_shape: dict[str, int], num_heads: int, num_kv_heads: int
) -> str | None:
    """A start-up line when `tensor` cannot split attention's heads (every device of a tensor
    group then computes all of them), else None."""
    tensor = mesh_shape.get("tensor", 1)
    if tensor == 1 or (num_heads % tensor == 0 and num_kv_heads % tensor == 0):
        return None
    return (
        f"attention: heads not split over mesh.tensor={tensor} (num_heads={num_heads} and "
        f"num_kv_heads={num_kv_heads} must both be multiples of it): each device of a tensor "
        "group computes every head"
    )


def activation_constraint(mesh: Mesh | None) -> Callable[[str, Any], Any]:
    """`constrain(kind, x)`: `with_sharding_constraint` of a batch ("tokens" [B, L]) or logits
    ("logits" [B, L, V]) activation on `mesh` (rows over data x fsdp x expert, vocab over
    tensor), or of
    a fused attention's operands ("attention": (q, k, v, segment ids or None), laid out by
    `attention_specs`); the identity without a mesh."""

    def constrain(kind: str, x: Any) -> Any:
        if mesh is None:
            return x
        if kind == "tokens":
            return jax.lax.with_sharding_constraint(x, batch_sharding(mesh, x.shape[0]))
        if kind == "attention":
            return _attention_constraint(mesh, *x)
        sharding = logits_sharding(mesh, x.shape[0], x.shape[-1])
        return jax.lax.with_sharding_constraint(x, sharding)

    return constrain


def _attention_constraint(mesh: Mesh, q, k, v, segment_ids):
    heads, rows = attention_specs(mesh, q.shape[0], q.shape[2], k.shape[2])
    q, k, v = (jax.lax.with_sharding_constraint(a, NamedSharding(mesh, heads)) for a in (q, k, v))
    if segment_ids is not None:
        segment_ids = jax.lax.with_sharding_constraint(segment_ids, NamedSharding(mesh, rows))
    return q, k, v, segment_ids


def trace_context(mesh: Mesh | None) -> contextlib.AbstractContextManager:
    """The context a step function is traced in: `mesh` as JAX's abstract mesh
    (`jax.sharding.use_abstract_mesh`), from which the MoE blocks take the `expert` axis of
    their expert-parallel dispatch (`model.expert_parallel`); nothing without a mesh."""
    if mesh is None:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
