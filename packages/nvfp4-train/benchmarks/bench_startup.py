"""Wall time of a whole short `nvfp4-train run` against depth, split into its phases.

Runs `python -m nvfp4_train run --config` for `--steps` steps with `model.num_layers` set to each
of `--depths` and `model.scan_layers=true` (evaluation and checkpointing on the config's
defaults: with 2 steps, one evaluation and one checkpoint at the last step), each in a fresh
output directory under a temporary directory, with a cold JAX compile cache (no
JAX_COMPILATION_CACHE_DIR), `--repeats` times with the depths interleaved; reports medians.

The phases come from the times the run's lines reach stdout:
    start       launch -> "run directory:"  (imports, data, mesh)
    checks      -> "ops backend:"           (document bound, backend probe, attention check)
    init        -> "model:"                 (the jitted init of the train state)
    first step  -> "compiled the train step" (eval programs, train step lowering and compile)
    steps+eval  -> the last step's row      (the steps, then the evaluation)
    checkpoint  -> "done:"                  (the checkpoint, until it is on disk)
    exit        -> the process ends
and, from JAX_LOG_COMPILES, how many programs XLA compiled and their seconds in all.
`--src LABEL=CHECKOUT ...` runs the packages of each checkout in turn (e.g. a `git worktree`
of main for "before" numbers). Timings are measurements, never asserts. Prints a table, writes JSON and (--md)
Markdown.

    python packages/nvfp4-train/benchmarks/bench_startup.py
    python packages/nvfp4-train/benchmarks/bench_startup.py --src before=/tmp/base after=.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PACKAGES = ("nvfp4-format", "nvfp4-ops", "nvfp4-train", "nvfp4-export")
PHASES = ("start", "checks", "init", "first step", "steps+eval", "checkpoint", "exit")
MARKS = (
    ("start", re.compile(r"^run directory: ")),
    ("checks", re.compile(r"^ops backend: ")),
    ("init", re.compile(r"^model: ")),
    ("first step", re.compile(r"^compiled the train step")),
    ("steps+eval", None),  # the last step's row, "[n/n] step n ...", filled per run
    ("checkpoint", re.compile(r"^done: ")),
)
COMPILED = re.compile(r"Finished XLA compilation of (.+?) in ([\d.]+) sec")


def _env(src: Path) -> dict[str, str]:
    """The environment of a run: `src`'s package sources first, no compile cache."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    paths = [str(src / "packages" / p / "src") for p in PACKAGES]
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    env["JAX_LOG_COMPILES"] = "1"
    return env


def run_once(
    src: Path, config: str, blocks: int, steps: int, out_dir: Path, pattern: str = ""
) -> dict:
    """One `nvfp4-train run`: wall seconds, seconds per phase, compiled programs; `pattern`: the
    hybrid model's `model.pattern` at this depth ("" leaves the config's)."""
    command = [
        sys.executable, "-m", "nvfp4_train", "run", config, f"model.num_layers={blocks}",
        "model.scan_layers=true", f"train.steps={steps}", f"output_dir={out_dir}",
        *([f"model.pattern={pattern}"] if pattern else []),
    ]  # fmt: skip
    marks = [(name, pattern or re.compile(rf"^\[{steps}/{steps}\] ")) for name, pattern in MARKS]
    seen: dict[str, float] = {}
    with tempfile.TemporaryFile() as stderr:
        t0 = time.perf_counter()
        proc = subprocess.Popen(command, env=_env(src), stdout=subprocess.PIPE, stderr=stderr)
        lines = []
        for raw in proc.stdout:
            now = time.perf_counter() - t0
            for line in re.split(r"[\r\n]+", raw.decode(errors="replace")):
                lines.append(line)
                for name, pattern in marks:
                    if name not in seen and pattern.search(line):
                        seen[name] = now
        code = proc.wait()
        wall = time.perf_counter() - t0
        stderr.seek(0)
        log = stderr.read().decode(errors="replace")
    if code != 0:
        raise RuntimeError(f"run of {blocks} blocks failed ({code}):\n{log[-3000:]}")
    missing = [name for name, _ in marks if name not in seen]
    if missing:
        raise RuntimeError(f"no line for {missing} in the output:\n" + "\n".join(lines[-20:]))
    ends = [seen[name] for name, _ in marks] + [wall]
    spans = [ends[0], *(b - a for a, b in zip(ends[:-1], ends[1:], strict=True))]
    phases = dict(zip(PHASES, spans, strict=True))
    compiles = [float(s) for _, s in COMPILED.findall(log)]
    return {
        "blocks": blocks,
        "wall_s": wall,
        "phases_s": phases,
        "programs_compiled": len(compiles),
        "xla_compile_s": sum(compiles),
    }


