"""Scoring a `Task` with a log-probability function, and the metrics (lm-eval's formulas).

Multiple choice: each choice's log-likelihood `ll_i = sum log p(continuation tokens | context)`
(the continuation is the task's delimiter + the choice: `Task.continuation`); `acc` is the
fraction of examples whose argmax of `ll_i` is the gold choice, `acc_norm` the same for
`ll_i / bytes_i` (the choice's length in UTF-8 bytes); each with its standard error
`sqrt(sum (x - mean)^2 / (n - 1)) / sqrt(n)`.
Rolling: `LL = sum over documents of sum log p(token | preceding tokens)`, then
`perplexity = exp(-LL / tokens)`, `word_perplexity = exp(-LL / words)`,
`byte_perplexity = exp(-LL / bytes)`, `bits_per_byte = -LL / (bytes * ln 2)`.

Example:
    >>> multiple_choice_metrics([[-1.0, -2.0], [-3.0, -0.5]], [0, 0], [[1, 1], [1, 1]])["acc"]
    0.5
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from nvfp4_train.tasks.task_error import TaskError
from nvfp4_train.tasks.task_files import MULTIPLE_CHOICE, Task
from nvfp4_train.tasks.windows import (
    LogProbFn,
    Window,
    choice_window,
    encode_pair,
    rolling_windows,
    score_windows,
)


class TaskTokenizer(Protocol):
    """What scoring needs of a tokenizer (`nvfp4_train.data.Tokenizer` has it)."""

    @property
    def eos_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...


@dataclasses.dataclass(frozen=True)
class TaskResult:
    """One task's scores.

    Attributes:
        name, path, kind: the task's.
        metrics: {metric: value} (see the module docstring), plus `examples`, `truncated` and
            `continuations_cut`.
        loglikelihoods: per example, its choices' summed log-probabilities (multiple choice) or
            per document its summed log-probability (rolling), float64.
    """

    name: str
    path: str
    kind: str
    metrics: dict[str, Any]
    loglikelihoods: tuple


def mean_stderr(values: Sequence[float]) -> float | None:
    """Standard error of the mean (sample standard deviation / sqrt(n)); None for n < 2."""
    x = np.asarray(values, np.float64)
    return None if len(x) < 2 else float(np.std(x, ddof=1) / math.sqrt(len(x)))


def multiple_choice_metrics(
    loglikelihoods: Sequence[Sequence[float]],
    gold: Sequence[int],
    choice_bytes: Sequence[Sequence[int]],
) -> dict[str, Any]:
    """acc, acc_norm and their standard errors (ties go to the first choice, as `np.argmax`)."""
    hits, norm_hits = [], []
    for lls, answer, sizes in zip(loglikelihoods, gold, choice_bytes, strict=True):
        lls = np.asarray(lls, np.float64)
        hits.append(float(np.argmax(lls) == answer))
        norm_hits.append(float(np.argmax(lls / np.asarray(sizes, np.float64)) == answer))
    return {
        "acc": float(np.mean(hits)),
        "acc_stderr": mean_stderr(hits),
        "acc_norm": float(np.mean(norm_hits)),
        "acc_norm_stderr": mean_stderr(norm_hits),
    }


def word_count(text: str) -> int:
    """Words as lm-eval counts them for word perplexity: `len(re.split(r"\\s+", text))`."""
    return len(re.split(r"\s+", text))


def rolling_metrics(
    loglikelihoods: Sequence[float], tokens: Sequence[int], documents: Sequence[str]
) -> dict[str, Any]:
    """perplexity (per scored token), word_perplexity, byte_perplexity, bits_per_byte."""
    total = float(np.sum(np.asarray(loglikelihoods, np.float64)))
    n_bytes = sum(len(d.encode("utf-8")) for d in documents)
    return {
        "perplexity": math.exp(-total / sum(tokens)),
        "word_perplexity": math.exp(-total / sum(word_count(d) for d in documents)),
        "byte_perplexity": math.exp(-total / n_bytes),
        "bits_per_byte": -total / (n_bytes * math.log(2)),
        "loglikelihood": total,
        "tokens": int(sum(tokens)),
    }


def score_task(
    task: Task,
    tokenizer: TaskTokenizer,
    logprob_fn: LogProbFn,
    *,
    seq_len: int,
    batch_size: int,
    on_batch: Callable[[int, int], None] | None = None,
) -> TaskResult:
    """Scores `task` with `logprob_fn` over fixed [batch_size, seq_len] batches.

    A multiple-choice context with no tokens is the tokenizer's `eos_id` (lm-eval's start of
    text); a rolling document starts with `eos_id` too (the separator the run's documents
    followed), or, without one, its first token is context only. Requests longer than fit are
    cut from the left (lm-eval's rule); `metrics["truncated"]` counts the (example, choice)
    requests cut, `metrics["continuations_cut"]` those of them whose choice itself lost tokens
    (only its last `seq_len` tokens scored): one long item never stops a task.

    Raises:
        TaskError: an example that cannot be scored (an empty choice, an empty context without
            an eos token), naming it.
    """
    if task.kind == MULTIPLE_CHOICE:
        windows, gold, sizes = [], [], []
        for example in task.examples:
            for choice in example.choices:
                continuation = task.continuation(choice)
                windows.append(
                    request_window(tokenizer, example.context, continuation, seq_len, example.where)
                )
            gold.append(example.gold)
            sizes.append([max(1, len(c.encode("utf-8"))) for c in example.choices])
        sums, _ = score_windows(windows, logprob_fn, batch_size=batch_size, seq_len=seq_len,
                                on_batch=on_batch)  # fmt: skip
        lls, start = [], 0
        for example in task.examples:
            lls.append(tuple(float(v) for v in sums[start : start + len(example.choices)]))
            start += len(example.choices)
        metrics = multiple_choice_metrics(lls, gold, sizes)
        truncated = sum(w.truncated for w in windows)
        cut = sum(w.unscored > 0 for w in windows)
    else:
        per_doc = [document_windows(tokenizer, d, seq_len) for d in task.documents]
        windows = [w for ws in per_doc for w in ws]
        sums, _ = score_windows(windows, logprob_fn, batch_size=batch_size, seq_len=seq_len,
                                on_batch=on_batch)  # fmt: skip
        lls, tokens, start = [], [], 0
        for ws in per_doc:
            lls.append(float(np.sum(sums[start : start + len(ws)])))
            tokens.append(sum(w.scored for w in ws))
            start += len(ws)
        if sum(tokens) == 0:
            raise TaskError(f"{task.path}: the documents hold no token to score")
        metrics = rolling_metrics(lls, tokens, task.documents)
        truncated = cut = 0
    metrics |= {"examples": len(task), "truncated": int(truncated), "continuations_cut": int(cut)}
    return TaskResult(task.name, task.path, task.kind, metrics, tuple(lls))


def request_window(
    tokenizer: TaskTokenizer, context: str, continuation: str, seq_len: int, where: str
) -> Window:
    """The window scoring `continuation` after `context` (an empty context: the eos token).

    Raises:
        TaskError: naming `where`: an empty continuation, an empty context without an eos
            token.
    """
    if not continuation.strip():
        raise TaskError(f"{where}: an empty continuation {continuation!r} cannot be scored")
    context_ids, continuation_ids = encode_pair(tokenizer.encode, context, continuation)
    if not context_ids:
        if tokenizer.eos_id is None:
            raise TaskError(f"{where}: empty context and the tokenizer has no eos token")
        context_ids = [tokenizer.eos_id]
    if not continuation_ids:
        raise TaskError(f"{where}: {continuation!r} encodes to no token")
    return choice_window(context_ids, continuation_ids, seq_len)


def document_windows(tokenizer: TaskTokenizer, text: str, seq_len: int) -> list[Window]:
    """The rolling windows of one document, after the eos token when the tokenizer has one."""
    prefix = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    return rolling_windows(prefix + list(tokenizer.encode(text)), seq_len)
