"""Downstream tasks scored with a run's own model: `evaluate_run_tasks` (the `nvfp4-train eval
RUN --tasks FILE ...` command) and `TaskScorer` (the training loop's `eval.tasks`).

The model scores every target of fixed [batch, model.max_seq_len] batches in one compiled
program (`step.make_score_step`: the training forward and loss, with the recipes of the forward
chosen); `nvfp4_train.tasks` turns those scores into metrics (docs/eval.md).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import jax
import numpy as np

from nvfp4_train.errors import ConfigError
from nvfp4_train.observe.output_files import refuse_existing
from nvfp4_train.tasks import Task, TaskError, TaskResult, load_task, score_task
from nvfp4_train.tasks.scoring import document_windows, request_window
from nvfp4_train.tasks.windows import score_windows
from nvfp4_train.training.evaluation import EVAL_FORWARDS, eval_graphdef, newest_state, opened_run
from nvfp4_train.training.step import make_score_step

TABLE_METRICS = ("acc", "acc_norm", "perplexity", "word_perplexity", "bits_per_byte")


def load_tasks(paths: Sequence[str | Path]) -> list[Task]:
    """The tasks of `paths`, in order.

    Raises:
        TaskError: a file that cannot be read as a task, or two tasks of one name.
    """
    tasks = [load_task(p) for p in paths]
    names = [t.name for t in tasks]
    for task in tasks:
        if names.count(task.name) > 1:
            others = [t.path for t in tasks if t.name == task.name]
            raise TaskError(f"two tasks are named {task.name!r}: {', '.join(others)}")
    return tasks


def logprob_function(graphdef: Any, params: Any, *, seed: int) -> Callable:
    """`logprob_fn(inputs, targets) -> (log p [B, L], greedy [B, L])` as NumPy arrays, of the
    model `graphdef` with `params` (jitted once per shape)."""
    step = jax.jit(make_score_step(graphdef, seed=seed))

    def logprob_fn(inputs_BxL: np.ndarray, targets_BxL: np.ndarray):
        logp_BxL, greedy_BxL = step(params, inputs_BxL, targets_BxL)
        return np.asarray(logp_BxL), np.asarray(greedy_BxL)

    return logprob_fn


def score_tasks(
    tasks: Sequence[Task], tokenizer: Any, logprob_fn: Callable, *, seq_len: int,
    batch_size: int, progress: Callable[[str, int, int], None] | None = None,
) -> list[TaskResult]:  # fmt: skip
    """Each task's `TaskResult`; `progress(task name, done, total)` after each batch."""
    results = []
    for task in tasks:
        on_batch = None if progress is None else (lambda d, t, n=task.name: progress(n, d, t))
        results.append(score_task(task, tokenizer, logprob_fn, seq_len=seq_len,
                                  batch_size=batch_size, on_batch=on_batch))  # fmt: skip
    return results


def task_row(results: Sequence[TaskResult]) -> dict[str, float]:
    """The metrics of `results` as metrics-row fields `task/<name>/<metric>` (numbers only)."""
    row = {}
    for result in results:
        for metric, value in result.metrics.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                row[f"task/{result.name}/{metric}"] = value
    return row


def format_table(results: Sequence[TaskResult]) -> str:
    """A text table: one line per task and metric (value, +- standard error where it has one)."""
    lines = [f"{'task':<24} {'metric':<16} {'value':>10} {'stderr':>9} {'n':>6} {'trunc':>6}"]
    for result in results:
        m = result.metrics
        for metric in (k for k in TABLE_METRICS if k in m):
            err = m.get(f"{metric}_stderr")
            err = "" if err is None else f"{err:.4f}"
            lines.append(f"{result.name:<24} {metric:<16} {m[metric]:>10.4f} {err:>9} "
                         f"{m['examples']:>6} {m['truncated']:>6}")  # fmt: skip
    for result in results:
        if result.metrics.get("continuations_cut"):
            lines.append(f"note: {result.name}: {result.metrics['continuations_cut']} choice(s) "
                         "longer than a row were scored on their last tokens only "
                         "(continuations_cut)")  # fmt: skip
    return "\n".join(lines)