def summary(runs: list[dict]) -> dict:
    """Medians over the repeats of one depth."""
    return {
        "blocks": runs[0]["blocks"],
        "repeats": len(runs),
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "wall_s_all": [r["wall_s"] for r in runs],
        "phases_s": {p: statistics.median(r["phases_s"][p] for r in runs) for p in PHASES},
        "programs_compiled": statistics.median(r["programs_compiled"] for r in runs),
        "xla_compile_s": statistics.median(r["xla_compile_s"] for r in runs),
    }


def table(rows: list[dict]) -> str:
    """Markdown: one row per depth, medians, and the wall time against the fewest blocks."""
    base = min(rows, key=lambda r: r["blocks"])
    head = " | ".join(f"{p} s" for p in PHASES)
    lines = [
        f"| blocks | wall s | vs {base['blocks']} blocks | {head} | programs compiled | XLA compile s |",
        "|---:|---:|---:|" + "---:|" * len(PHASES) + "---:|---:|",
    ]  # fmt: skip
    for r in rows:
        phases = " | ".join(f"{r['phases_s'][p]:.1f}" for p in PHASES)
        lines.append(
            f"| {r['blocks']} | {r['wall_s']:.1f} | {r['wall_s'] / base['wall_s']:.2f}x | "
            f"{phases} | {r['programs_compiled']:.0f} | {r['xla_compile_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/configs/tiny.yaml")
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--pattern", default="",
        help="a hybrid model's pattern; each depth D runs its first D letters (model.pattern)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--src", nargs="+", default=[f"this checkout={Path(__file__).resolve().parents[3]}"],
        help="LABEL=CHECKOUT: the checkouts whose packages run, interleaved (default: this one)",
    )  # fmt: skip
    parser.add_argument("--out", default="docs/benchmarks/startup.json")
    parser.add_argument("--md", default=None, help="also write the tables as Markdown here")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 1 or any(d < 1 for d in args.depths):
        parser.error("--repeats, --steps and every depth must be >= 1")
    sources = dict(item.partition("=")[::2] for item in args.src)
    bad = [f"{k}={v}" for k, v in sources.items() if not k or not Path(v, "packages").is_dir()]
    if bad:
        parser.error(f"--src takes LABEL=CHECKOUT with a packages/ folder, got {bad}")

    config = str(Path(args.config).resolve())
    runs = {label: {d: [] for d in args.depths} for label in sources}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):  # interleaved, so that drift hits every run alike
            for label, src in sources.items():
                for blocks in args.depths:
                    out_dir = Path(tmp) / f"{len(os.listdir(tmp))}"
                    row = run_once(
                        Path(src), config, blocks, args.steps, out_dir, args.pattern[:blocks]
                    )
                    runs[label][blocks].append(row)
                    print(
                        f"repeat {repeat} {label} {blocks:3d} blocks: {row['wall_s']:.1f}s",
                        flush=True,
                    )
    tables = {label: [summary(runs[label][d]) for d in args.depths] for label in sources}
    md = "".join(f"{label}:\n\n{table(rows)}\n" for label, rows in tables.items())
    print(md)
    info = {
        "sources": sources,
        "config": args.config,
        "steps": args.steps,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "medians": tables,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(info, indent=1) + "\n")
    if args.md:
        Path(args.md).write_text(md)
    print(f"wrote {args.out}" + (f" and {args.md}" if args.md else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
