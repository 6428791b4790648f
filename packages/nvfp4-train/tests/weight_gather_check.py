"""`precision.gather` modes against "master" on the same mesh, bit for bit: run as a script with 8
fake CPU devices (test_weight_gather.py does); prints one JSON object per mesh: {"mesh": sizes,
"differ": {mode: {what: elements whose bits differ}}, "collectives": {mode: {dtype: all-gathered
bytes}}} (what: the loss, the logits, each parameter's gradient).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python weight_gather_check.py \
        '[{"fsdp": 8}, {"fsdp": 4, "tensor": 2}]'
"""

from __future__ import annotations

import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nvfp4_train.mesh.sharding import (
    BATCH_AXES,
    MeshConfig,
    make_mesh,
    trace_context,
    tree_shardings,
)
from nvfp4_train.model.config import ModelConfig
from nvfp4_train.model.stacking import LayerLayout
from nvfp4_train.precision.policy import PrecisionConfig, layer_recipes
from nvfp4_train.training.step import ModelSpec

MODES = ("master", "compute", "quantized")
CFG = ModelConfig(vocab_size=64, d_model=128, num_layers=3, num_heads=4, num_kv_heads=2,
                  mlp_dim=64, max_seq_len=16)  # fmt: skip
"""d_model 128: 16 per device under fsdp=8; blocks 0 and 2 BF16 by the default rule (they keep
XLA's placement in every mode), block 1 NVFP4."""


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _gathered_bytes(text: str) -> dict[str, int]:
    """{dtype: bytes of every all-gather result} of compiled HLO text (each instruction once)."""
    sizes = {"f32": 4, "bf16": 2, "u8": 1, "f8e4m3fn": 1}
    out: dict[str, int] = {}
    for dtype, dims in re.findall(r"= (\w+)\[([\d,]*)\][^ ]* all-gather(?:-start)?\(", text):
        n = int(np.prod([int(d) for d in dims.split(",") if d]))
        out[dtype] = out.get(dtype, 0) + n * sizes.get(dtype, 0)
    return out


def _step(mode: str, mesh, params, tokens):
    recipes = layer_recipes(CFG, PrecisionConfig(recipe="nvfp4"))
    spec = ModelSpec(CFG, recipes, "emulated", LayerLayout(CFG.num_layers), gather=mode)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: spec.build(nnx.Rngs(params=0))))
    key = jax.random.key(7)

    def loss(p, tokens):
        with trace_context(mesh):
            logits = nnx.merge(graphdef, p)(tokens[:, :-1], key=key)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
        return jnp.mean(ce), logits

    shardings = (tree_shardings(params, params, mesh), NamedSharding(mesh, P(BATCH_AXES)))
    step = jax.jit(jax.value_and_grad(loss, has_aux=True), in_shardings=shardings)
    compiled = step.lower(params, tokens).compile()
    return compiled(params, tokens), _gathered_bytes(compiled.as_text())


def main(meshes: list[dict[str, int]]) -> list[dict]:
    recipes = layer_recipes(CFG, PrecisionConfig(recipe="nvfp4"))
    model = ModelSpec(CFG, recipes, "emulated", LayerLayout(CFG.num_layers)).build(nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model))
    tokens = jax.random.randint(jax.random.key(1), (8, 17), 0, CFG.vocab_size)
    out = []
    for sizes in meshes:
        mesh = make_mesh(MeshConfig(**{"data": 1, **sizes}), jax.devices())
        results = {m: _step(m, mesh, params, tokens) for m in MODES}
        ((loss0, logits0), grads0), _ = results["master"]
        differ = {}
        for mode in MODES[1:]:
            ((loss, logits), grads), _ = results[mode]
            d = {"loss": int(_bits(loss) != _bits(loss0)),
                 "logits": int(np.sum(_bits(logits) != _bits(logits0)))}  # fmt: skip
            for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                                    jax.tree.leaves(grads0), strict=True):  # fmt: skip
                d[jax.tree_util.keystr(path)] = int(np.sum(_bits(a) != _bits(b)))
            differ[mode] = d
        collectives = {m: r[1] for m, r in results.items()}
        out.append({"mesh": sizes, "differ": differ, "collectives": collectives,
                    "loss": float(loss0)})  # fmt: skip
    return out


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
