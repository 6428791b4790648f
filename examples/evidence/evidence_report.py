"""Collects the evidence runs into a table (rows of `docs/evidence.json`) and a loss-curve PNG.

A run directory is `<runs_dir>/<variant>-s<seed>` holding the `metrics.jsonl` that
`nvfp4-train run` writes. Gaps are paired: for each seed that both a variant and BF16 finished,
gap = (val_variant - val_bf16) / val_bf16, then mean and sample standard deviation over seeds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

BASELINE = "bf16"
FULL_RECIPE = "nvfp4"
"""Variants are also paired against the full recipe: same seeds, so same data and start."""

T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306}
"""Student-t 97.5% quantiles by degrees of freedom (seeds - 1): the half-width of a 95%
confidence interval of a paired mean difference is T_975[n - 1] * std / sqrt(n)."""


def run_dir_name(variant: str, seed: int) -> str:
    """`nvfp4-s0` for variant `nvfp4`, seed 0."""
    return f"{variant}-s{seed}"


def read_rows(metrics_path: Path) -> list[dict[str, Any]]:
    """The JSON rows of a metrics.jsonl (a torn last line from a killed run is skipped)."""
    rows = []
    for line in metrics_path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def val_curve(rows: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """{step: val_loss} of the training rows (the last row of a step wins, as after a resume)."""
    return {int(r["step"]): float(r["val_loss"]) for r in rows if "val_loss" in r and "loss" in r}


def finished_curve(runs_dir: Path, variant: str, seed: int, steps: int) -> dict[int, float] | None:
    """The validation curve of a run that reached `steps` with a validation loss, else None."""
    path = runs_dir / run_dir_name(variant, seed) / "metrics.jsonl"
    if not path.is_file():
        return None
    curve = val_curve(read_rows(path))
    return curve if steps in curve else None


def _mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    std = float(np.std(values, ddof=1)) if len(values) > 1 else None
    return float(np.mean(values)), std


def paired_difference(
    curves: Mapping[int, Mapping[int, float]], other: Mapping[int, Mapping[int, float]], step: int
) -> dict[str, Any]:
    """The relative difference (a - b) / b at `step` over the seeds both finished: per seed, mean,
    std, the 95% confidence interval of the mean (Student t) and whether it excludes 0."""
    seeds = [s for s in sorted(curves) if s in other and step in curves[s] and step in other[s]]
    diffs = {s: (curves[s][step] - other[s][step]) / other[s][step] for s in seeds}
    mean, std = _mean_std(list(diffs.values()))
    half = None if std is None else T_975[len(seeds) - 1] * std / math.sqrt(len(seeds))
    return {
        "per_seed": {str(s): d for s, d in diffs.items()},
        "mean": mean,
        "std": std,
        "ci95": None if half is None else [mean - half, mean + half],
        "resolved": None if half is None else bool(abs(mean) > half),
    }


def variant_row(
    name: str, curves: Mapping[int, Mapping[int, float]], baseline: Mapping[int, Mapping[int, float]],
    steps: int, stable_step: int | None, full_recipe: Mapping[int, Mapping[int, float]] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One table row: `curves`, `baseline` (BF16) and `full_recipe` map seed -> {step: val_loss}."""
    seeds = sorted(curves)
    finals = [curves[s][steps] for s in seeds]
    paired = [s for s in seeds if s in baseline]
    gaps = [(curves[s][steps] - baseline[s][steps]) / baseline[s][steps] for s in paired]
    mean, std = _mean_std(finals)
    gap, gap_std = _mean_std(gaps)
    row: dict[str, Any] = {
        "name": name,
        "final_val_loss": mean,
        "final_val_loss_std": std,
        "seeds": seeds,
        "per_seed_val_loss": {str(s): curves[s][steps] for s in seeds},
        "paired_seeds": paired,
        "rel_gap_to_bf16": gap,
        "rel_gap_std": gap_std,
        "rel_gap_sem": None if gap_std is None else gap_std / math.sqrt(len(gaps)),
        "diverged": any(not math.isfinite(v) for c in curves.values() for v in c.values()),
        "vs_bf16": paired_difference(curves, baseline, steps),
    }
    if full_recipe and name not in (BASELINE, FULL_RECIPE):
        row["vs_nvfp4"] = paired_difference(curves, full_recipe, steps)
    if stable_step is not None:
        stable = [
            (curves[s][stable_step] - baseline[s][stable_step]) / baseline[s][stable_step]
            for s in paired
            if stable_step in curves[s] and stable_step in baseline[s]
        ]
        row["rel_gap_stable"], row["rel_gap_stable_std"] = _mean_std(stable)
        row["stable_step"] = stable_step
    return row


def collect(
    runs_dir: Path, variants: Sequence[str], seeds: Mapping[str, Sequence[int]], steps: int,
    stable_step: int | None,
) -> tuple[list[dict[str, Any]], dict[str, dict[int, dict[int, float]]]]:  # fmt: skip
    """(table rows in `variants` order, {variant: {seed: curve}}) for the finished runs."""
    curves: dict[str, dict[int, dict[int, float]]] = {}
    for variant in variants:
        found = {s: finished_curve(runs_dir, variant, s, steps) for s in seeds[variant]}
        curves[variant] = {s: c for s, c in found.items() if c is not None}
    baseline, full = curves.get(BASELINE, {}), curves.get(FULL_RECIPE, {})
    rows = [
        variant_row(v, curves[v], baseline, steps, stable_step, full) for v in variants if curves[v]
    ]
    return rows, curves


