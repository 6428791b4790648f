"""The MoE MLP of one block on meshes with an `expert` axis against the same MLP on one device, bit
for bit: run as a script with 8 fake CPU devices (test_expert_parallel.py does), prints a JSON
list, per mesh {"mesh": ..., "differ": {what: number of elements whose bits differ}, "size":
{what: elements}} (what: the output y, its input gradient dx, each parameter's gradient).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python expert_parallel_check.py \
        '[{"fsdp": 2, "expert": 2, "tensor": 2}]'
"""

from __future__ import annotations

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
from nvfp4_train.tree_paths import flat_paths

MOE = MoEConfig(num_experts=4, experts_per_token=2, expert_mlp_dim=32, shared_experts=1,
                capacity_factor=1.5)  # fmt: skip
"""4 experts: on data=2 x expert=4 (or data=4 x expert=2) one expert shard's replicas outnumber
its experts, so some devices compute none."""


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def main(meshes: list[dict[str, int]]) -> list[dict]:
    cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1,
                      mlp_dim=64, max_seq_len=16, moe=MOE)  # fmt: skip
    recipes = dict.fromkeys(linear_paths(cfg), nvfp4_ops.get_recipe("nvfp4"))
    graphdef, state = nnx.split(MoEMLP(cfg, recipes, "layers.0.mlp", rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(state)
    x = jax.random.normal(jax.random.key(1), (8, 16, 32)).astype(jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(2), (8, 16, 32))
    keys = tuple(jax.random.fold_in(jax.random.key(3), i) for i in range(4))

    def loss(p, x):
        y, sown = nnx.capture(nnx.merge(graphdef, p), nnx.Intermediate)(x, keys)
        amax = {k: v for k, v in flat_paths(nnx.to_pure_dict(sown)).items() if "experts" in k}
        return jnp.sum(y.astype(jnp.float32) * dy), (y, amax)

    grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    one_device = jax.jit(grad)(params, x)
    return [_compare(grad, params, x, one_device, sizes) for sizes in meshes]


def _compare(grad, params, x, one_device, mesh_sizes: dict[str, int]) -> dict:
    (_, (y1, amax1)), (dp1, dx1) = one_device
    mesh = make_mesh(MeshConfig(**mesh_sizes), jax.devices())

    def sharded(p, x):
        with trace_context(mesh):
            return grad(p, x)

    shardings = (tree_shardings(params, params, mesh), NamedSharding(mesh, P(BATCH_AXES)))
    (_, (y8, amax8)), (dp8, dx8) = jax.jit(sharded, in_shardings=shardings)(params, x)
    pairs = {"y": (y8, y1), "dx": (dx8, dx1)}
    pairs |= {f"amax {k}": (amax8[k], amax1[k]) for k in amax1}
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(dp8)[0], jax.tree.leaves(dp1), strict=True
    ):
        pairs["d " + ".".join(str(getattr(k, "key", k)) for k in path)] = (a, b)
    return {
        "mesh": dict(mesh.shape),
        "differ": {k: int(np.sum(_bits(a) != _bits(b))) for k, (a, b) in pairs.items()},
        "size": {k: int(np.size(b)) for k, (_, b) in pairs.items()},
    }


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
