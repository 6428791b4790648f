"""Where a run's numbers go: `metrics.jsonl`, TensorBoard, and the terminal.

`metrics.jsonl` holds one JSON object per line. Training rows carry `step`, `loss`, `lr`,
`grad_norm`, `tokens_per_s`, `step_time_s`, `skipped_steps` (cumulative),
`model_tflops_per_device` and, on a device whose peak is known, `mfu` (and `mfu_fp4`; see
`nvfp4_train.model.flops`), with MTP layers `mtp_loss` (`training.step`); rows at evaluation
steps also carry `val_loss`; `nvfp4-train eval` appends rows with `step`, `val_loss` and
`source: "eval"`. A model with MoE blocks adds `aux_loss`, `z_loss`, `max_load` and `moe:
{block: {load: [share per expert], max_load, dropped, entropy, aux_loss, z_loss}}` to its
training rows (`summarize_moe`). With `logging.quant_stats_every`, telemetry rows `{"step",
"quant": {path: {role: {stat: value}}}}` (see `quant_row`; one path per routed expert,
`expert_path`; a hybrid model's rows add each Mamba block's SSM health, `ssm: {block: {dt_min,
dt_max, dt_mean, state_norm}}`) sit between them; readers pick rows by the keys they need.

Example:
    >>> row = summarize_window([{"loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "skipped": 0}],
    ...                        step=10, seconds=0.5, tokens=1024, skipped_total=0)
    >>> format_row(row)
    'step 10  loss 2.0000  lr 1.00e-03  grad_norm 1.000  tok/s 2048  skipped 0'
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TextIO

import numpy as np

from nvfp4_train.observe.quant_rows import EXPERT_TOKENS, expert_path, quant_row, summarize_quant
from nvfp4_train.observe.tensorboard_events import TensorBoard

__all__ = [  # the names of `quant_rows` and `tensorboard_events` are re-exported from there
    "EXPERT_TOKENS",
    "MOE_FIELDS",
    "TASK_ROW_METRICS",
    "MetricsFile",
    "PlainProgress",
    "RichProgress",
    "RunOutputs",
    "TensorBoard",
    "expert_path",
    "format_row",
    "make_progress",
    "quant_row",
    "read_metrics",
    "summarize_moe",
    "summarize_quant",
    "summarize_window",
    "truncate_metrics",
]

# --------------------------------------------------------------------------- pure helpers


def summarize_window(
    step_metrics: Sequence[Mapping[str, float]],
    *,
    step: int,
    seconds: float,
    tokens: int,
    skipped_total: int,
) -> dict[str, Any]:
    """One metrics row from the per-step metrics of the steps since the last row.

    Args:
        step_metrics: host values of each step's `loss`, `grad_norm`, `lr`, `skipped`.
        step: the step count after the last of those steps.
        seconds: wall time those steps took.
        tokens: tokens those steps consumed.
        skipped_total: non-finite steps skipped since the start of the run.

    Returns:
        The row: mean `loss` and `grad_norm` over the window, the last `lr`, throughput and timing;
        with multi-token prediction (`model.mtp`) the mean `mtp_loss`.
    """
    if not step_metrics:
        raise ValueError("step_metrics must hold at least one step, got none")
    n = len(step_metrics)
    row = {
        "step": int(step),
        "loss": float(sum(m["loss"] for m in step_metrics) / n),
        "lr": float(step_metrics[-1]["lr"]),
        "grad_norm": float(sum(m["grad_norm"] for m in step_metrics) / n),
        "tokens_per_s": float(tokens / seconds) if seconds > 0 else 0.0,
        "step_time_s": float(seconds / n),
        "skipped_steps": int(skipped_total),
    }
    if "mtp_loss" in step_metrics[-1]:
        row["mtp_loss"] = float(sum(m["mtp_loss"] for m in step_metrics) / n)
    return row


MOE_FIELDS = ("aux_loss", "z_loss", "max_load")
"""Step metrics of a model with MoE blocks, over its blocks (`model.moe_stats.load_metrics`)."""


def summarize_moe(step_metrics: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The MoE fields of a metrics row: the window's means of `aux_loss`, `z_loss`, `max_load`
    and, under `moe`, of each block's statistics (`load`: each expert's share, a list); empty
    for a dense model.

    Example:
        >>> m = {"aux_loss": 2.0, "z_loss": 1.0, "max_load": 1.5,
        ...      "moe": {"layers.0": {"load": [0.75, 0.25], "dropped": 0.0}}}
        >>> summarize_moe([m, m])["moe"]["layers.0"]["load"]
        [0.75, 0.25]
    """
    if "moe" not in step_metrics[-1]:
        return {}
    n = len(step_metrics)
    mean = lambda values: sum(np.asarray(v, np.float64) for v in values) / n  # noqa: E731
    row = {key: float(mean(m[key] for m in step_metrics)) for key in MOE_FIELDS}
    row["moe"] = {
        block: {
            stat: (lambda v: v.tolist() if v.ndim else float(v))(
                mean(m["moe"][block][stat] for m in step_metrics)
            )
            for stat in stats
        }
        for block, stats in step_metrics[-1]["moe"].items()
    }
    return row


