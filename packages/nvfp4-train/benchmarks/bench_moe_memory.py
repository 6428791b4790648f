"""`show-config --memory`'s routed-expert buffers of one MoE block against XLA's compiled memory.

For each case (experts per token k, tokens T, recipe): one MoE MLP (`model.moe.layer.MoEMLP`, 8
experts, d_model and expert width 128, emulated backend, one device) differentiated with respect
to its input and parameters under `jax.jit`; XLA's temporary memory of the compiled program
(`memory_analysis().temp_size_in_bytes`: everything its forward and backward allocate beyond
the parameters and the input) against the estimate of one block's routed-expert buffers
(`training.moe_memory.routed_buffers`, the transient `show-config --memory` prints). The ratio
says how far XLA's buffer assignment on this backend is from the estimate; its constancy over k
and T says whether the estimate scales as the program does. Prints a table, writes JSON and
(with --md) Markdown.

    python packages/nvfp4-train/benchmarks/bench_moe_memory.py \
        --md docs/benchmarks/moe_memory.md --out docs/benchmarks/moe_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from nvfp4_train.config.run_config import config_from_dict
from nvfp4_train.model.moe.layer import MoEMLP
from nvfp4_train.precision.policy import layer_recipes
from nvfp4_train.training.moe_memory import routed_buffers

MIB = 2**20
ONE_DEVICE = {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}
CASES = ((2, 1024, "nvfp4"), (4, 1024, "nvfp4"), (8, 1024, "nvfp4"), (2, 4096, "nvfp4"),
         (2, 1024, "bf16"))  # fmt: skip


def _config(k: int, recipe: str, width: int):
    model = {"vocab_size": 256, "d_model": width, "num_layers": 1, "num_heads": 4,
             "num_kv_heads": 2, "mlp_dim": width,
             "moe": {"num_experts": 8, "experts_per_token": k, "expert_mlp_dim": width}}  # fmt: skip
    precision = {"recipe": recipe, "bf16_first_layers": 0, "bf16_last_layers": 0}
    return config_from_dict({"model": model, "precision": precision})


def measure(k: int, tokens: int, recipe: str, width: int = 128) -> dict:
    """XLA's temporary bytes of one MoE MLP's forward and backward, and the estimate."""
    cfg = _config(k, recipe, width)
    recipes = layer_recipes(cfg.model, cfg.precision)
    mlp = MoEMLP(cfg.model, recipes, "layers.0.mlp", rngs=nnx.Rngs(0), backend="emulated")
    graphdef, params = nnx.split(mlp)
    x = jax.random.normal(jax.random.key(1), (tokens // 64, 64, width), jnp.bfloat16)
    keys = tuple(jax.random.fold_in(jax.random.key(3), j) for j in range(4))

    def loss(params, x):
        return jnp.sum(nnx.merge(graphdef, params)(x, keys).astype(jnp.float32) ** 2)

    t0 = time.perf_counter()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
    pair = tuple(recipes[f"layers.0.mlp.experts.{n}"] for n in ("gate_up", "down"))
    buffers = routed_buffers(cfg, pair, ONE_DEVICE, tokens)
    temp = compiled.memory_analysis().temp_size_in_bytes
    return {"k": k, "tokens": tokens, "recipe": recipe, "compile_s": time.perf_counter() - t0,
            "xla_temp_bytes": int(temp), "estimate_bytes": int(sum(buffers.values())),
            "rows": {name: int(v) for name, v in buffers.items()}}  # fmt: skip


def _table(rows: list[dict]) -> str:
    lines = ["| k | tokens | recipe | estimate MiB | XLA temp MiB | XLA / estimate |",
             "|---:|---:|---|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        est, xla = r["estimate_bytes"] / MIB, r["xla_temp_bytes"] / MIB
        lines.append(
            f"| {r['k']} | {r['tokens']} | {r['recipe']} | {est:.2f} | {xla:.2f} | "
            f"{xla / est:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/benchmarks/moe_memory.json")
    parser.add_argument("--md", default=None, help="also write the table as Markdown here")
    args = parser.parse_args(argv)
    rows = []
    for case in CASES:
        rows.append(measure(*case))
        print(f"k={case[0]} T={case[1]} {case[2]}: {rows[-1]['compile_s']:.0f} s", flush=True)
    table = _table(rows)
    print(table)
    info = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "jax": jax.__version__, "backend": jax.default_backend()},
            "rows": rows}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(info, indent=1) + "\n")
    if args.md:
        text = (
            "# One MoE block's routed-expert buffers: estimate against XLA\n\n"
            "One MoE MLP (8 experts, d_model and expert width 128, emulated backend), forward and "
            "backward under `jax.jit` on "
            f"{jax.default_backend()} ({os.cpu_count()} CPUs, jax {jax.__version__}): XLA's "
            "temporary allocation against `moe_memory.routed_buffers` (what `show-config "
            "--memory` prints as the MoE transient). Regenerate with `python packages/nvfp4-train/"
            "benchmarks/bench_moe_memory.py --md docs/benchmarks/moe_memory.md` (JSON: "
            f"moe_memory.json).\n\n{table}"
        )
        Path(args.md).write_text(text)
    print(f"wrote {args.out}" + (f" and {args.md}" if args.md else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
