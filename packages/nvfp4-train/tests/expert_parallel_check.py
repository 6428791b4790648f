"""The MoE MLP of one block on meshes with an `expert` axis against the same MLP on one device, bit
for bit: run as a script with 8 fake CPU devices (test_expert_parallel.py does), prints a JSON
object: "meshes", per mesh {"mesh": ..., "dispatch": ..., "differ": {what: number of elements
whose bits differ}, "size": {what: elements}, "dx_error": max |dx - dx_1| / max |dx_1|} (what:
the output y, its input gradient dx, the routing weights' gradient, each parameter's gradient,
the experts' input amax), and "ragged_all_to_all": the CPU emulation of
`jax.lax.ragged_all_to_all` on its docstring's example and on a random case against a NumPy
transcription of its documented semantics.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python expert_parallel_check.py \
        '[{"fsdp": 2, "expert": 2, "tensor": 2, "dispatch": "all_gather"}]'
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nvfp4_ops
from nvfp4_train.mesh.sharding import (
    BATCH_AXES,
    MeshConfig,
    make_mesh,
    trace_context,
    tree_shardings,
)
from nvfp4_train.model.config import ModelConfig, linear_paths
from nvfp4_train.model.moe.config import MoEConfig
from nvfp4_train.model.moe.layer import MoEMLP
from nvfp4_train.model.moe.ragged_all_to_all import emulated_ragged_all_to_all
from nvfp4_train.tree_paths import flat_paths

MOE = MoEConfig(num_experts=4, experts_per_token=3, expert_mlp_dim=32, capacity_factor=0.75)
"""4 experts: on data=2 x expert=4 one expert shard's replicas outnumber its experts, so some
devices compute none. Top-3, so that a token's outputs are a sum of more than two terms (the
all-to-all sums them as one device, the all-gather exchange in another order); a capacity of 72
assignments per expert, under a balanced router's 96, so that experts drop some. No shared
expert: it is a dense MLP, outside expert parallelism, and on fsdp=2 x expert=2 x tensor=2 XLA's
partitioning of it gives 5 of its 4096 outputs another last bit than one device (measured), which
made one near-zero element of y differ."""


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _grad(moe: MoEConfig, dy, keys):
    """(value_and_grad of sum(y * dy) over (params, x, an addend of the routing weights [T, k]),
    with y and the experts' input amax as aux; the params) of the MoE MLP of `moe` (the same
    params for every `moe.dispatch`). The addend's gradient is the routing weights' (the
    router kernel's sums it over the batch, in another order on a mesh)."""
    cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1,
                      mlp_dim=64, max_seq_len=16, moe=moe)  # fmt: skip
    recipes = dict.fromkeys(linear_paths(cfg), nvfp4_ops.get_recipe("nvfp4"))
    graphdef, state = nnx.split(MoEMLP(cfg, recipes, "layers.0.mlp", rngs=nnx.Rngs(0)))

    def loss(p, x, addend_TxK):
        model = nnx.merge(graphdef, p)
        router = model.router

        def routed(x_TxD):
            routing = router(x_TxD)
            return routing._replace(weights_TxK=routing.weights_TxK + addend_TxK)

        model.router = routed
        y, sown = nnx.capture(model, nnx.Intermediate)(x, keys)
        amax = {k: v for k, v in flat_paths(nnx.to_pure_dict(sown)).items() if "experts" in k}
        return jnp.sum(y.astype(jnp.float32) * dy), (y, amax)

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    return grad, nnx.to_pure_dict(state)


def main(meshes: list[dict]) -> dict:
    x = jax.random.normal(jax.random.key(1), (8, 16, 32)).astype(jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(2), (8, 16, 32))
    keys = tuple(jax.random.fold_in(jax.random.key(3), i) for i in range(4))
    grad, params = _grad(MOE, dy, keys)
    one_device = jax.jit(grad)(params, x, _no_addend(x))
    results = [_compare(params, x, dy, keys, one_device, dict(m)) for m in meshes]
    return {"meshes": results, "ragged_all_to_all": _emulation_cases()}


def _no_addend(x) -> jax.Array:
    return jnp.zeros((x.shape[0] * x.shape[1], MOE.experts_per_token), jnp.float32)


