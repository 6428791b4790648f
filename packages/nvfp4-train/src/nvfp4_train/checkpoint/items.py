"""What a checkpoint holds: its orbax items, the grain iterator state as JSON, what a restore
returns, and the errors of a state that must not be saved or a checkpoint that is not what was
saved (see docs/checkpoint-schema.md)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax

from nvfp4_train.errors import RunError

DATA_ITER_ITEM = "data_iter"
CONFIG_ITEM = "config"
QUANT_STATS_ITEM = "quant_stats"
REFERENCE_ITEM = "reference"
INTEGRITY_ITEM = "integrity"
LAYOUT_ITEMS = ("params", "opt_state")
"""The train-state items stored in the model's layout (stacked blocks); on disk they are per layer."""


class NonFiniteState(RunError):
    """A train state holding NaN or Inf: it is not saved, and the run cannot go on."""


class CorruptCheckpoint(ValueError):
    """A restored checkpoint that is not what was saved (checksums) or holds NaN or Inf."""


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `Checkpoints.restore` returns.

    Attributes:
        step: the checkpointed step (optimizer steps taken).
        state: the train state, with the same tree, shapes and dtypes as the abstract target.
        data_iter_state: the iterator state as `train_iterator().get_state()` returned it.
        config: the resolved config of the run that wrote the checkpoint, as plain data.
    """

    step: int
    state: Any
    data_iter_state: Any
    config: dict[str, Any]


def encode_iterator_state(state: Any) -> dict[str, Any]:
    """Makes a grain iterator state JSON-ready: `DataLoader` states are JSON bytes, others dicts."""
    if isinstance(state, bytes):
        return {"kind": "bytes", "value": state.decode("utf-8")}
    return {"kind": "json", "value": state}


def decode_iterator_state(encoded: dict[str, Any]) -> Any:
    """Inverse of `encode_iterator_state`."""
    kind = encoded.get("kind")
    if kind == "bytes":
        return encoded["value"].encode("utf-8")
    if kind == "json":
        return encoded["value"]
    raise ValueError(f"data_iter checkpoint item: kind must be 'bytes' or 'json', got {kind!r}")


def state_items(state: NamedTuple) -> dict[str, Any]:
    """The checkpoint items of a train state: every field but `step`."""
    return {name: getattr(state, name) for name in state._fields if name != "step"}


def restore_target(leaf: Any) -> Any:
    """A restore target leaf: shape and dtype of `leaf`, placed like it (default device if abstract)."""
    sharding = getattr(leaf, "sharding", None) or jax.sharding.SingleDeviceSharding(
        jax.devices()[0]
    )
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
