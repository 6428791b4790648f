"""The evidence run: one small Llama trained with BF16 and with each NVFP4 variant, paired seeds.

Every (variant, seed) is one `nvfp4-train run` of `evidence.yaml` with the variant's overrides,
`train.seed=<seed>` (the seed fixes both the initial weights and the data order, so runs of the same
seed see the same batches) and `output_dir=<runs-dir>/<variant>-s<seed>`. Finished runs are
skipped, interrupted ones resume, so rerunning the command only adds what is missing. At the end the
script writes, under `--out-dir` (default: the runs directory, so that the committed results in
docs/ are only replaced on purpose, with `--out-dir docs`), `evidence.json` (one row per variant),
`evidence/table.md` and `evidence/loss-curves.png`. The full-recipe runs log quantization telemetry
every `--quant-stats-every` steps (it only observes: the train step is the same); the heat maps of
the first of them that has it become `evidence/quant-heatmap.png` (relative error) and
`evidence/quant-underflow.png`.

    python examples/evidence/run_evidence.py                 # CPU size: 23 runs, ~1.5 h on 2 cores
    python examples/evidence/run_evidence.py --jobs 1 --seeds 5 --ablation-seeds 3
    python examples/evidence/run_evidence.py --scale gpu --runs-dir runs/evidence-gpu
    python examples/evidence/run_evidence.py --report-only   # rebuild the outputs from the runs
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evidence_report import (  # noqa: E402
    BASELINE,
    collect,
    cross_eval_table,
    finished_curve,
    markdown_table,
    paired_table,
    plot_curves,
    read_rows,
    run_dir_name,
)

HERE = Path(__file__).resolve().parent
LATE_BF16_FROM = 0.82
"""Where `nvfp4-late-bf16` switches its forward GEMMs to BF16 (the paper's Appendix D: the last 18%)."""

VARIANTS: dict[str, tuple[str, list[str]]] = {
    "bf16": ("no quantization (the baseline)", ["precision.recipe=bf16"]),
    "nvfp4": (
        "the paper's recipe: 16x16 W, RHT on Wgrad, SR gradients, first/last block BF16",
        ["precision.recipe=nvfp4"],
    ),
    "nvfp4-no-rht": ("without the Hadamard transform on Wgrad", ["precision.recipe=nvfp4-no-rht"]),
    "nvfp4-no-sr": (
        "gradients rounded to nearest instead of stochastically",
        ["precision.recipe=nvfp4-no-sr"],
    ),
    "nvfp4-no-2d": (
        "1x16 weight blocks (W re-quantized for Dgrad)",
        ["precision.recipe=nvfp4-no-2d"],
    ),
    "nvfp4-no-bf16-layers": (
        "every block quantized (no BF16 first/last block)",
        ["precision.recipe=nvfp4", "precision.bf16_first_layers=0", "precision.bf16_last_layers=0"],
    ),
    "nvfp4-naive": (
        "1x16 blocks everywhere, RNE, no RHT, every block quantized",
        [
            "precision.recipe=nvfp4-naive",
            "precision.bf16_first_layers=0",
            "precision.bf16_last_layers=0",
        ],
    ),
    "mxfp4": (
        "MXFP4 (32-element blocks, power-of-two scales), same policy, SR + RHT",
        ["precision.recipe=mxfp4"],
    ),
    "fp8": (
        "FP8 per-tensor current scaling (E4M3 forward, E5M2 gradients), same policy",
        ["precision.recipe=fp8"],
    ),
    "nvfp4-late-bf16": (
        f"the full recipe, forward GEMMs in BF16 from {LATE_BF16_FROM:.0%} of the steps",
        ["precision.recipe=nvfp4", f"precision.bf16_forward_from={LATE_BF16_FROM}"],
    ),
    "nvfp4-4over6": (
        "the full recipe with Four Over Six block scales (amax -> 6 or 4 per block, by MSE)",
        ["precision.recipe=nvfp4-4over6"],
    ),
    "nvfp4-fwd-mxfp8-bwd": (
        "the full recipe's NVFP4 forward; Dgrad and Wgrad in MXFP8 (no RHT, no SR)",
        ["precision.recipe=nvfp4-fwd-mxfp8-bwd"],
    ),
    "nvfp4-per-token": (
        "the full recipe with one FP32 outer scale per token for the activations",
        ["precision.recipe=nvfp4-per-token"],
    ),
    "nvfp4-nemotron3": (
        "Nemotron 3 Super's policy: Mamba out_proj MXFP8, attention BF16, last 15% blocks BF16",
        ["precision.recipe=nvfp4", "precision.preset=nemotron-3-super"],
    ),
}
MAIN_VARIANTS = (
    "bf16", "nvfp4", "nvfp4-late-bf16", "nvfp4-4over6", "nvfp4-fwd-mxfp8-bwd", "nvfp4-per-token",
    "nvfp4-nemotron3",
)  # fmt: skip
"""The variants that get `--seeds` seeds (the others get `--ablation-seeds`)."""
HYBRID_VARIANTS = ("nvfp4-nemotron3",)
"""Variants for hybrid models only (a Mamba/attention policy), left out of the default study."""

GPU_SCALE = [
    "model.d_model=512", "model.num_layers=12", "model.num_heads=8", "model.num_kv_heads=4",
    "model.mlp_dim=1536", "model.max_seq_len=512", "train.seq_len=512", "train.batch_size=64",
    "train.steps=4000", "train.eval_every=250", "train.log_every=50", "checkpoint.every_steps=1000",
    "optimizer.warmup_steps=200", "optimizer.learning_rate=1.0e-3",
]  # fmt: skip
"""`--scale gpu`: a ~40M-parameter model and 131M tokens (use `--set data.source=text ...` for
more text than the built-in corpus, which is then seen ~30 times)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", type=Path, default=HERE / "evidence.yaml")
    p.add_argument("--runs-dir", type=Path, default=Path("runs/evidence"))
    p.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="where evidence.json and evidence/ go (default: the runs directory; pass docs to "
        "refresh the committed results)",
    )
    p.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS),
        default=[v for v in VARIANTS if v not in HYBRID_VARIANTS],
    )  # fmt: skip
    p.add_argument("--seeds", type=int, default=3, help=f"seeds of {', '.join(MAIN_VARIANTS)}")
    p.add_argument("--ablation-seeds", type=int, default=2, help="seeds of the other variants")
    p.add_argument("--jobs", type=int, default=2, help="runs trained at the same time")
    p.add_argument("--scale", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--quant-stats-every", type=int, default=25,
                   help="telemetry interval of the full-recipe runs (0: off, no heat map)")  # fmt: skip
    p.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra config overrides"
    )
    p.add_argument("--report-only", action="store_true", help="only rebuild the outputs")
    return p


def seeds_of(args: argparse.Namespace) -> dict[str, list[int]]:
    """{variant: seeds} per `--seeds` / `--ablation-seeds`."""
    return {
        v: list(range(args.seeds if v in MAIN_VARIANTS else args.ablation_seeds))
        for v in args.variants
    }


def schedule(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(variant, seed) in training order: seed 0 of every variant first, then the main variants'
    other seeds, then the ablations' - so a cut-short study still has complete pairs."""
    seeds = seeds_of(args)
    first = [(v, 0) for v in args.variants if seeds[v]]
    main = [(v, s) for s in range(1, args.seeds) for v in args.variants if v in MAIN_VARIANTS]
    rest = [
        (v, s) for s in range(1, args.ablation_seeds) for v in args.variants
        if v not in MAIN_VARIANTS
    ]  # fmt: skip
    return first + main + rest


def overrides(args: argparse.Namespace, variant: str, seed: int) -> list[str]:
    """The `nvfp4-train run` overrides of one run."""
    out = [f"output_dir={args.runs_dir / run_dir_name(variant, seed)}", f"train.seed={seed}"]
    out += VARIANTS[variant][1]
    out += GPU_SCALE if args.scale == "gpu" else []
    if variant == "nvfp4" and args.quant_stats_every:
        out.append(f"logging.quant_stats_every={args.quant_stats_every}")
    return out + list(args.set)


def train_one(args: argparse.Namespace, variant: str, seed: int) -> tuple[str, int, int, float]:
    """Runs (or resumes) one run; returns (variant, seed, exit code, seconds). Output goes to the
    run directory's `train.log`."""
    run_dir = args.runs_dir / run_dir_name(variant, seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "nvfp4_train",
        "run",
        str(args.config),
        *overrides(args, variant, seed),
    ]
    t0 = time.perf_counter()
    with open(run_dir / "train.log", "a") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    return variant, seed, code, time.perf_counter() - t0


def total_steps(args: argparse.Namespace) -> int:
    """train.steps of the study (the config file, then --scale, then --set)."""
    steps = int(yaml.safe_load(args.config.read_text())["train"]["steps"])
    for text in (GPU_SCALE if args.scale == "gpu" else []) + list(args.set):
        key, _, value = text.partition("=")
        steps = int(value) if key == "train.steps" else steps
    return steps


def train_all(args: argparse.Namespace, steps: int) -> None:
    todo = [(v, s) for v, s in schedule(args) if finished_curve(args.runs_dir, v, s, steps) is None]
    print(f"{len(todo)} runs to train ({args.jobs} at a time) in {args.runs_dir}", flush=True)
    env_jobs = max(1, args.jobs)
    with concurrent.futures.ThreadPoolExecutor(env_jobs) as pool:
        futures = [pool.submit(train_one, args, v, s) for v, s in todo]
        for future in concurrent.futures.as_completed(futures):
            variant, seed, code, seconds = future.result()
            status = "ok" if code == 0 else f"FAILED (exit {code}, see train.log)"
            print(
                f"  {run_dir_name(variant, seed):24s} {seconds / 60:5.1f} min  {status}", flush=True
            )


CROSS_EVAL = ("nvfp4", "nvfp4-late-bf16")
"""Variants whose final checkpoints are also evaluated with the other forward (`--forward`)."""


def cross_eval(args: argparse.Namespace, variant: str, seed: int, steps: int) -> dict[str, float]:
    """{"quantized": val loss, "bf16": val loss} of the final checkpoint of one run, each forward
    evaluated by `nvfp4-train eval --forward` once (its rows in metrics.jsonl are reused)."""
    run_dir = args.runs_dir / run_dir_name(variant, seed)
    found = {}
    for forward in ("quantized", "bf16"):
        for _ in range(2):
            rows = read_rows(run_dir / "metrics.jsonl")
            hits = [r for r in rows if r.get("forward") == forward and r.get("step") == steps]
            if hits:
                found[forward] = float(hits[-1]["val_loss"])
                break
            cmd = [sys.executable, "-m", "nvfp4_train", "eval", str(run_dir), "--forward", forward]
            subprocess.run(cmd, capture_output=True, check=True)
    return found


def add_cross_eval(args: argparse.Namespace, rows: list[dict], steps: int) -> None:
    """Adds `val_loss_quantized_forward` / `val_loss_bf16_forward` (means over seeds) to the
    rows of `CROSS_EVAL`: what the late switch owes to evaluating in BF16."""
    for row in rows:
        if row["name"] not in CROSS_EVAL:
            continue
        evals = [cross_eval(args, row["name"], seed, steps) for seed in row["seeds"]]
        for forward in ("quantized", "bf16"):
            values = [e[forward] for e in evals]
            row[f"val_loss_{forward}_forward"] = sum(values) / len(values)


def write_outputs(args: argparse.Namespace, steps: int) -> list[dict]:
    """Writes evidence.json, evidence/table.md, evidence/loss-curves.png (and the heat map)."""
    decay = yaml.safe_load(args.config.read_text()).get("optimizer", {}).get("decay_fraction", 0)
    stable_step = round(steps * (1 - decay)) if decay else None
    rows, curves = collect(args.runs_dir, args.variants, seeds_of(args), steps, stable_step)
    if not any(r["name"] == BASELINE for r in rows):
        raise SystemExit(f"no finished {BASELINE} run in {args.runs_dir}: nothing to compare with")
    out_dir = args.out_dir if args.out_dir is not None else args.runs_dir
    out = out_dir / "evidence"
    out.mkdir(parents=True, exist_ok=True)
    for row in rows:
        row["description"] = VARIANTS[row["name"]][0]
    add_cross_eval(args, rows, steps)
    (out_dir / "evidence.json").write_text(json.dumps(rows, indent=1) + "\n")
    table = markdown_table(rows, {v: d for v, (d, _) in VARIANTS.items()})
    table += "\n" + paired_table(rows)
    table += "\n" + cross_eval_table(rows)
    (out / "table.md").write_text(table)
    print(table)
    title = f"evidence run ({args.scale}, {steps} steps); gap = paired (variant - bf16) / bf16"
    plot_curves({v: curves[v] for v in args.variants}, out / "loss-curves.png", title)
    for seed in seeds_of(args).get("nvfp4", []):
        metrics = args.runs_dir / run_dir_name("nvfp4", seed) / "metrics.jsonl"
        if metrics.is_file() and '"quant"' in metrics.read_text():
            _plot_heatmap(metrics.parent, out / "quant-heatmap.png", "rel_error")
            _plot_heatmap(metrics.parent, out / "quant-underflow.png", "underflow")
            break
    return rows


def _plot_heatmap(run_dir: Path, output: Path, stat: str) -> None:
    cmd = [sys.executable, "-m", "nvfp4_train", "plot", "--quant", str(run_dir), "-o", str(output)]
    cmd += ["--stat", stat]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    print(result.stdout.strip() or result.stderr.strip())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    steps = total_steps(args)
    if not args.report_only:
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        train_all(args, steps)
    write_outputs(args, steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
