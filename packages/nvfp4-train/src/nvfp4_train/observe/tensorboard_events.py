"""A run's metrics rows as TensorBoard events (tensorboardX, imported on first use).

`nvfp4_train.observe.metrics` re-exports `TensorBoard`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


class TensorBoard:
    """Scalars of each metrics row as TensorBoard events (tensorboardX) under `logdir`.

    Args:
        logdir: the event file directory.
        purge_step: on resume, the first step to be written again (older events after it are hidden).
    """

    def __init__(self, logdir: str | Path, *, purge_step: int | None = None) -> None:
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(logdir=str(logdir), purge_step=purge_step)

    def write(self, row: Mapping[str, Any]) -> None:
        """Adds every numeric field but `step` as a scalar at `row['step']`; an MoE row's block
        statistics as `moe/<block>/<stat>` (`moe/<block>/load/<expert>`), a telemetry row's
        SSM statistics as `ssm/<block>/<stat>`; a telemetry row's
        values as `quant/<path>/<role>/<stat>` (non-finite ones too, nulls skipped; an expert's
        `path[e]` as `path/e`, TensorBoard's tags allowing no brackets)."""
        step = int(row["step"])
        for key, value in row.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                self._writer.add_scalar(_tensorboard_tag(key), value, step)
        for group, block, stats in _block_stats(row):
            for stat, value in stats.items():
                values = value if isinstance(value, list) else [value]
                for e, v in enumerate(values):
                    name = f"{group}/{block}/{stat}" + (f"/{e}" if isinstance(value, list) else "")
                    if v is not None:
                        self._writer.add_scalar(name, v, step)
        for path, roles in row.get("quant", {}).items():
            name = path[:-1].replace("[", "/") if path.endswith("]") else path
            for role, values in roles.items():
                for stat, value in values.items():
                    if value is not None:
                        self._writer.add_scalar(f"quant/{name}/{role}/{stat}", value, step)
        self._writer.flush()

    def close(self) -> None:
        """Flushes and closes the event file."""
        self._writer.close()


def _tensorboard_tag(key: str) -> str:
    """A row field's TensorBoard tag: `val/loss`, `task/<name>/<metric>` as it is, `train/<key>`."""
    if key == "val_loss":
        return "val/loss"
    return key if key.startswith("task/") else f"train/{key}"


def _block_stats(row: Mapping[str, Any]):
    """(group, block, {stat: value}) of a row's per-block `moe` and `ssm` statistics."""
    for group in ("moe", "ssm"):
        for block, stats in row.get(group, {}).items():
            yield group, block, stats
