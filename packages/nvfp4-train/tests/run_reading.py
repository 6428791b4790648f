"""Reading a finished or running `nvfp4-train run` directory back, for the tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import orbax.checkpoint as ocp

from nvfp4_train.observe.metrics import read_metrics


def train_losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, training loss) of every metrics row of the run."""
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


def val_losses(run_dir: Path) -> dict[int, float]:
    """{step: validation loss} of the training rows (`eval` rows left out)."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    return {r["step"]: r["val_loss"] for r in rows if "val_loss" in r and "loss" in r}


def saved_params(run_dir: Path, step: int):
    """The `params` item of the run's checkpoint at `step`."""
    return ocp.StandardCheckpointer().restore(run_dir / "checkpoints" / str(step) / "params")


def last_step(run_dir: Path) -> int:
    """The last step the run has logged a loss for (0 before its first row)."""
    try:
        rows = read_metrics(run_dir / "metrics.jsonl")
    except (OSError, ValueError):
        return 0
    return max((r["step"] for r in rows if "loss" in r), default=0)


def start_run(config: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`nvfp4-train run CONFIG` as a child process (stdout and stderr piped), with `env` added
    to this process's environment."""
    command = [sys.executable, "-m", "nvfp4_train", "run", str(config)]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def signal_each(targets: dict[str, tuple[subprocess.Popen, Path, int, int]]) -> dict[str, int]:
    """`targets`: {name: (process, run_dir, step, sig)}. Sends each process its signal as soon as
    its run has logged its step (watching all at once, so a slow start of one run cannot let
    another run to its end); returns {name: the last logged step at that moment}."""
    seen: dict[str, int] = {}
    deadline = time.monotonic() + 600
    while len(seen) < len(targets):
        for name, (process, run_dir, step, sig) in targets.items():
            last = last_step(run_dir) if name not in seen else None
            if last is not None and last >= step:
                process.send_signal(sig)
                seen[name] = last
            elif name not in seen and (process.poll() is not None or time.monotonic() > deadline):
                out, err = process.communicate()
                raise AssertionError(f"{name} ended before step {step}: {out[-1500:]}{err[-3000:]}")
        time.sleep(0.005)
    return seen


def straight_and_resumed(root: Path, cfg, stop_at: int) -> tuple[Path, Path]:
    """Trains `cfg` straight to `cfg.train.steps` in `root/straight`, and the same run in
    `root/resumed` stopped after `stop_at` steps and resumed to the end, in-process; returns both
    run directories (their final checkpoints should be the same bits)."""
    import dataclasses
    import io

    from nvfp4_train.training.run import run

    run(dataclasses.replace(cfg, output_dir=str(root / "straight")), stream=io.StringIO())
    first = dataclasses.replace(cfg, output_dir=str(root / "resumed"))
    run(dataclasses.replace(first, train=dataclasses.replace(first.train, steps=stop_at)),
        stream=io.StringIO())  # fmt: skip
    run(first, stream=io.StringIO())
    return root / "straight", root / "resumed"


def final_state(run_dir: Path):
    """The train state of the run's newest checkpoint."""
    from nvfp4_train.checkpoint.checkpoints import Checkpoints
    from nvfp4_train.training.resume import abstract_state
    from nvfp4_train.training.session import load_run_config, with_data

    cfg, _ = with_data(load_run_config(run_dir))
    with Checkpoints(run_dir / "checkpoints", keep=3) as ckpts:
        return ckpts.restore(ckpts.latest_step(), abstract_state(cfg)[1]).state
