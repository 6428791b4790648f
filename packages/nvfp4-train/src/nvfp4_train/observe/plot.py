"""Loss curves of one or more runs on one PNG, so BF16 and NVFP4 runs can sit side by side; and
the quantization telemetry of one run as heat maps (layer x step, one panel per GEMM operand role).

Example:
    >>> plot_runs(["runs/tiny-bf16", "runs/tiny-nvfp4"], "loss.png")  # doctest: +SKIP
    >>> plot_quant("runs/tiny", "quant.png", stat="rel_error")  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from nvfp4_train.errors import ConfigError, DataError
from nvfp4_train.model.pattern import pattern_kinds, pattern_letters
from nvfp4_train.model.structure import LINEAR_ORDER
from nvfp4_train.observe.metrics import read_metrics
from nvfp4_train.observe.output_files import figure_metadata

QUANT_STATS = ("amax", "underflow", "saturation", "rel_error")
"""The statistics of a telemetry row (as `nvfp4_ops.STATS`)."""
QUANT_ROLES = ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_x", "wgrad_dy")
"""GEMM operand roles in panel order (as `nvfp4_ops.gemm_operand_stats`)."""


def ema(values: Sequence[float], alpha: float) -> np.ndarray:
    """Exponential moving average with bias correction (as TensorBoard's smoothing).

    Args:
        values: the series.
        alpha: smoothing weight in [0, 1); 0 returns the series unchanged.
    """
    if not 0.0 <= alpha < 1.0:
        raise ConfigError(f"alpha must be in [0, 1), got {alpha}")
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
        DataError: a run directory has no metrics.jsonl or no loss rows.
        ConfigError: `smoothing` is not in [0, 1).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = []
    for run_dir in run_dirs:
        path = Path(run_dir) / "metrics.jsonl"
        if not path.is_file():
            raise DataError(f"run_dirs: {str(run_dir)!r} has no metrics.jsonl")
        rows = read_metrics(path)
        (ts, tl), (vs, vl) = loss_series(rows, "loss"), loss_series(rows, "val_loss")
        if not len(tl) and not len(vl):
            raise DataError(f"run_dirs: {str(path)!r} has no loss rows")
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
    fig.savefig(output, metadata=figure_metadata(output))
    plt.close(fig)
    return output


def _model_order(path: str) -> tuple[int, int, int, str]:
    """Sort key of `layers.{i}.{name}` (or an expert's `layers.{i}.{name}[{e}]`): layer index,
    then the name's place in its block's linears (`structure.LINEAR_ORDER`, which every block
    kind's linears follow), then the expert."""
    expert = -1
    if path.endswith("]") and "[" in path:
        path_only, index = path[:-1].rsplit("[", 1)
        if index.isdigit():
            path, expert = path_only, int(index)
    parts = path.split(".", 2)
    index = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else -1
    name = parts[-1]
    place = LINEAR_ORDER.index(name) if name in LINEAR_ORDER else len(LINEAR_ORDER)
    return index, place, expert, path


def run_pattern(run_dir: str | Path) -> str:
    """The run's `model.pattern` as Nemotron's letters (`M`, `*`, `-`, `E` per block), or "" for
    a Llama-style run or a run without a readable config."""
    try:
        cfg = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
        pattern = cfg["model"]["pattern"]
        return pattern_letters(pattern_kinds(pattern)) if pattern else ""
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return ""


def row_label(path: str, pattern: str) -> str:
    """A heat-map row's label: the path, or with a hybrid `pattern` the block index, its letter
    and the linear's name within its mixer.

    Example:
        >>> row_label("layers.3.mamba.in_proj", "M*MM"), row_label("layers.1.attn.qkv", "M*")
        ('3 M in_proj', '1 * qkv')
        >>> row_label("layers.1.attn.qkv", "")
        'layers.1.attn.qkv'
    """
    parts = path.split(".", 3)
    if not pattern or len(parts) < 4 or not parts[1].isdigit() or int(parts[1]) >= len(pattern):
        return path
    return f"{parts[1]} {pattern[int(parts[1])]} {parts[3]}"


def quant_grid(
    rows: Sequence[dict[str, Any]], stat: str
) -> tuple[list[str], list[int], dict[str, np.ndarray]]:
    """(linear paths in model order, steps, {role: float [paths, steps]}) of the telemetry rows.

    A value the run did not log (or logged as null, i.e. non-finite) is NaN. Roles no row
    carries are left out. When a step was logged twice (a resumed run) the later row wins.
    """
    if stat not in QUANT_STATS:
        raise ConfigError(f"stat must be one of {', '.join(QUANT_STATS)}, got {stat!r}")
    by_step = {int(r["step"]): r["quant"] for r in rows if isinstance(r.get("quant"), dict)}
    steps = sorted(by_step)
    paths = sorted({p for q in by_step.values() for p in q}, key=_model_order)
    roles = [r for r in QUANT_ROLES if any(r in q.get(p, {}) for q in by_step.values() for p in q)]
    grids = {}
    for role in roles:
        grid = np.full((len(paths), len(steps)), np.nan)
        for j, step in enumerate(steps):
            for i, path in enumerate(paths):
                value = by_step[step].get(path, {}).get(role, {}).get(stat)
                grid[i, j] = np.nan if value is None else float(value)
        grids[role] = grid
    return paths, steps, grids


def _color_norm(values: np.ndarray, stat: str):
    """One colour scale for all panels: log for underflow / saturation / amax whose positive
    values span more than a factor 20 (zeros then fall below it: the 'under' colour), linear
    otherwise (from 0 for the fractions)."""
    from matplotlib.colors import LogNorm, Normalize

    positive = values[np.isfinite(values) & (values > 0)]
    if stat in ("underflow", "saturation", "amax") and positive.size:
        low, high = float(positive.min()), float(positive.max())
        if high / low > 20:
            return LogNorm(vmin=low, vmax=high)
    finite = values[np.isfinite(values)]
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    if stat in ("underflow", "saturation"):
        low = 0.0
    return Normalize(vmin=low, vmax=max(high, low + 1e-12))


def _is_log(norm) -> bool:
    from matplotlib.colors import LogNorm

    return isinstance(norm, LogNorm)


def _tick_positions(count: int, most: int) -> np.ndarray:
    return np.unique(np.linspace(0, count - 1, min(count, most)).round().astype(int))


def _read_quant_grid(
    run_dir: str | Path, stat: str
) -> tuple[list[str], list[int], dict[str, np.ndarray]]:
    """`quant_grid` of the run's metrics.jsonl; DataError when it has none or no telemetry rows."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise DataError(f"run_dir: {str(run_dir)!r} has no metrics.jsonl")
    paths, steps, grids = quant_grid(read_metrics(path), stat)
    if not grids:
        raise DataError(
            f"run_dir: {str(path)!r} has no quantization telemetry rows; train with "
            "logging.quant_stats_every > 0 (e.g. logging.quant_stats_every=50)"
        )
    return paths, steps, grids


def _draw_panel(ax, role: str, grid: np.ndarray, labels, steps, norm, cmap):
    """One role's heat map on `ax` (a zero drawn below a log scale's range: the 'under' colour,
    missing values masked: the 'bad' one), with at most 40 linear (`labels`) and 8 step ticks;
    returns the image (for the colour bar)."""
    values = np.where(grid == 0, norm.vmin / 10, grid) if _is_log(norm) else grid
    image = ax.imshow(np.ma.masked_invalid(values), aspect="auto", interpolation="nearest",
                      cmap=cmap, norm=norm)  # fmt: skip
    ax.set_title(role)
    ys, xs = _tick_positions(len(labels), 40), _tick_positions(len(steps), 8)
    ax.set_yticks(ys, [labels[i] for i in ys], fontsize=7)
    ax.set_xticks(xs, [str(steps[i]) for i in xs], fontsize=7)
    ax.set_xlabel("step")
    return image


def plot_quant(run_dir: str | Path, output: str | Path, *, stat: str = "rel_error") -> Path:
    """Heat maps of one telemetry statistic: rows = quantized linears in model order, columns =
    logged steps, one panel per GEMM operand role, each with its colour bar. A hybrid run's rows
    are labelled by block, its pattern letter and the linear (`row_label`: `3 M in_proj`).

    Args:
        run_dir: a run directory whose `metrics.jsonl` has telemetry rows
            (`logging.quant_stats_every` > 0).
        output: the PNG to write.
        stat: one of `QUANT_STATS`. All panels share one colour bar; underflow, saturation
            and amax use a log scale when their positive values span more than a factor 20
            (zeros are then white); values not logged or non-finite are grey.

    Returns:
        The path of the written PNG.

    Raises:
        DataError: no metrics.jsonl or no telemetry rows.
        ConfigError: an unknown `stat`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths, steps, grids = _read_quant_grid(run_dir, stat)
    labels = [row_label(p, run_pattern(run_dir)) for p in paths]
    cols = min(3, len(grids))
    nrows = -(-len(grids) // cols)
    height = min(max(2.5, 0.22 * len(paths) + 1.6), 30.0)  # many experts: rows get thinner
    fig, axes = plt.subplots(nrows, cols, figsize=(5.4 * cols, height * nrows), dpi=110,
                             squeeze=False, layout="constrained")  # fmt: skip
    norm = _color_norm(np.concatenate([g.ravel() for g in grids.values()]), stat)
    cmap = plt.get_cmap("viridis").with_extremes(under="white", bad="0.6")
    for ax, (role, grid) in zip(axes.flat, grids.items(), strict=False):
        image = _draw_panel(ax, role, grid, labels, steps, norm, cmap)
    for ax in list(axes.flat)[len(grids) :]:
        ax.axis("off")
    grey = "missing; an expert's x, dy: no tokens" if any("[" in p for p in paths) else "missing"
    fig.suptitle(f"{run_label(run_dir)}: quantization {stat} per linear and step (grey: {grey})")
    scale = "log scale, white: 0" if _is_log(norm) else "linear scale"
    fig.colorbar(
        image, ax=axes.ravel().tolist(), fraction=0.03, pad=0.01, label=f"{stat} ({scale})"
    )
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, metadata=figure_metadata(output))
    plt.close(fig)
    return output
