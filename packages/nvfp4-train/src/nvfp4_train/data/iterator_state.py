"""Restoring a training iterator from a checkpoint, and saying which setting changed when it cannot.

The iterator's state (grain's, a small JSON blob) records the position in the run's data order
and what that order depends on: the sampler (the number of sequences, the shuffle seed, the
process sharding), the data source (the corpus's size and content fingerprint, `seq_len`, the
vocabulary, a mixture's weights and rows) and the worker count. grain refuses a state whose
record differs from the fresh iterator's with a `ValueError` that prints both descriptions;
`restore_iterator_state` checks first and names the setting instead: `train.seed changed (0 in the
checkpoint, 1 now)`.

Example:
    >>> changed_settings(
    ...     {"sampler": "IndexSampler(num_records=9, seed=0)", "data_source": "P(seq_len=8)"},
    ...     {"sampler": "IndexSampler(num_records=9, seed=1)", "data_source": "P(seq_len=8)"},
    ... )
    ['train.seed (0 in the checkpoint, 1 now)']
"""

import json
import re
from typing import Any

from nvfp4_train.errors import DataError

_CORPUS = "the corpus (data.source, data.path or data.mixture, the files, data.validation_fraction)"
SETTINGS = {
    "worker_count": "data.num_workers",
    "seed": "train.seed",
    "seq_len": "train.seq_len",
    "weights": "data.mixture weights",
    "shuffle": "data.shuffle",
    "rows": "train.batch_size",
    "process": "the number of JAX processes",
    "shard_count": "the number of JAX processes",
    "vocab_size": "the vocabulary (the tokenizer, data.tokens_vocab_size)",
    "tokens": _CORPUS,
    "fingerprint": _CORPUS,
    "num_records": f"the number of training sequences: {_CORPUS}, or train.seq_len",
}
"""What each recorded value depends on, most specific first."""
_PAIR = re.compile(r"(\w+)=([^,()\s;]+)")
_WEIGHT = re.compile(r"([-+.\w]+): \w+\(")


def _values(state: dict) -> dict[str, str]:
    """The recorded values of a grain iterator state, by `SETTINGS` key (repeated keys joined)."""
    described = f"{state.get('sampler', '')} {state.get('data_source', '')}"
    values: dict[str, list[str]] = {}
    for key, value in _PAIR.findall(described):
        if value != "None":  # unset (a mixture's sampler has no seed: the source holds it)
            values.setdefault(key, []).append(value)
    source = str(state.get("data_source", ""))
    weights = _WEIGHT.findall(source)
    found = {key: ", ".join(v) for key, v in values.items()}
    found["worker_count"] = str(state.get("worker_count"))
    found["kind"] = source.split("(", 1)[0]
    found["weights"] = ", ".join(weights)
    found["sources"] = str(len(weights))
    return found


def _mixture(values: dict[str, str]) -> str:
    return f"{values['sources']} sources" if values["kind"] == "MixedSequences" else "none"


def changed_settings(saved: dict, current: dict) -> list[str]:
    """The settings whose recorded values differ between two grain iterator states, with both
    values; a change that others explain (the number of sequences after `seq_len`) is left out."""
    before, now = _values(saved), _values(current)
    if (before["kind"], before["sources"]) != (now["kind"], now["sources"]):  # another structure
        return [f"data.mixture ({_mixture(before)} in the checkpoint, {_mixture(now)} now)"]
    changed, explained = [], set()
    for key, setting in SETTINGS.items():
        if before.get(key) == now.get(key) or setting in explained:
            continue
        if key == "num_records" and changed:
            continue
        explained.add(setting)
        unit = " tokens" if key == "tokens" else ""
        changed.append(
            f"{setting} ({before.get(key)}{unit} in the checkpoint, {now.get(key)}{unit} now)"
        )
    return changed


def restore_iterator_state(iterator: Any, saved: bytes) -> None:
    """`iterator.set_state(saved)` (a grain `DataLoaderIterator`), after checking that the state
    belongs to the same data order.

    Raises:
        DataError: the checkpoint's data order was built from other settings; names each.
    """
    current = json.loads(iterator.get_state())
    try:
        recorded = json.loads(saved)
    except (ValueError, TypeError):
        recorded = None
    if isinstance(recorded, dict):
        keys = ("worker_count", "sampler", "data_source")
        if any(recorded.get(k) != current.get(k) for k in keys):
            changed = changed_settings(recorded, current) or [
                f"the data pipeline ({recorded.get('data_source')} in the checkpoint, "
                f"{current.get('data_source')} now)"
            ]
            raise DataError(
                f"cannot resume the training data from the checkpoint: {'; '.join(changed)} "
                "changed, and the run's data order depends on it; resume with the run's "
                "settings, or start a new run (another output_dir)"
            )
    iterator.set_state(saved)