def results_document(results: Sequence[TaskResult], **about: Any) -> dict[str, Any]:
    """The JSON `-o` writes: `about` (run, step, forward, ...) and per task its metrics."""
    tasks = {r.name: {"path": r.path, "kind": r.kind, **r.metrics} for r in results}
    return {**about, "tasks": _json_safe(tasks)}


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class _Progress:
    """A rich bar on a terminal (stderr), nothing otherwise."""

    def __init__(self, stream: TextIO) -> None:
        self._bar, self._tasks = None, {}
        if stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), console=Console(file=stream))  # fmt: skip
            self._bar.start()

    def __call__(self, name: str, done: int, total: int) -> None:
        if self._bar is None:
            return
        if name not in self._tasks:
            self._tasks[name] = self._bar.add_task(name, total=total)
        self._bar.update(self._tasks[name], completed=done)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


class RunScorer(NamedTuple):
    """What scores requests with a run's checkpoint: its tokenizer, `logprob_fn` (see
    `nvfp4_train.tasks.windows.LogProbFn`), the row length `seq_len` (`model.max_seq_len`), the
    checkpoint's step and the run's config."""

    tokenizer: Any
    logprob_fn: Callable
    seq_len: int
    step: int
    config: Any


def run_scorer(run_dir: str | Path, *, forward: str = "run", stream: TextIO | None = None):
    """The `RunScorer` of the newest readable checkpoint of `run_dir` with `forward` (as
    `evaluation.evaluate_run`'s: "run", "quantized" or "bf16").

    Raises:
        ConfigError: not a run directory, or no readable checkpoint.
        ValueError: `forward` is not one of `EVAL_FORWARDS`.
    """
    stream = sys.stdout if stream is None else stream
    with opened_run(run_dir, forward) as (cfg, datasets, run_dir):
        graphdef, restored = newest_state(cfg, run_dir, stream)
    model = eval_graphdef(cfg, graphdef, forward, restored.step)
    logprob_fn = logprob_function(model, restored.state.params, seed=cfg.train.seed)
    return RunScorer(datasets.tokenizer, logprob_fn, cfg.model.max_seq_len, restored.step, cfg)


class RequestScorer:
    """Scores lm-evaluation-harness style requests with a `RunScorer`, over the same windows,
    batches and sums as the task files (`nvfp4_train.tasks`), in request order.

    Args:
        scorer: a run's `RunScorer` (`run_scorer`).
        batch_size: rows per scoring batch.
    """

    def __init__(self, scorer: RunScorer, batch_size: int = 8) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.scorer, self.batch_size = scorer, batch_size

    def _score(self, windows: list) -> tuple[np.ndarray, np.ndarray]:
        return score_windows(windows, self.scorer.logprob_fn, batch_size=self.batch_size,
                             seq_len=self.scorer.seq_len)  # fmt: skip

    def loglikelihood(self, requests: Sequence[tuple[str, str]]) -> list[tuple[float, bool]]:
        """(log p(continuation | context), whether every continuation token is the argmax) of
        each (context, continuation); contexts cut from the left to fit a row."""
        tok, seq_len = self.scorer.tokenizer, self.scorer.seq_len
        windows = [request_window(tok, context, continuation, seq_len, f"request {i}")
                   for i, (context, continuation) in enumerate(requests)]  # fmt: skip
        sums, greedy = self._score(windows)
        return [(float(s), bool(g)) for s, g in zip(sums, greedy, strict=True)]

    def loglikelihood_rolling(self, texts: Sequence[str]) -> list[float]:
        """log p(text) of each text, every token scored once (after the eos token when the
        tokenizer has one), in rolling windows of `seq_len`."""
        per_text = [document_windows(self.scorer.tokenizer, t, self.scorer.seq_len) for t in texts]
        sums, _ = self._score([w for ws in per_text for w in ws])
        out, start = [], 0
        for ws in per_text:
            out.append(float(np.sum(sums[start : start + len(ws)])))
            start += len(ws)
        return out