def _compare(params, x, dy, keys, one_device, mesh_sizes: dict) -> dict:
    (_, (y1, amax1)), (dp1, dx1, dw1) = one_device
    dispatch = mesh_sizes.pop("dispatch", MOE.dispatch)
    mesh = make_mesh(MeshConfig(**mesh_sizes), jax.devices())
    grad, _ = _grad(dataclasses.replace(MOE, dispatch=dispatch), dy, keys)

    def sharded(p, x, addend):
        with trace_context(mesh):
            return grad(p, x, addend)

    shardings = (tree_shardings(params, params, mesh), NamedSharding(mesh, P(BATCH_AXES)),
                 NamedSharding(mesh, P()))  # fmt: skip
    (_, (y8, amax8)), (dp8, dx8, dw8) = jax.jit(sharded, in_shardings=shardings)(params, x,
                                                                             _no_addend(x))  # fmt: skip
    pairs = {"y": (y8, y1), "dx": (dx8, dx1), "d routing weights": (dw8, dw1)}
    pairs |= {f"amax {k}": (amax8[k], amax1[k]) for k in amax1}
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(dp8)[0], jax.tree.leaves(dp1), strict=True
    ):
        pairs["d " + ".".join(str(getattr(k, "key", k)) for k in path)] = (a, b)
    return {
        "mesh": dict(mesh.shape),
        "dispatch": dispatch,
        "differ": {k: int(np.sum(_bits(a) != _bits(b))) for k, (a, b) in pairs.items()},
        "size": {k: int(np.size(b)) for k, (_, b) in pairs.items()},
        "dx_error": float(_error(dx8, dx1)),
    }


def _error(a, b) -> float:
    """max |a - b| over max |b|."""
    a, b = (np.asarray(v, np.float64) for v in (a, b))
    return np.max(np.abs(a - b)) / np.max(np.abs(b))


def _ragged(args: list[np.ndarray], chunk_rows: int) -> np.ndarray:
    """The emulation on len(args[0]) devices: args (operand, output, input_offsets, send_sizes,
    output_offsets, recv_sizes), each stacked over the devices."""
    n = len(args[0])
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("x",))

    def body(*per_device):
        args = (v[0] for v in per_device)
        return emulated_ragged_all_to_all(*args, axis_name=("x",), chunk_rows=chunk_rows)[None]

    run = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    return np.asarray(jax.jit(run)(*(jnp.asarray(a) for a in args)))


def _reference(operand, output, input_offsets, send_sizes, output_offsets) -> np.ndarray:
    """`jax.lax.ragged_all_to_all`'s documented semantics, per device and chunk, in NumPy."""
    n, chunks = input_offsets.shape
    result = output.copy()
    for source in range(n):
        for i in range(chunks):
            rows = operand[source, input_offsets[source, i] :][: send_sizes[source, i]]
            at = output_offsets[source, i]
            result[i // (chunks // n), at : at + len(rows)] = rows
    return result


def _emulation_cases() -> dict:
    """The docstring example's results, and whether a random case (4 devices, 2 chunks to each,
    empty ones, gaps in the output) equals `_reference`."""
    doc = [np.array(v, np.int32) for v in (
        [[1, 2, 2], [3, 4, 0]], [[0] * 4] * 2, [[0, 1]] * 2, [[1, 2], [1, 1]],
        [[0, 0], [1, 2]], [[1, 1], [2, 1]],
    )]  # fmt: skip
    rng = np.random.default_rng(0)
    n, per, rows = 4, 2, 5
    send = rng.integers(0, rows + 1, (n, n * per)).astype(np.int32)  # [source, chunk]
    input_offsets = rng.integers(0, 3, (n, n * per)).astype(np.int32)
    operand = rng.normal(size=(n, rows + 3, 3)).astype(np.float32)
    recv = send.reshape(n, n, per).transpose(1, 0, 2).reshape(n, n * per)  # [dest, (src, c)]
    gaps = rng.integers(0, 2, (n, n * per)).astype(np.int32)
    starts = np.cumsum(recv + gaps, axis=1) - recv  # where each received chunk starts
    output_offsets = starts.reshape(n, n, per).transpose(1, 0, 2).reshape(n, n * per)
    output = rng.normal(size=(n, int(starts[:, -1].max() + rows + 1), 3)).astype(np.float32)
    args = [operand, output, input_offsets, send, output_offsets, recv]
    expected = _reference(operand, output, input_offsets, send, output_offsets)
    return {"doc": _ragged(doc, 2).tolist(),
            "random_equal": bool(np.array_equal(_ragged(args, rows), expected))}  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
