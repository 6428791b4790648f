"""Loss curves of one or more runs on one PNG, so BF16 and NVFP4 runs can sit side by side.

Example:
    >>> plot_runs(["runs/tiny-bf16", "runs/tiny-nvfp4"], "loss.png")  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from nvfp4_train.metrics import read_metrics


def ema(values: Sequence[float], alpha: float) -> np.ndarray:
    """Exponential moving average with bias correction (as TensorBoard's smoothing).

    Args:
        values: the series.
        alpha: smoothing weight in [0, 1); 0 returns the series unchanged.
    """
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"alpha must be in [0, 1), got {alpha}")
    out = np.empty(len(values), dtype=np.float64)
    acc = 0.0
    for i, v in enumerate(values):
        acc = alpha * acc + (1.0 - alpha) * float(v)
        out[i] = acc / (1.0 - alpha ** (i + 1))
    return out


def run_label(run_dir: str | Path) -> str:
    """`<dir name> (<precision.recipe>)`, or the dir name when the run has no readable config."""
    run_dir = Path(run_dir)
    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        recipe = cfg["precision"]["recipe"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return run_dir.name
    return f"{run_dir.name} ({recipe})"


def loss_series(rows: Sequence[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the rows that carry a non-null `key` (e.g. "loss", "val_loss")."""
    points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    xy = np.array(points, dtype=np.float64).reshape(-1, 2)
    return xy[:, 0], xy[:, 1]


def plot_runs(
    run_dirs: Sequence[str | Path], output: str | Path, *, smoothing: float = 0.6
) -> Path:
    """Draws train loss (smoothed, raw faint) and validation loss (markers) of each run.

    Args:
        run_dirs: run directories, each with a `metrics.jsonl`.
        output: the PNG to write.
        smoothing: EMA weight for the train loss, in [0, 1).

    Returns:
        The path of the written PNG.

    Raises:
        ValueError: a run directory has no metrics.jsonl or no loss rows.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = []
    for run_dir in run_dirs:
        path = Path(run_dir) / "metrics.jsonl"
        if not path.is_file():
            raise ValueError(f"run_dirs: {str(run_dir)!r} has no metrics.jsonl")
        rows = read_metrics(path)
        (ts, tl), (vs, vl) = loss_series(rows, "loss"), loss_series(rows, "val_loss")
        if not len(tl) and not len(vl):
            raise ValueError(f"run_dirs: {str(path)!r} has no loss rows")
        series.append((run_label(run_dir), ts, tl, vs, vl))

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for i, (label, ts, tl, vs, vl) in enumerate(series):
        color = f"C{i % 10}"
        if len(tl):
            ax.plot(ts, tl, color=color, alpha=0.2, linewidth=0.8)
            ax.plot(ts, ema(tl, smoothing), color=color, label=f"{label} train")
        if len(vl):
            ax.plot(vs, vl, "o--", color=color, markersize=5, label=f"{label} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output)
    plt.close(fig)
    return output
