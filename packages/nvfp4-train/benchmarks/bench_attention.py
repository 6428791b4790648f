"""Train-step time and compiled memory against sequence length, per attention implementation.

For each `model.attention` that runs here and each length: the whole jitted train step of
`--config` (forward, backward, AdamW) on one row of random tokens packed as documents of about
`--document` tokens (segment ids and positions, so every implementation masks), with
`train.seq_len` and `model.max_seq_len` set to the length. Reported: compile seconds, XLA's
temporary memory of the compiled step (`memory_analysis().temp_size_in_bytes`: activations kept
for the backward pass and scratch, where the [L, L] scores of `naive`/`xla` show), the median step
time over interleaved rounds (every variant once per round, shortest first, so machine load hits
all alike), and model TFLOP/s (`nvfp4_train.model.flops`). Prints a table, writes JSON and (with --md)
Markdown.

    python packages/nvfp4-train/benchmarks/bench_attention.py \
        --md docs/benchmarks/attention.md --out docs/benchmarks/attention.json
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
from nvfp4_train.model.blocks.attention import attention_capability, document_positions
from nvfp4_train.model.flops import train_flops_per_token
from nvfp4_train.training.resume import initial_state, run_train_step

MIB = 2**20


def _batch(length: int, vocab: int, document: int) -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=(1, length + 1), dtype=np.int32)
    ends = rng.random((1, length)) < 1 / document
    segment_ids = jnp.asarray(np.cumsum(ends, axis=1, dtype=np.int32))
    return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
            "segment_ids": segment_ids, "positions": document_positions(segment_ids)}  # fmt: skip


def compile_variant(args, implementation: str, length: int) -> dict:
    """The compiled step, its state and batch, and the compile-time numbers of one variant."""
    cfg = load_config(args.config, [
        f"model.vocab_size={args.vocab}", f"model.attention={implementation}",
        f"model.attention_block={args.block}", f"model.max_seq_len={length}",
        f"train.seq_len={length}", "train.batch_size=1", *args.override,
    ])  # fmt: skip
    graphdef, state = initial_state(cfg)
    batch = _batch(length, args.vocab, args.document)
    t0 = time.perf_counter()
    compiled = (
        jax.jit(run_train_step(cfg, graphdef), donate_argnums=0).lower(state, batch).compile()
    )
    compile_s = time.perf_counter() - t0
    state, metrics = compiled(state, batch)  # the first run allocates; not timed
    jax.block_until_ready(metrics)
    return {
        "compiled": compiled, "state": state, "batch": batch, "times": [],
        "row": {
            "attention": implementation, "seq_len": length, "compile_s": compile_s,
            "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
            "flops_per_token": train_flops_per_token(cfg.model, seq_len=length),
        },
    }  # fmt: skip


def _table(rows: list[dict]) -> str:
    first = {r["attention"]: r for r in rows if r["seq_len"] == min(x["seq_len"] for x in rows)}
    lines = [
        "| attention | seq_len | compile s | temp MiB | temp vs shortest | step ms | model TFLOP/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r["temp_bytes"] / first[r["attention"]]["temp_bytes"]
        lines.append(
            f"| {r['attention']} | {r['seq_len']} | {r['compile_s']:.1f} | "
            f"{r['temp_bytes'] / MIB:.1f} | {ratio:.1f}x | {r['step_s'] * 1e3:.0f} | "
            f"{r['model_tflops']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/configs/tiny.yaml")
    parser.add_argument(
        "--override",
        nargs="*",
        default=["precision.recipe=bf16"],
        help="config overrides (default: BF16 GEMMs, so attention dominates)",
    )
    parser.add_argument("--vocab", type=int, default=257)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--attention", nargs="+", default=["naive", "xla", "chunked", "cudnn"])
    parser.add_argument("--block", type=int, default=512, help="model.attention_block (chunked)")
    parser.add_argument("--document", type=int, default=1024, help="mean document length")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="docs/benchmarks/attention.json")
    parser.add_argument("--md", default=None, help="also write the table as Markdown here")
    args = parser.parse_args(argv)

    here = jax.default_backend()
    runnable = [a for a in args.attention if attention_capability(a, platform=here)[0]]
    skipped = {a: attention_capability(a, platform=here)[1] for a in args.attention
               if a not in runnable}  # fmt: skip
    variants = []  # shortest first in every round: a step after an 8k-token naive one pays for
    for length in args.lengths:  # freeing its ~13 GiB, so no short step may follow one
        for implementation in runnable:
            variants.append(compile_variant(args, implementation, length))
            row = variants[-1]["row"]
            print(f"{implementation:8s} L={length:5d}: compile {row['compile_s']:.1f}s, "
                  f"temp {row['temp_bytes'] / MIB:.1f} MiB", flush=True)  # fmt: skip
    for _ in range(args.rounds):
        for v in variants:
            t = time.perf_counter()
            v["state"], metrics = v["compiled"](v["state"], v["batch"])
            jax.block_until_ready(metrics)
            v["times"].append(time.perf_counter() - t)
    rows = []
    for v in sorted(variants, key=lambda v: runnable.index(v["row"]["attention"])):
        row = v["row"]
        row["step_s"] = statistics.median(v["times"])
        row["model_tflops"] = row["flops_per_token"] * row["seq_len"] / row["step_s"] / 1e12
        rows.append(row)
    table = _table(rows)
    print(table)
    for name, why in skipped.items():
        print(f"not run: {name}: {why}")
    info = {
        "config": args.config, "overrides": args.override, "block": args.block,
        "document": args.document, "rounds": args.rounds, "skipped": skipped,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "jax": jax.__version__, "backend": here},
        "rows": rows,
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(info, indent=1) + "\n")
    if args.md:
        not_run = "".join(f"\n- not run: `{n}`: {why}" for n, why in skipped.items())
        text = (
            "# Attention implementations against sequence length\n\n"
            f"Train step of {args.config} ({' '.join(args.override)}; batch 1, documents of about "
            f"{args.document} tokens masked, attention_block {args.block}) on "
            f"{here} ({os.cpu_count()} CPUs, jax {jax.__version__}); step ms: median of "
            f"{args.rounds} interleaved rounds; temp MiB: XLA's compiled temporary allocation. "
            "Regenerate with `python packages/nvfp4-train/benchmarks/bench_attention.py --md "
            f"docs/benchmarks/attention.md` (JSON: attention.json).{not_run}\n\n{table}"
        )
        Path(args.md).write_text(text)
    print(f"wrote {args.out}" + (f" and {args.md}" if args.md else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
