"""Token windows: what one row of a scoring batch holds, and the fixed-shape batches of them.

A `Window` is a run of tokens whose last targets are scored: row inputs `tokens[:-1]`, targets
`tokens[1:]`, the log-probabilities of targets `score_from:` summed. A multiple-choice request
(context, continuation) is one window, cut from the left to `seq_len + 1` tokens when longer (as
lm-evaluation-harness does: a continuation longer than the row loses its first tokens, and the
rest is scored); a document scored by rolling log-likelihood is a series of windows
that predict each token once (lm-eval's `get_rolling_token_windows` with `context_len=1`).

Example:
    >>> w = choice_window([5, 6, 7], [8, 9], seq_len=3)
    >>> (w.tokens.tolist(), w.score_from, w.truncated)
    ([6, 7, 8, 9], 1, True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

import numpy as np

LogProbFn = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]
"""`logprob_fn(inputs int32 [B, L], targets int32 [B, L]) -> (float32 [B, L] log p(target),
bool [B, L] target is the argmax)`: the model's scores of every target position."""


@dataclasses.dataclass(frozen=True)
class Window:
    """tokens: int32 [n + 1] (n <= seq_len); score_from: the first scored target index;
    truncated: tokens were cut from the left to fit; unscored: continuation tokens among those
    cut (a continuation longer than the row: only its last `seq_len` tokens are scored)."""

    tokens: np.ndarray
    score_from: int
    truncated: bool = False
    unscored: int = 0

    @property
    def scored(self) -> int:
        return len(self.tokens) - 1 - self.score_from


def encode_pair(encode: Callable[[str], list[int]], context: str, continuation: str):
    """(context ids, continuation ids) as lm-eval's `_encode_pair`: trailing spaces of the
    context move to the continuation, and the continuation is what `encode(context +
    continuation)` holds past `encode(context)`."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = list(encode(context + continuation))
    context_ids = list(encode(context))
    return context_ids, whole[len(context_ids) :]


def choice_window(context: Sequence[int], continuation: Sequence[int], seq_len: int) -> Window:
    """The window scoring `continuation` after `context`, cut from the left to `seq_len + 1`
    (lm-evaluation-harness's `(context + continuation)[-(max_length + 1):]`): a continuation
    longer than `seq_len` keeps its last `seq_len` tokens scored (`Window.unscored` says how
    many were cut).

    Raises:
        ValueError: `continuation` or `context` is empty.
    """
    if not continuation or not context:
        raise ValueError(
            f"context and continuation must each hold a token, got {len(context)} and "
            f"{len(continuation)}"
        )
    tokens = np.asarray([*context, *continuation], np.int32)
    truncated = len(tokens) > seq_len + 1
    tokens = tokens[-(seq_len + 1) :]
    score_from = max(0, len(tokens) - 1 - len(continuation))
    unscored = len(continuation) - (len(tokens) - 1 - score_from)
    return Window(tokens, score_from, truncated, unscored)


def rolling_windows(ids: Sequence[int], seq_len: int) -> list[Window]:
    """Windows that score `ids[1:]` once each: the first `seq_len` after `ids[0]`, then up to
    `seq_len` more per window, each with the `seq_len` tokens before its last target as inputs.
    (Put a document-start token first to score a document's first token.)"""
    all_ids = np.asarray(ids, np.int32)
    windows, first = [], 1
    while first < len(all_ids):
        end = min(len(all_ids), first + seq_len)
        start = max(0, end - 1 - seq_len)
        windows.append(Window(all_ids[start:end], first - 1 - start))
        first = end
    return windows


def batches(
    windows: Sequence[Window], batch_size: int, seq_len: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(inputs, targets) int32 [batch_size, seq_len] of consecutive windows, zero-padded (rows
    and positions past a window are zeros, which never reach a scored target: attention is
    causal)."""
    for first in range(0, len(windows), batch_size):
        inputs = np.zeros((batch_size, seq_len), np.int32)
        targets = np.zeros((batch_size, seq_len), np.int32)
        for row, window in enumerate(windows[first : first + batch_size]):
            n = len(window.tokens) - 1
            inputs[row, :n] = window.tokens[:-1]
            targets[row, :n] = window.tokens[1:]
        yield inputs, targets


def score_windows(
    windows: Sequence[Window],
    logprob_fn: LogProbFn,
    *,
    batch_size: int,
    seq_len: int,
    on_batch: Callable[[int, int], None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(float64 [n] summed log p of each window's scored targets, bool [n] all of them greedy).

    Sums run on the host in float64 over the float32 token scores, in position order, so a
    window's sum does not depend on the device's reduction order. `on_batch(done, total)`
    (windows) is called after each batch (a progress bar)."""
    sums = np.zeros(len(windows), np.float64)
    greedy = np.zeros(len(windows), bool)
    for b, (inputs, targets) in enumerate(batches(windows, batch_size, seq_len)):
        logp_BxL, greedy_BxL = logprob_fn(inputs, targets)
        logp_BxL, greedy_BxL = np.asarray(logp_BxL), np.asarray(greedy_BxL)
        rows = windows[b * batch_size : (b + 1) * batch_size]
        for row, window in enumerate(rows):
            scored = slice(window.score_from, len(window.tokens) - 1)
            sums[b * batch_size + row] = np.sum(logp_BxL[row, scored].astype(np.float64))
            greedy[b * batch_size + row] = bool(np.all(greedy_BxL[row, scored]))
        if on_batch is not None:
            on_batch(b * batch_size + len(rows), len(windows))
    return sums, greedy
