"""The expert load of a Mixture-of-Experts run over its steps (`nvfp4-train plot --experts`).

Reads the `moe` field of the training rows (`metrics.summarize_moe`: per block each expert's
share of the assignments, max/mean load, dropped fraction) and draws, on one PNG, a heat map per
MoE block (experts x steps, coloured by share: white at the balanced 1/E, red above, blue below)
and, under them, every block's max/mean load and (when the capacity dropped any) dropped fraction
as lines over the same steps.

Example:
    >>> plot_experts("runs/tiny-moe", "runs/tiny-moe/experts.png")  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from nvfp4_train.errors import DataError
from nvfp4_train.observe.metrics import read_metrics
from nvfp4_train.observe.output_files import figure_metadata
from nvfp4_train.observe.plot import run_label


class ExpertLoad(NamedTuple):
    """The MoE fields of a run's training rows, by step.

    Attributes:
        steps: the logged steps, ascending.
        share: {block: float [E, steps]}, each expert's share of the assignments.
        max_load: {block: float [steps]}, max over mean of the experts' assignments.
        dropped: {block: float [steps]}, the fraction of assignments over the capacity.
    """

    steps: list[int]
    share: dict[str, np.ndarray]
    max_load: dict[str, np.ndarray]
    dropped: dict[str, np.ndarray]


def _block_order(block: str) -> tuple[int, str]:
    index = block.rsplit(".", 1)[-1]
    return (int(index) if index.isdigit() else -1), block


def expert_load(rows: Sequence[dict[str, Any]]) -> ExpertLoad:
    """The `moe` fields of `rows` (training rows; others are skipped) as arrays over steps,
    blocks in layer order. When a step was logged twice (a resumed run) the later row wins; a
    value a row lacks is NaN."""
    by_step = {int(r["step"]): r["moe"] for r in rows if isinstance(r.get("moe"), dict)}
    steps = sorted(by_step)
    blocks = sorted({b for moe in by_step.values() for b in moe}, key=_block_order)
    share, max_load, dropped = {}, {}, {}
    for block in blocks:
        entries = [by_step[s].get(block, {}) for s in steps]
        experts = max(len(e.get("load") or ()) for e in entries)
        grid = np.full((experts, len(steps)), np.nan)
        for j, entry in enumerate(entries):
            load = entry.get("load") or []
            grid[: len(load), j] = [np.nan if v is None else v for v in load]
        share[block] = grid
        max_load[block] = _series(entries, "max_load")
        dropped[block] = _series(entries, "dropped")
    return ExpertLoad(steps, share, max_load, dropped)


def _series(entries: Sequence[dict[str, Any]], stat: str) -> np.ndarray:
    return np.array([np.nan if e.get(stat) is None else float(e[stat]) for e in entries])


def _edges(steps: Sequence[int]) -> np.ndarray:
    """Cell edges around each step (midway between neighbours), for uneven step spacing."""
    x = np.asarray(steps, dtype=np.float64)
    if len(x) == 1:
        return np.array([x[0] - 0.5, x[0] + 0.5])
    middle = (x[1:] + x[:-1]) / 2
    return np.concatenate([[x[0] - (middle[0] - x[0])], middle, [x[-1] + (x[-1] - middle[-1])]])


def plot_experts(run_dir: str | Path, output: str | Path) -> Path:
    """Draws the expert load of one MoE run (see the module docstring).

    Args:
        run_dir: a run directory whose `metrics.jsonl` has training rows with `moe`.
        output: the PNG to write.

    Returns:
        The path of the written PNG.

    Raises:
        DataError: no metrics.jsonl, or no MoE rows (a dense run).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise DataError(f"run_dir: {str(run_dir)!r} has no metrics.jsonl")
    load = expert_load(read_metrics(path))
    if not load.steps:
        raise DataError(
            f"run_dir: {str(run_dir)!r} has no Mixture-of-Experts rows (no `moe` field in "
            "metrics.jsonl): plot --experts needs a run with model.moe.num_experts > 0"
        )
    dropped = any(np.nansum(v) > 0 for v in load.dropped.values())
    fig, axes = _figure(plt, load, dropped)
    _draw_shares(fig, axes[: len(load.share)], load)
    _draw_lines(axes[len(load.share)], load.steps, load.max_load, "max / mean load", reference=1.0)
    if dropped:
        _draw_lines(axes[-1], load.steps, load.dropped, "dropped fraction", reference=0.0)
    axes[-1].set_xlabel("step")
    note = "" if dropped else " (no assignment dropped)"
    fig.suptitle(f"{run_label(run_dir)}: expert load per MoE block{note}")
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, metadata=figure_metadata(output))
    plt.close(fig)
    return output


def _figure(plt, load: ExpertLoad, dropped: bool):
    """One heat-map row per block (height by its experts), then the line panels: max/mean load
    and, when any assignment was dropped, the dropped fraction; at most 40 inches in all (many
    blocks: thinner panels)."""
    heights = [min(0.16 * grid.shape[0], 3.0) + 0.5 for grid in load.share.values()]
    heights += [1.6, 1.3] if dropped else [1.6]
    fig, axes = plt.subplots(len(heights), 1, sharex=True, figsize=(9, min(sum(heights) + 0.9, 40.0)),
                             dpi=110, layout="constrained",
                             gridspec_kw={"height_ratios": heights})  # fmt: skip
    return fig, np.atleast_1d(axes)


def _draw_shares(fig, axes, load: ExpertLoad) -> None:
    """Heat maps of each block's shares, one diverging colour scale centred at 1/E."""
    from matplotlib.colors import TwoSlopeNorm

    experts = max(grid.shape[0] for grid in load.share.values())
    finite = np.concatenate([g[np.isfinite(g)] for g in load.share.values()])
    uniform = 1.0 / experts
    top = max(float(finite.max()) if finite.size else 0.0, 2 * uniform)
    norm = TwoSlopeNorm(vmin=0.0, vcenter=uniform, vmax=top)
    cmap = _cmap("RdBu_r")
    x = _edges(load.steps)
    for ax, (block, grid) in zip(axes, load.share.items(), strict=True):
        y = np.arange(grid.shape[0] + 1) - 0.5
        image = ax.pcolormesh(x, y, np.ma.masked_invalid(grid), cmap=cmap, norm=norm)
        ax.invert_yaxis()
        ax.set_ylabel(f"{block}\nexpert", fontsize=8)
        ticks = np.unique(np.linspace(0, grid.shape[0] - 1, min(grid.shape[0], 16)).astype(int))
        ax.set_yticks(ticks, [str(t) for t in ticks], fontsize=7)
    fig.colorbar(
        image, ax=list(axes), fraction=0.03, pad=0.01,
        label=f"share of the assignments (white: balanced, 1/{experts})",
    )  # fmt: skip


def _cmap(name: str):
    """A matplotlib colour map with missing values grey."""
    import matplotlib

    return matplotlib.colormaps[name].with_extremes(bad="0.6")


def _draw_lines(ax, steps, series: dict[str, np.ndarray], label: str, *, reference: float):
    """One line per block over the steps (markers when they are few), a dotted reference."""
    for i, (block, values) in enumerate(series.items()):
        ax.plot(steps, values, color=f"C{i % 10}", label=block,
                marker="o" if len(steps) <= 40 else None, markersize=3)  # fmt: skip
    ax.axhline(reference, color="0.5", linewidth=0.8, linestyle=":")
    ax.set_ylabel(label, fontsize=8)
    ax.grid(True, alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=7, ncols=min(len(series), 6))
