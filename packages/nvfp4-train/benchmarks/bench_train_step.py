"""Train-step cost of the NVFP4 recipes against BF16, as ratios measured in one run.

For each variant: the whole jitted train step of `nvfp4-train` (forward, backward through the
quantized GEMMs, AdamW update) on random tokens, timed in interleaved rounds (variant A, B, C, A,
B, C, ...) so machine load hits all variants alike; the median step time and its ratio to BF16,
plus the compiled step's temporary memory (XLA's memory analysis) and its ratio.

Variants: `bf16`; `nvfp4` with the scaled paper policy (first/last blocks BF16); `nvfp4-all` (every
block linear NVFP4). Prints a table and writes JSON (and a Markdown table with --md).

    python packages/nvfp4-train/benchmarks/bench_train_step.py --config examples/configs/tiny.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_train.config.run_config import load_config
from nvfp4_train.training.resume import initial_state, run_train_step
from nvfp4_train.training.step import count_params, with_vocab_size

VARIANTS = {
    "bf16": ["precision.recipe=bf16"],
    "nvfp4": ["precision.recipe=nvfp4"],
    "nvfp4-all": [
        "precision.recipe=nvfp4",
        "precision.bf16_first_layers=0",
        "precision.bf16_last_layers=0",
    ],
}


def _compiled_step(config: str, overrides: list[str], vocab: int):
    cfg = with_vocab_size(load_config(config, overrides), vocab)
    graphdef, state = initial_state(cfg)
    step = jax.jit(run_train_step(cfg, graphdef), donate_argnums=0)
    b, seq = cfg.train.batch_size, cfg.train.seq_len
    tokens = np.random.default_rng(0).integers(0, vocab, size=(b, seq + 1), dtype=np.int32)
    batch = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}
    compiled = step.lower(state, batch).compile()
    memory = compiled.memory_analysis()
    temp = int(getattr(memory, "temp_size_in_bytes", 0)) if memory is not None else 0
    return cfg, compiled, state, batch, temp


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/configs/tiny.yaml")
    parser.add_argument("--vocab", type=int, default=257)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    parser.add_argument("--out", default="docs/benchmarks/train_step.json")
    parser.add_argument("--md", default="docs/benchmarks/train_step.md")
    parser.add_argument(
        "--override", action="append", default=[], metavar="KEY=VALUE",
        help="a config override for every variant (repeatable), e.g. precision.backend=te",
    )  # fmt: skip
    args = parser.parse_args(argv)

    setups, times = {}, {}
    for name, overrides in VARIANTS.items():
        overrides = [*overrides, *args.override]
        cfg, compiled, state, batch, temp = _compiled_step(args.config, overrides, args.vocab)
        state, _ = compiled(state, batch)  # warm-up
        jax.block_until_ready(state)
        setups[name] = [cfg, compiled, state, batch, temp]
        times[name] = []
    for _ in range(args.rounds):
        for name, setup in setups.items():
            _, compiled, state, batch, _ = setup
            for _ in range(args.steps):
                t0 = time.perf_counter()
                state, metrics = compiled(state, batch)
                jax.block_until_ready(metrics)
                times[name].append(time.perf_counter() - t0)
            setup[2] = state

    base_time = statistics.median(times["bf16"])
    base_temp = setups["bf16"][4] or 1
    cfg0 = setups["bf16"][0]
    rows = []
    for name, (_, _, state, _, temp) in setups.items():
        med = statistics.median(times[name])
        rows.append(
            {
                "variant": name,
                "median_step_s": med,
                "min_step_s": min(times[name]),
                "ratio_to_bf16": med / base_time,
                "temp_bytes": temp,
                "temp_ratio_to_bf16": temp / base_temp,
                "params": count_params(state.params),
            }
        )
    header = "| variant | median step ms | x BF16 | min ms | temp MiB | x BF16 |"
    lines = [header, "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['median_step_s'] * 1e3:.1f} | {r['ratio_to_bf16']:.2f} | "
            f"{r['min_step_s'] * 1e3:.1f} | {r['temp_bytes'] / 2**20:.1f} | "
            f"{r['temp_ratio_to_bf16']:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    result = {
        "config": args.config,
        "model": {
            "num_layers": cfg0.model.num_layers,
            "d_model": cfg0.model.d_model,
            "batch_size": cfg0.train.batch_size,
            "seq_len": cfg0.train.seq_len,
        },
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "overrides": args.override,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "load_average_at_start": os.getloadavg()[0],
        },
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.md:
        note = (
            f"# Train step: NVFP4 recipes vs BF16\n\n`{args.config}` "
            f"({cfg0.model.num_layers} blocks, d_model {cfg0.model.d_model}, batch "
            f"{cfg0.train.batch_size} x {cfg0.train.seq_len}), {args.rounds} interleaved rounds of "
            f"{args.steps} steps, {os.cpu_count()} CPUs, jax {jax.__version__}, load average "
            f"{os.getloadavg()[0]:.1f} at start. Regenerate with "
            f"`python packages/nvfp4-train/benchmarks/bench_train_step.py`.\n\n{table}\n"
        )
        Path(args.md).write_text(note)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
