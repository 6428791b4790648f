"""`precision.gather` modes against "master" on the same mesh, bit for bit: run as a script with 8
fake CPU devices (test_weight_gather.py does); prints one JSON object per case: {"mesh": sizes,
"scan": bool, "differ": {mode: {what: elements whose bits differ}}, "ulps": {mode: {what: the
largest difference in units of the last place}}, "scaled": {mode: {what: the largest difference
over the largest magnitude of master's}}, "collectives": {mode: {dtype: all-gathered
bytes}}} (what: the loss, the logits, each parameter's gradient). A case is a mesh's sizes, with
`"scan": true` for the 4-block model whose two NVFP4 blocks are stacked and scanned, and
optionally `"modes"`: the modes compared with "master" (default: both).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python weight_gather_check.py \
        '[{"fsdp": 8}, {"fsdp": 4, "tensor": 2, "scan": true, "modes": ["quantized"]}]'
"""

from __future__ import annotations

import dataclasses
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
"""d_model 128: 16 per device under fsdp=8; blocks 0 and 2 BF16 by the default rule, block 1
NVFP4."""
SCANNED = dataclasses.replace(CFG, num_layers=4)
"""Blocks 0 and 3 BF16 by the default rule, blocks 1-2 NVFP4: stored stacked and scanned."""


def _model(scan: bool) -> tuple[ModelConfig, LayerLayout]:
    if scan:
        return SCANNED, LayerLayout(SCANNED.num_layers, ((1, 3),))
    return CFG, LayerLayout(CFG.num_layers)


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


def _ulps(a, b) -> int:
    """The largest difference of a and b (float32 or bfloat16) in units of the last place."""
    ordered = [_bits(x).astype(np.int64) for x in (a, b)]
    sign = 1 << (8 * np.asarray(a).dtype.itemsize - 1)
    ordered = [np.where(x >= sign, sign - x, x) for x in ordered]  # monotone in the value
    return int(np.max(np.abs(ordered[0] - ordered[1]), initial=0))


def _step(mode: str, mesh, params, tokens, scan: bool):
    cfg, layout = _model(scan)
    recipes = layer_recipes(cfg, PrecisionConfig(recipe="nvfp4"))
    spec = ModelSpec(cfg, recipes, "emulated", layout, gather=mode)
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


def _params(scan: bool) -> dict:
    cfg, layout = _model(scan)
    recipes = layer_recipes(cfg, PrecisionConfig(recipe="nvfp4"))
    model = ModelSpec(cfg, recipes, "emulated", layout).build(nnx.Rngs(0))
    return nnx.to_pure_dict(nnx.state(model))


def _scaled(a, b) -> float:
    """max |a - b| / max |b| (0 where b is all zeros and a equals it)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b), initial=0) / max(np.max(np.abs(b), initial=0), 1e-300))


def _compared(results: dict) -> tuple[dict, dict, dict]:
    """{mode: {what: x}} against master: the elements whose bits differ, the largest difference
    in ULPs, and the largest difference over the largest magnitude (`_scaled`)."""
    (master, grads0), _ = results["master"]
    differ, ulps, scaled = {}, {}, {}
    for mode in list(results)[1:]:
        (outputs, grads), _ = results[mode]
        pairs = {"loss": (outputs[0], master[0]), "logits": (outputs[1], master[1])}
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                                jax.tree.leaves(grads0), strict=True):  # fmt: skip
            pairs[jax.tree_util.keystr(path)] = (a, b)
        differ[mode] = {k: int(np.sum(_bits(a) != _bits(b))) for k, (a, b) in pairs.items()}
        ulps[mode] = {k: _ulps(a, b) for k, (a, b) in pairs.items()}
        scaled[mode] = {k: _scaled(a, b) for k, (a, b) in pairs.items()}
    return differ, ulps, scaled


def main(cases: list[dict]) -> list[dict]:
    tokens = jax.random.randint(jax.random.key(1), (8, 17), 0, CFG.vocab_size)
    out = []
    for case in cases:
        sizes = {k: v for k, v in case.items() if k not in ("scan", "modes")}
        scan = bool(case.get("scan", False))
        params = _params(scan)
        mesh = make_mesh(MeshConfig(**{"data": 1, **sizes}), jax.devices())
        modes = ("master", *(m for m in case.get("modes", MODES) if m != "master"))
        results = {m: _step(m, mesh, params, tokens, scan) for m in modes}
        differ, ulps, scaled = _compared(results)
        collectives = {m: r[1] for m, r in results.items()}
        out.append({"mesh": sizes, "scan": scan, "differ": differ, "ulps": ulps, "scaled": scaled,
                    "collectives": collectives})  # fmt: skip
    return out


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