_ROW_FIELDS = (
    ("loss", "loss", "{:.4f}"),
    ("val_loss", "val_loss", "{:.4f}"),
    ("mtp_loss", "mtp", "{:.4f}"),
    ("aux_loss", "aux", "{:.3f}"),
    ("max_load", "load max/mean", "{:.2f}"),
    ("lr", "lr", "{:.2e}"),
    ("grad_norm", "grad_norm", "{:.3f}"),
    ("tokens_per_s", "tok/s", "{:.0f}"),
    ("model_tflops_per_device", "TFLOP/s/dev", "{:.3g}"),
    ("mfu", "MFU", "{:.1%}"),
    ("skipped_steps", "skipped", "{}"),
)
"""(metrics key, label, format) of the fields `format_row` shows, in order."""


def format_row(row: Mapping[str, Any]) -> str:
    """A one-line, human-readable view of a metrics row (for plain logs)."""
    parts = [f"step {row['step']}"]
    parts += [f"{label} {fmt.format(row[key])}" for key, label, fmt in _ROW_FIELDS if key in row]
    parts += [f"{key[5:]} {row[key]:.4g}" for key in row
              if key.startswith("task/") and key.endswith(TASK_ROW_METRICS)]  # fmt: skip
    if "quant" in row:
        parts.append(summarize_quant(row["quant"]))
    return "  ".join(parts)


TASK_ROW_METRICS = ("/acc", "/acc_norm", "/bits_per_byte")
"""The downstream-task fields (`task/<name>/<metric>`) `format_row` shows."""


