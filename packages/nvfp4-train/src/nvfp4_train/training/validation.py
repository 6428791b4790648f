"""The validation side of a run: its batches, the mean loss over them, and the reference tokens.

`eval_batches` picks the batches a run evaluates on, `evaluate` averages a jitted eval step's
loss over them (nats per token), and `reference_tokens` are the tokens whose logits every
checkpoint stores (`reference` item), so that an export can be checked against training.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from nvfp4_train.config.run_config import Config
from nvfp4_train.mesh.sharding import host_value


def evaluate(eval_step: Callable, params: Any, batches: Sequence[dict]) -> float:
    """Mean validation loss (nats per token) over `batches`."""
    loss_sum, tokens = 0.0, 0.0
    for batch in batches:
        batch_loss, batch_tokens = eval_step(params, batch)
        loss_sum += float(host_value(batch_loss))
        tokens += float(host_value(batch_tokens))
    if tokens == 0:
        raise ValueError("batches must hold at least one target token, got none")
    return loss_sum / tokens


def reference_tokens(cfg: Config, datasets: Any) -> np.ndarray | None:
    """int32 [n, L] tokens of the checkpoints' `reference` item, or None.

    The first `checkpoint.reference_sequences` validation sequences (the same on every process),
    cut to `L = min(train.seq_len, 64)` tokens; None when that is 0 or there is no validation split.
    """
    n = min(cfg.checkpoint.reference_sequences, len(datasets.validation_sequences))
    if n == 0:
        return None
    length = min(cfg.train.seq_len, 64)
    rows = [datasets.validation_sequences[i]["inputs"][:length] for i in range(n)]
    return np.stack(rows).astype(np.int32)


def eval_batches(cfg: Config, datasets: Any) -> list[dict]:
    """The validation batches a run evaluates on (the first `train.eval_batches`, or all)."""
    batches = list(datasets.validation_batches())
    return batches if cfg.train.eval_batches is None else batches[: cfg.train.eval_batches]