def evaluate_run_tasks(
    run_dir: str | Path, task_paths: Sequence[str | Path], *, forward: str = "run",
    batch_size: int = 8, output: str | Path | None = None, stream: TextIO | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Scores the tasks of `task_paths` with the newest checkpoint of `run_dir`.

    Prints a table; with `output`, writes `results_document` there as JSON (a file that exists
    is not overwritten). `forward` as `evaluation.evaluate_run`'s ("run": the recipes of the
    checkpoint step's precision phase; "quantized"; "bf16").

    Raises:
        TaskError: a task file that cannot be read or scored.
        ConfigError: not a run directory, no checkpoint, an `output` that exists or whose
            directory does not, or a `batch_size` < 1.
    """
    if forward not in EVAL_FORWARDS:
        raise ValueError(f"forward must be one of {EVAL_FORWARDS}, got {forward!r}")
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
    if output is not None:
        refuse_existing(output)
    if output is not None and not Path(output).parent.is_dir():
        raise ConfigError(f"-o {str(output)!r}: the directory {str(Path(output).parent)!r} does "
                          "not exist (checked before scoring)")  # fmt: skip
    stream = sys.stdout if stream is None else stream
    tasks = load_tasks(task_paths)  # task mistakes before anything slow
    for line in (w for task in tasks for w in task.warnings()):
        print(line, file=stream, flush=True)
    scorer = run_scorer(run_dir, forward=forward, stream=stream)
    progress = _Progress(sys.stderr)
    try:
        results = score_tasks(tasks, scorer.tokenizer, scorer.logprob_fn, seq_len=scorer.seq_len,
                              batch_size=batch_size, progress=progress)  # fmt: skip
    finally:
        progress.close()
    document = results_document(results, run_dir=str(run_dir), step=scorer.step, forward=forward,
                                seq_len=scorer.seq_len, batch_size=batch_size)  # fmt: skip
    print(f"step {scorer.step}, forward {forward}", file=stream)
    print(format_table(results), file=stream, flush=True)
    if output is not None:
        Path(output).write_text(json.dumps(document, indent=2) + "\n")
        print(f"wrote {output}", file=stream, flush=True)
    return document


class TaskScorer:
    """The training loop's `eval.tasks`: the tasks read once, scored at every validation with
    the forward of the step's precision phase.

    Args:
        tasks: the loaded tasks.
        tokenizer: the run's (`Datasets.tokenizer`).
        seq_len: `model.max_seq_len`.
        batch_size: `eval.batch_size`.
        seed: `train.seed` (the eval step's key).
    """

    def __init__(self, tasks: Sequence[Task], tokenizer: Any, *, seq_len: int, batch_size: int,
                 seed: int) -> None:  # fmt: skip
        self.tasks, self.tokenizer = list(tasks), tokenizer
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self._steps: dict[int, tuple[Any, Callable]] = {}

    def row(self, graphdef: Any, params: Any) -> dict[str, float]:
        """`task_row` of every task scored by `graphdef` with `params` (one compiled program per
        distinct graphdef)."""
        key = id(graphdef)  # the graphdef is kept with its step, so the id stays its own
        if key not in self._steps:
            self._steps[key] = (graphdef, jax.jit(make_score_step(graphdef, seed=self.seed)))
        step = self._steps[key][1]

        def logprob_fn(inputs_BxL, targets_BxL):
            logp_BxL, greedy_BxL = step(params, inputs_BxL, targets_BxL)
            return np.asarray(logp_BxL), np.asarray(greedy_BxL)

        results = score_tasks(self.tasks, self.tokenizer, logprob_fn, seq_len=self.seq_len,
                              batch_size=self.batch_size)  # fmt: skip
        return task_row(results)
