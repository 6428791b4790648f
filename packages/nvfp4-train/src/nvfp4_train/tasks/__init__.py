"""Downstream tasks: task files (JSONL, lm-evaluation-harness YAML, BIG-bench `task.json`,
text), their token windows and fixed-shape batches, and the metrics (docs/eval.md).

Pure NumPy: the model is a `logprob_fn(inputs, targets)` passed in (`training.downstream`
builds it from a run).
"""

from nvfp4_train.tasks.scoring import (
    TaskResult,
    mean_stderr,
    multiple_choice_metrics,
    rolling_metrics,
    score_task,
)
from nvfp4_train.tasks.task_error import TaskError
from nvfp4_train.tasks.task_files import (
    MULTIPLE_CHOICE,
    ROLLING,
    ChoiceExample,
    Task,
    load_task,
)
from nvfp4_train.tasks.windows import Window, choice_window, encode_pair, rolling_windows

__all__ = [
    "MULTIPLE_CHOICE",
    "ROLLING",
    "ChoiceExample",
    "Task",
    "TaskError",
    "TaskResult",
    "Window",
    "choice_window",
    "encode_pair",
    "load_task",
    "mean_stderr",
    "multiple_choice_metrics",
    "rolling_metrics",
    "rolling_windows",
    "score_task",
]