def _pct(value: float | None, std: float | None = None) -> str:
    if value is None:
        return "-"
    text = f"{100 * value:+.2f}%"
    return text if std is None else f"{text} ± {100 * std:.2f}"


def markdown_table(rows: Sequence[Mapping[str, Any]], descriptions: Mapping[str, str]) -> str:
    """The table of docs/evidence.md: one line per variant."""
    lines = [
        "| variant | what it is | seeds | final val loss (mean ± std) | gap to BF16 at the end (mean ± std) | gap at end of stable phase |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        std = r["final_val_loss_std"]
        loss = f"{r['final_val_loss']:.4f}" + ("" if std is None else f" ± {std:.4f}")
        lines.append(
            f"| `{r['name']}` | {descriptions.get(r['name'], '')} | {len(r['seeds'])} | {loss} | "
            f"{_pct(r['rel_gap_to_bf16'], r['rel_gap_std'])} | "
            f"{_pct(r.get('rel_gap_stable'), r.get('rel_gap_stable_std'))} |"
        )
    return "\n".join(lines) + "\n"


def _interval(d: Mapping[str, Any]) -> str:
    if d["ci95"] is None:
        return _pct(d["mean"])
    lo, hi = d["ci95"]
    verdict = "resolved" if d["resolved"] else "not resolved"
    return f"{_pct(d['mean'])} [{100 * lo:+.2f}, {100 * hi:+.2f}] ({verdict})"


def paired_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Each variant paired against the full recipe and BF16 on the same seeds: per-seed
    differences and the mean with its 95% confidence interval (empty if no row has pairs)."""
    rows = [r for r in rows if "vs_nvfp4" in r and r["vs_nvfp4"]["per_seed"]]
    if not rows:
        return ""
    lines = [
        f"| variant | seeds | vs `{FULL_RECIPE}` per seed | vs `{FULL_RECIPE}`: mean [95% CI] | "
        f"vs `{BASELINE}`: mean [95% CI] |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        per_seed = ", ".join(_pct(v) for v in r["vs_nvfp4"]["per_seed"].values())
        lines.append(
            f"| `{r['name']}` | {len(r['vs_nvfp4']['per_seed'])} | {per_seed} | "
            f"{_interval(r['vs_nvfp4'])} | {_interval(r['vs_bf16'])} |"
        )
    return "\n".join(lines) + "\n"


def cross_eval_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The final validation loss of the rows evaluated with both forwards (empty if none)."""
    rows = [r for r in rows if "val_loss_bf16_forward" in r]
    if not rows:
        return ""
    lines = [
        "| variant | seeds | val loss, quantized forward | val loss, BF16 forward |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| `{r['name']}` | {len(r['seeds'])} | {r['val_loss_quantized_forward']:.4f} | "
            f"{r['val_loss_bf16_forward']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def plot_curves(
    curves: Mapping[str, Mapping[int, Mapping[int, float]]], output: Path, title: str
) -> Path:
    """Two panels: mean validation loss per variant, and the paired relative gap to BF16 (%)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_gap) = plt.subplots(1, 2, figsize=(13, 5))
    baseline = curves.get(BASELINE, {})
    for variant, by_seed in curves.items():
        if not by_seed:
            continue
        steps = sorted(set.intersection(*(set(c) for c in by_seed.values())))
        mean = [np.mean([by_seed[s][t] for s in by_seed]) for t in steps]
        style = {"lw": 2.5, "color": "k"} if variant == BASELINE else {"lw": 1.5}
        ax_loss.plot(
            steps,
            mean,
            marker="o",
            ms=3,
            label=f"{variant} ({len(by_seed)} seed{'s' * (len(by_seed) > 1)})",
            **style,
        )
        paired = [s for s in by_seed if s in baseline]
        if variant == BASELINE or not paired:
            continue
        gap_steps = [t for t in steps if all(t in baseline[s] for s in paired)]
        gaps = np.array(
            [[(by_seed[s][t] - baseline[s][t]) / baseline[s][t] for t in gap_steps] for s in paired]
        )
        line = ax_gap.plot(gap_steps, 100 * gaps.mean(0), marker="o", ms=3, label=variant)[0]
        if len(paired) > 1:
            sd = 100 * gaps.std(0, ddof=1)
            mid = 100 * gaps.mean(0)
            ax_gap.fill_between(gap_steps, mid - sd, mid + sd, color=line.get_color(), alpha=0.12)
    ax_loss.set(
        xlabel="step",
        ylabel="validation loss (nats/token)",
        title="validation loss (mean over seeds)",
    )
    ax_loss.set_ylim(top=min(ax_loss.get_ylim()[1], 3.0))
    ax_gap.axhline(0, color="k", lw=1)
    ax_gap.axhline(1, color="grey", lw=0.8, ls="--")
    ax_gap.set(
        xlabel="step",
        ylabel="gap to BF16 (%)",
        title="paired relative gap (band: ±1 std over seeds)",
    )
    for ax in (ax_loss, ax_gap):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return output
