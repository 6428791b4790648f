"""Downstream columns of the evidence study: the paired BF16 / NVFP4 runs scored on tasks.

Each finished run `<runs-dir>/<variant>-s<seed>` (trained by `run_evidence.py`) is scored with
`nvfp4-train eval RUN --tasks ...` at its last checkpoint, with the forward it trained with (the
NVFP4 runs' quantized linears, the BF16 runs' BF16), on

- the shipped multiple-choice tasks (`examples/tasks`: a JSONL, an lm-evaluation-harness YAML
  and a BIG-bench-style `task.json`; accuracy and length-normalised accuracy), and
- held-out text: the last `--heldout-chapters` chapters of the built-in corpus, which lie inside
  the runs' validation split (the end of the corpus, `data.validation_fraction`), scored by rolling
  log-likelihood in bits per byte.

Each run's scores go to `<run>/downstream.json` (kept: a rerun only scores what is missing), and
`--out-dir` gets `downstream.json` (every run, and per variant the mean, the seed spread and the
paired NVFP4 - BF16 difference) and `downstream.md` (the table docs/evidence.md shows).

    python examples/evidence/downstream.py --runs-dir runs/evidence --out-dir docs/evidence
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from nvfp4_train.data.builtin_text import kjv_chapters

HERE = Path(__file__).resolve().parent
TASKS = HERE.parent / "tasks"
CHOICE_TASKS = (
    TASKS / "next_word.jsonl",
    TASKS / "lm_eval_style" / "questions.yaml",
    TASKS / "bigbench_style" / "task.json",
)
HELD_OUT = "heldout"
BASELINE = "bf16"


def write_heldout(runs_dir: Path, chapters: int, validation_fraction: float) -> Path:
    """The last `chapters` chapters of the built-in text as `<runs-dir>/heldout.txt`.

    Raises:
        SystemExit: the chapters reach before the validation split (they would be training text).
    """
    docs = kjv_chapters()
    text = "\n".join(docs[-chapters:])
    total = sum(len(d.encode()) + 1 for d in docs)
    if len(text.encode()) > validation_fraction * total:
        sys.exit(
            f"{chapters} chapters ({len(text.encode())} bytes) reach before the held-out "
            f"{validation_fraction:.0%} of the corpus ({validation_fraction * total:.0f} bytes)"
        )
    path = runs_dir / f"{HELD_OUT}.txt"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def score(run: Path, tasks: list[Path], batch_size: int) -> dict:
    """The run's `downstream.json`, scored now unless it is there already."""
    out = run / "downstream.json"
    if not out.exists():
        command = ["nvfp4-train", "eval", str(run), "--tasks", *map(str, tasks)]
        command += ["--batch-size", str(batch_size), "-o", str(out)]
        subprocess.run(command, check=True)
    return json.loads(out.read_text())


def metrics_of(result: dict) -> dict[str, float]:
    """task/metric -> value (accuracies of the choice tasks, bits per byte of the text)."""
    out = {}
    for name, task in result["tasks"].items():
        keys = ("bits_per_byte",) if name == HELD_OUT else ("acc", "acc_norm")
        out |= {f"{name}/{k}": task[k] for k in keys}
    return out


def spread(values: list[float]) -> tuple[float, float]:
    """(mean, sample standard deviation; 0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(runs: dict[str, dict[int, dict[str, float]]]) -> dict[str, dict]:
    """Per variant and metric: mean ± std over seeds, and the paired difference to BF16."""
    summary = {}
    for variant, by_seed in runs.items():
        rows = {}
        for metric in next(iter(by_seed.values())):
            values = [by_seed[s][metric] for s in sorted(by_seed)]
            row = dict(zip(("mean", "std"), spread(values), strict=True))
            paired = sorted(set(by_seed) & set(runs.get(BASELINE, {})))
            if variant != BASELINE and paired:
                diffs = [by_seed[s][metric] - runs[BASELINE][s][metric] for s in paired]
                row["paired_diff_mean"], row["paired_diff_std"] = spread(diffs)
                row["paired_seeds"] = len(paired)
            rows[metric] = row
        summary[variant] = rows
    return summary


def markdown(summary: dict[str, dict], runs: dict, results: dict) -> str:
    """The table: one row per task metric, a column per variant and the paired difference."""
    variants = list(summary)
    stderr = {  # one run's own standard error, for the scale of the seed spread
        f"{name}/{k}": results[name][f"{k}_stderr"]
        for name in results
        for k in ("acc", "acc_norm")
        if f"{k}_stderr" in results[name]
    }
    head = ["task / metric", *(f"{v} (mean ± std, {len(runs[v])} seeds)" for v in variants)]
    head += [f"{v} - {BASELINE} (paired)" for v in variants if v != BASELINE]
    head += ["one run's standard error"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for metric in summary[variants[0]]:
        cells = [f"`{metric}`"]
        cells += [
            f"{summary[v][metric]['mean']:.4f} ± {summary[v][metric]['std']:.4f}" for v in variants
        ]
        for v in variants:
            if v != BASELINE:
                row = summary[v][metric]
                cells.append(f"{row['paired_diff_mean']:+.4f} ± {row['paired_diff_std']:.4f}")
        se = stderr.get(metric)
        cells.append(f"{se:.3f}" if se is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--runs-dir", type=Path, default=Path("runs/evidence"))
    p.add_argument("--out-dir", type=Path, default=None, help="default: the runs directory")
    p.add_argument("--variants", nargs="+", default=[BASELINE, "nvfp4"])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--heldout-chapters", type=int, default=22)
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args()
    out_dir = args.out_dir or args.runs_dir
    config = yaml.safe_load((HERE / "evidence.yaml").read_text())
    heldout = write_heldout(
        args.runs_dir, args.heldout_chapters, config["data"]["validation_fraction"]
    )
    tasks = [*CHOICE_TASKS, heldout]
    steps_of_run = config["train"]["steps"]
    runs, results, steps = {}, {}, {}
    for variant in args.variants:
        for seed in range(args.seeds):
            run = args.runs_dir / f"{variant}-s{seed}"
            if not (run / "checkpoints" / str(steps_of_run)).is_dir():
                print(
                    f"{run}: no step-{steps_of_run} checkpoint (run_evidence.py trains it); left out"
                )
                continue
            result = score(run, tasks, args.batch_size)
            runs.setdefault(variant, {})[seed] = metrics_of(result)
            results, steps[run.name] = result["tasks"], result["step"]
    summary = summarize(runs)
    document = {
        "tasks": [str(t.relative_to(HERE.parent.parent)) for t in CHOICE_TASKS],
        "heldout": {"chapters": args.heldout_chapters, "bytes": len(heldout.read_bytes())},
        "steps": steps,
        "runs": {v: {str(s): m for s, m in by.items()} for v, by in runs.items()},
        "summary": summary,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "downstream.json").write_text(json.dumps(document, indent=2) + "\n")
    table = markdown(summary, runs, results)
    (out_dir / "downstream.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
