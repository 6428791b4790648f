"""`EvalConfig`: the `eval:` section, the downstream tasks a run scores beside its validation
loss (at every `train.eval_every` and at the end)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Downstream evaluation during training (docs/eval.md).

    Attributes:
        tasks: task files (JSONL, lm-evaluation-harness YAML, BIG-bench `task.json`, text),
            scored with the run's forward of the step at every validation; relative paths from
            the directory the run is started in. Their metrics join the validation rows of
            `metrics.jsonl` as `task/<name>/<metric>`.
        batch_size: rows per scoring batch (each row holds `model.max_seq_len` tokens).
    """

    tasks: tuple[str, ...] = ()
    batch_size: int = 8

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"eval.batch_size must be >= 1, got {self.batch_size}")
        empty = [i for i, path in enumerate(self.tasks) if not path.strip()]
        if empty:
            raise ValueError(f"eval.tasks[{empty[0]}] must be a file path, got ''")
        if len(set(self.tasks)) != len(self.tasks):
            raise ValueError(f"eval.tasks must not repeat a file, got {list(self.tasks)}")
