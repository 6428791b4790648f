"""When the training loop does what: metrics rows, evaluations, checkpoints and telemetry probes.

`due(step, ...)` is a pure function of the step and the config sections that set the intervals,
so the loop asks it once per step instead of testing intervals inline.

Example:
    >>> from nvfp4_train.config.run_config import CheckpointConfig, LoggingConfig, TrainConfig
    >>> due(100, TrainConfig(steps=300), CheckpointConfig(every_steps=100), LoggingConfig(),
    ...     validation=True)
    Due(row=True, evaluate=True, checkpoint=True, probe=False)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from nvfp4_train.config.run_config import CheckpointConfig, LoggingConfig, TrainConfig


class Due(NamedTuple):
    """What happens at one step (besides the step itself).

    Attributes:
        row: a metrics row is written (every `train.log_every`, at evaluations, at the end).
        evaluate: the validation loss is computed (every `train.eval_every`, at the end; only
            with a validation split).
        checkpoint: a checkpoint is saved (every `checkpoint.every_steps`, at the end).
        probe: the quantization telemetry runs before the step (`logging.quant_stats_every`).
    """

    row: bool
    evaluate: bool
    checkpoint: bool
    probe: bool


def _every(step: int, interval: int) -> bool:
    return bool(interval) and step % interval == 0


def due(
    step: int,
    train: TrainConfig,
    checkpoint: CheckpointConfig,
    logging: LoggingConfig,
    *,
    validation: bool,
) -> Due:
    """What is due at `step` (1-based) of a run of `train.steps` steps; `validation`: whether
    the run has validation batches."""
    last = step == train.steps
    evaluate = validation and (last or _every(step, train.eval_every))
    return Due(
        row=last or evaluate or _every(step, train.log_every),
        evaluate=evaluate,
        checkpoint=last or _every(step, checkpoint.every_steps),
        probe=_every(step, logging.quant_stats_every),
    )
