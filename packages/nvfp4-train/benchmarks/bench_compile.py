"""Compile time and compiled memory against depth, with and without scanned layers and remat.

For each depth (blocks) and `model.scan_layers` setting: the seconds to initialise the state
(jit of `init_state`, compile included), to trace and lower the train step, and to compile it,
plus XLA's memory analysis of the compiled step (temporary bytes: activations saved for the
backward pass and scratch). Then, at one depth with scanned layers, every `model.remat` policy:
temporary bytes and the median step time. The model is `--config` (tiny.yaml: d_model 64,
NVFP4 with the scaled paper policy) with `model.num_layers` set; tokens are random. Each number
is one measurement (compiles take minutes; expect +-10-20% between runs). Prints tables, writes
JSON and (with --md) Markdown.

    python packages/nvfp4-train/benchmarks/bench_compile.py
    python packages/nvfp4-train/benchmarks/bench_compile.py --depths 4 8 --unscanned-max 8
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
from nvfp4_train.model.config import REMAT_POLICIES
from nvfp4_train.precision.policy import run_layout
from nvfp4_train.training.resume import abstract_state, initial_state, run_train_step
from nvfp4_train.training.step import count_params

MIB = 2**20


def _batch(cfg, vocab: int) -> dict[str, jax.Array]:
    b, seq = cfg.train.batch_size, cfg.train.seq_len
    tokens = np.random.default_rng(0).integers(0, vocab, size=(b, seq + 1), dtype=np.int32)
    return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}


def measure(config: str, overrides: list[str], vocab: int, steps: int = 0) -> dict:
    """Init, lower and compile seconds, temporary bytes and (if `steps`) median step seconds."""
    cfg = load_config(config, [f"model.vocab_size={vocab}", *overrides])
    t0 = time.perf_counter()
    graphdef, _ = abstract_state(cfg)
    state = jax.jit(lambda: initial_state(cfg)[1])()
    jax.block_until_ready(state)
    t1 = time.perf_counter()
    step = jax.jit(run_train_step(cfg, graphdef), donate_argnums=0)
    batch = _batch(cfg, vocab)
    lowered = step.lower(state, batch)
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    memory = compiled.memory_analysis()
    row = {
        "blocks": cfg.model.num_layers,
        "scan_layers": cfg.model.scans,
        "remat": cfg.model.remat,
        "layout": [key for key, _, _ in run_layout(cfg).entries],
        "parameters": count_params(state.params),
        "init_s": t1 - t0,
        "lower_s": t2 - t1,
        "compile_s": t3 - t2,
        "temp_bytes": int(getattr(memory, "temp_size_in_bytes", 0)) if memory else 0,
    }
    if steps:
        state, _ = compiled(state, batch)
        jax.block_until_ready(state)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            state, metrics = compiled(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t)
        row["step_s"] = statistics.median(times)
    return row


def _depth_table(rows: list[dict]) -> str:
    base = {r["scan_layers"]: r for r in rows if r["blocks"] == min(x["blocks"] for x in rows)}
    lines = [
        "| blocks | scan_layers | layout | init s | lower s | compile s | compile vs fewest blocks | temp MiB |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for r in rows:
        ratio = r["compile_s"] / base[r["scan_layers"]]["compile_s"]
        layout = " ".join(r["layout"]) if len(r["layout"]) <= 6 else f"{len(r['layout'])} entries"
        lines.append(
            f"| {r['blocks']} | {str(r['scan_layers']).lower()} | {layout} | {r['init_s']:.1f} | "
            f"{r['lower_s']:.1f} | {r['compile_s']:.1f} | {ratio:.2f}x | "
            f"{r['temp_bytes'] / MIB:.1f} |"
        )
    return "\n".join(lines) + "\n"


def _remat_table(rows: list[dict]) -> str:
    none = next(r for r in rows if r["remat"] == "none")
    lines = [
        "| remat | compile s | temp MiB | vs none | step ms | vs none |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['remat']} | {r['compile_s']:.1f} | {r['temp_bytes'] / MIB:.1f} | "
            f"{r['temp_bytes'] / none['temp_bytes']:.2f}x | {r['step_s'] * 1e3:.0f} | "
            f"{r['step_s'] / none['step_s']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/configs/tiny.yaml")
    parser.add_argument("--vocab", type=int, default=257)
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 16, 32, 64])
    parser.add_argument(
        "--unscanned-max", type=int, default=32,
        help="deepest unscanned model compiled (64 unscanned blocks take ~20 min on 2 cores)",
    )  # fmt: skip
    parser.add_argument("--remat-depth", type=int, default=16, help="depth of the remat table")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per remat policy")
    parser.add_argument("--out", default="docs/benchmarks/compile.json")
    parser.add_argument("--md", default=None, help="also write the tables as Markdown here")
    args = parser.parse_args(argv)

    depth_rows = []
    for blocks in args.depths:
        for scan in (False, True):
            if not scan and blocks > args.unscanned_max:
                continue
            overrides = [f"model.num_layers={blocks}", f"model.scan_layers={str(scan).lower()}"]
            row = measure(args.config, overrides, args.vocab)
            depth_rows.append(row)
            print(
                f"blocks {blocks:3d} scan {scan!s:5}: compile {row['compile_s']:.1f}s", flush=True
            )
    remat_rows = []
    for remat in REMAT_POLICIES:
        overrides = [
            f"model.num_layers={args.remat_depth}",
            "model.scan_layers=true",
            f"model.remat={remat}",
        ]
        remat_rows.append(measure(args.config, overrides, args.vocab, steps=args.steps))
    depth_md, remat_md = _depth_table(depth_rows), _remat_table(remat_rows)
    print(depth_md)
    print(f"remat, {args.remat_depth} scanned blocks:\n{remat_md}")
    info = {
        "config": args.config,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "jax": jax.__version__,
            "backend": jax.default_backend(),
        },
        "depths": depth_rows,
        "remat": {"blocks": args.remat_depth, "rows": remat_rows},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(info, indent=1) + "\n")
    if args.md:
        text = (
            f"# Compile time against depth: scanned and unrolled blocks, remat policies\n\n"
            f"Train step of {args.config} with `model.num_layers` set ({jax.default_backend()}, "
            f"{os.cpu_count()} CPUs, jax {jax.__version__}; one measurement each, expect "
            f"+-10-20%). Regenerate with `python packages/nvfp4-train/benchmarks/"
            f"bench_compile.py --md docs/benchmarks/compile.md` (JSON: compile.json). "
            f"temp MiB is XLA's compiled temporary allocation (activations kept for the "
            f"backward pass and scratch).\n\n{depth_md}\n"
            f"Remat policies, {args.remat_depth} scanned blocks (step ms: median of "
            f"{args.steps} steps):\n\n{remat_md}"
        )
        Path(args.md).write_text(text)
    print(f"wrote {args.out}" + (f" and {args.md}" if args.md else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
