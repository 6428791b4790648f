"""`cadence.due`: what the loop does at each step, as a pure function of the intervals."""

from __future__ import annotations

from nvfp4_train.config.run_config import CheckpointConfig, LoggingConfig, TrainConfig
from nvfp4_train.training.cadence import Due, due


def _steps(train, checkpoint, logging, validation=True):
    return {s: due(s, train, checkpoint, logging, validation=validation) for s in range(1, 31)}


def test_intervals_and_the_last_step():
    train = TrainConfig(steps=30, log_every=4, eval_every=10)
    plan = _steps(train, CheckpointConfig(every_steps=12), LoggingConfig(quant_stats_every=7))
    assert [s for s, d in plan.items() if d.row] == [4, 8, 10, 12, 16, 20, 24, 28, 30]
    assert [s for s, d in plan.items() if d.evaluate] == [10, 20, 30]
    assert [s for s, d in plan.items() if d.checkpoint] == [12, 24, 30]
    assert [s for s, d in plan.items() if d.probe] == [7, 14, 21, 28]
    assert plan[30] == Due(row=True, evaluate=True, checkpoint=True, probe=False)


def test_zero_intervals_and_no_validation():
    train = TrainConfig(steps=30, log_every=100, eval_every=0)
    plan = _steps(train, CheckpointConfig(every_steps=0), LoggingConfig(), validation=False)
    assert [s for s, d in plan.items() if d.row] == [30]
    assert not any(d.evaluate or d.probe for d in plan.values())
    assert [s for s, d in plan.items() if d.checkpoint] == [30]
    with_val = _steps(TrainConfig(steps=30, eval_every=0), CheckpointConfig(), LoggingConfig())
    assert [s for s, d in with_val.items() if d.evaluate] == [30]  # eval_every 0: only at the end