def _json_safe(value: Any) -> Any:
    """JSON has no NaN/Infinity: non-finite floats are written as null (also inside mappings)."""
    if isinstance(value, Mapping):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# --------------------------------------------------------------------------- metrics.jsonl


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a `metrics.jsonl` file (an empty list when it does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def truncate_metrics(path: str | Path, last_step: int) -> int:
    """Drops rows after `last_step` (written past a checkpoint before a restart); returns how many."""
    path = Path(path)
    rows = read_metrics(path)
    kept = [r for r in rows if r.get("step", 0) <= last_step]
    if len(kept) != len(rows):
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(path)
    return len(rows) - len(kept)


class MetricsFile:
    """Appends rows to a `metrics.jsonl` file, flushing after each row.

    If the file disappears while the run writes it (deleted, or replaced by another file), the
    next row says so through `say` and starts a new file at the same path, instead of writing
    on into the deleted one where nobody can read it.
    """

    def __init__(self, path: str | Path, say: Callable[[str], None] = print) -> None:
        self.path = Path(path)
        self._say = say
        self._open()

    def _open(self) -> None:
        self._file = self.path.open("a")
        self._identity = os.fstat(self._file.fileno())[1:3]  # (inode, device)

    def _still_ours(self) -> bool:
        try:
            return os.stat(self.path)[1:3] == self._identity
        except FileNotFoundError:
            return False

    def append(self, row: Mapping[str, Any]) -> None:
        """Writes one row (non-finite floats become null)."""
        if not self._still_ours():
            self._file.close()
            self._say(
                f"warning: {self.path} disappeared (deleted or replaced) while this run wrote it; "
                f"the rows before step {row.get('step')} went with it. Starting a new one."
            )
            self._open()
        self._file.write(json.dumps({k: _json_safe(v) for k, v in row.items()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Closes the file."""
        self._file.close()


# --------------------------------------------------------------------------- progress


class PlainProgress:
    """Progress as plain log lines (for files, CI logs, pipes)."""

    def __init__(self, total: int, initial: int, stream: TextIO) -> None:
        self._total, self._stream = total, stream

    def update(self, step: int, row: Mapping[str, Any] | None = None) -> None:
        """Prints the row, if any, as a log line."""
        if row is not None:
            print(f"[{step}/{self._total}] {format_row(row)}", file=self._stream, flush=True)

    def message(self, text: str) -> None:
        """Prints a line."""
        print(text, file=self._stream, flush=True)

    def close(self) -> None:
        """Nothing to close."""


class RichProgress:
    """A rich progress bar with the latest loss and tokens/s; rows also print above the bar."""

    def __init__(self, total: int, initial: int, stream: TextIO) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  tok/s {task.fields[tps]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(file=stream),
        )
        self._task = self._progress.add_task(
            "train", total=total, completed=initial, loss="-", tps="-"
        )
        self._progress.start()

    def update(self, step: int, row: Mapping[str, Any] | None = None) -> None:
        """Moves the bar to `step`; a row updates the loss and tokens/s fields and is printed."""
        fields = {}
        if row is not None and "loss" in row:
            fields = {"loss": f"{row['loss']:.4f}", "tps": f"{row.get('tokens_per_s', 0):.0f}"}
        if row is not None and "val_loss" in row:
            self._progress.console.print(format_row(row))
        self._progress.update(self._task, completed=step, **fields)

    def message(self, text: str) -> None:
        """Prints a line above the bar."""
        self._progress.console.print(text, highlight=False, markup=False)

    def close(self) -> None:
        """Stops the bar."""
        self._progress.stop()


def make_progress(
    mode: Literal["auto", "rich", "plain"],
    *,
    total: int,
    initial: int = 0,
    stream: TextIO | None = None,
) -> PlainProgress | RichProgress:
    """The progress display for `mode`; "auto" is rich on a terminal and plain otherwise."""
    stream = sys.stdout if stream is None else stream
    if mode not in ("auto", "rich", "plain"):
        raise ValueError(f"mode must be 'auto', 'rich' or 'plain', got {mode!r}")
    use_rich = mode == "rich" or (mode == "auto" and stream.isatty())
    cls = RichProgress if use_rich else PlainProgress
    return cls(total, initial, stream)


class RunOutputs:
    """A run's writers: metrics.jsonl, TensorBoard (process 0 only: one writer per run
    directory) and the progress display.

    Args:
        logging: the `logging:` section (TensorBoard on/off, progress kind).
        total_steps, start: the run's `train.steps` and the step it starts from.
        metrics_path, tensorboard_dir: where rows go.
        stream: where progress goes.
        primary: whether this process writes files.
    """

    def __init__(self, logging: Any, *, total_steps: int, start: int, metrics_path: Path,
                 tensorboard_dir: Path, stream: TextIO, primary: bool) -> None:  # fmt: skip
        self.progress = make_progress(
            logging.progress, total=total_steps, initial=start, stream=stream
        )
        self.metrics = MetricsFile(metrics_path, say=self.progress.message) if primary else None
        self.tensorboard = None
        if logging.tensorboard and primary:
            self.tensorboard = TensorBoard(tensorboard_dir, purge_step=start + 1 if start else None)

    def _append(self, row: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.append(row)
        if self.tensorboard is not None:
            self.tensorboard.write(row)

    def write(self, row: dict[str, Any]) -> None:
        """A training row: to metrics.jsonl, TensorBoard and the progress display."""
        self._append(row)
        self.progress.update(row["step"], row)

    def write_quant(self, row: dict[str, Any]) -> None:
        """A telemetry row: to metrics.jsonl and TensorBoard, its summary to the progress."""
        self._append(row)
        self.progress.message(f"[{row['step']}] {format_row(row)}")

    def close(self) -> None:
        self.progress.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
