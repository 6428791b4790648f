"""Reading a checkpoint back: the saved config alone, or the whole train state stacked into the
model's layout and checked against its integrity checksums (`checkpoint.integrity`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from nvfp4_train.checkpoint.integrity import integrity_problems
from nvfp4_train.checkpoint.items import (
    CONFIG_ITEM,
    DATA_ITER_ITEM,
    INTEGRITY_ITEM,
    LAYOUT_ITEMS,
    CorruptCheckpoint,
    Restored,
    decode_iterator_state,
    restore_target,
    state_items,
)
from nvfp4_train.checkpoint.per_layer import PerLayer


def read_config(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """The resolved config (plain data) saved with the checkpoint at `step`."""
    args = ocp.args.Composite(**{CONFIG_ITEM: ocp.args.JsonRestore()})
    return manager.restore(step, args=args)[CONFIG_ITEM]


def restore_state(manager: ocp.CheckpointManager, directory: Path, step: int,
                  abstract_state: NamedTuple, per_layer: PerLayer | None) -> Restored:  # fmt: skip
    """The checkpoint of `step` restored into the tree, shapes and dtypes of `abstract_state`.

    Raises:
        CorruptCheckpoint: its arrays differ from their checksums or hold NaN or Inf.
    """
    in_layout = jax.tree.map(restore_target, state_items(abstract_state))
    targets = dict(in_layout)
    if per_layer is not None:
        targets.update(per_layer.split({k: in_layout[k] for k in LAYOUT_ITEMS}))
    items = {k: ocp.args.StandardRestore(v) for k, v in targets.items()}
    items[DATA_ITER_ITEM] = ocp.args.JsonRestore()
    items[CONFIG_ITEM] = ocp.args.JsonRestore()
    has_integrity = (directory / str(step) / INTEGRITY_ITEM).is_dir()
    if has_integrity:  # checkpoints written before checksums have none
        items[INTEGRITY_ITEM] = ocp.args.JsonRestore()
    restored = manager.restore(step, args=ocp.args.Composite(**items))
    step_dtype = getattr(abstract_state.step, "dtype", jnp.int32)
    state = abstract_state._replace(
        step=jnp.asarray(step, dtype=step_dtype), **{k: restored[k] for k in targets}
    )
    if per_layer is not None:  # checked stacked: the checksums of a stacked array are per layer
        state = per_layer.from_disk(state, in_layout)
    problems = integrity_problems(state, restored[INTEGRITY_ITEM] if has_integrity else None)
    if problems:
        raise CorruptCheckpoint(f"checkpoint of step {step}: {'; '.join(problems)}")
    return Restored(
        step=step,
        state=state,
        data_iter_state=decode_iterator_state(restored[DATA_ITER_ITEM]),
        config=restored[CONFIG_ITEM],
    )
