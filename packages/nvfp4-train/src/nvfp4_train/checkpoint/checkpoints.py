"""Orbax checkpoints of a run: the train state, the data iterator position and the config.

On disk (see docs/checkpoint-schema.md): `<run_dir>/checkpoints/<step>/` holds one orbax item per
`TrainState` field except `step` (`params`, `opt_state`: orbax PyTree/OCDBT, restorable without a
target), `data_iter` (JSON: the grain iterator state), `config` (JSON: the resolved config) and
`quant_stats` (JSON: `recipes` and `activation_amax` by module path), `reference` (PyTree: the
model's logits on fixed tokens) and `integrity` (JSON: checksums of every saved array and the
SHA-256 of the `config` and `quant_stats` items, see `nvfp4_train.checkpoint.integrity`). The step is the directory name. A state holding NaN or Inf is never
saved (`NonFiniteState`); a restored one whose checksums differ, or that holds NaN or Inf, is
refused (`CorruptCheckpoint`), so a run resumes from the previous checkpoint instead.

Checkpoints are always per layer (`checkpoint.per_layer`): with a `layout` that stacks blocks
(`model.scan_layers`), the parameters and optimizer state are split into their layers on save
(one transient copy of them) and stacked again on restore, so a checkpoint does not depend on the
layout that wrote it. This module saves and rotates; `checkpoint.reading` reads and validates,
`checkpoint.items` names what a checkpoint holds.

Example:
    >>> with Checkpoints(run_dir / "checkpoints", keep=3) as ckpts:  # doctest: +SKIP
    ...     ckpts.save(100, state, data_iter_state=it.get_state(), config=to_dict(cfg))
    ...     restored = ckpts.restore(ckpts.latest_step(), abstract_state)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from nvfp4_train.checkpoint.integrity import json_sha256, state_integrity
from nvfp4_train.checkpoint.items import (
    CONFIG_ITEM,
    DATA_ITER_ITEM,
    INTEGRITY_ITEM,
    QUANT_STATS_ITEM,
    REFERENCE_ITEM,
    NonFiniteState,
    Restored,
    encode_iterator_state,
    state_items,
)
from nvfp4_train.checkpoint.per_layer import PerLayer
from nvfp4_train.checkpoint.reading import read_config, restore_state
from nvfp4_train.model.stacking import LayerLayout


class Checkpoints:
    """A directory of step checkpoints, keeping the newest `keep` (and every `keep_period`-th).

    Saves are atomic: orbax writes `<step>.orbax-checkpoint-tmp-*` and renames it to `<step>`
    once every item is on disk, so a killed save leaves no integer-named directory.

    Args:
        directory: where step directories are written (created if missing).
        keep: how many of the newest checkpoints to keep.
        keep_period: also keep every checkpoint whose step is a multiple of this (0: none).
        async_save: write in a background thread; `wait()` or `close()` finishes pending writes.
        layout: the blocks the train states passed to `save` and `restore` hold stacked (None:
            none); on disk every checkpoint is per layer.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        keep: int,
        keep_period: int = 0,
        async_save: bool = False,
        layout: LayerLayout | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if keep_period < 0:
            raise ValueError(f"keep_period must be >= 0 (0: off), got {keep_period}")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            keep_period=keep_period or None,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        scanned = layout is not None and layout.scanned
        self._per_layer = PerLayer(layout) if scanned else None

    def set_aside(self, step: int) -> Path:
        """Renames the (unreadable) checkpoint of `step` to `<step>.unreadable[-k]`; returns it.

        The new name is not an integer, so orbax and readers skip it; it is kept for inspection.
        """
        multi = jax.process_count() > 1
        if multi:  # every process picks the same name before one of them renames
            multihost_utils.sync_global_devices(f"nvfp4_train set_aside {step} start")
        source = self.directory / str(step)
        target = self.directory / f"{step}.unreadable"
        k = 0
        while target.exists():
            k += 1
            target = self.directory / f"{step}.unreadable-{k}"
        if jax.process_index() == 0:
            source.rename(target)
        if multi:
            multihost_utils.sync_global_devices(f"nvfp4_train set_aside {step} done")
        self._manager.reload()
        return target

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None when there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of the checkpoints on disk, oldest first."""
        return sorted(self._manager.all_steps())

    def save(
        self,
        step: int,
        state: NamedTuple,
        *,
        data_iter_state: Any,
        config: dict[str, Any],
        quant_stats: dict[str, Any] | None = None,
        reference: dict[str, Any] | None = None,
    ) -> None:
        """Saves a checkpoint at `step`.

        Args:
            step: the step number (the checkpoint's directory name).
            state: a TrainState NamedTuple; every field but `step` becomes an item.
            data_iter_state: `train_iterator().get_state()` (bytes or a JSON-ready dict).
            config: the resolved config as plain data.
            quant_stats: JSON-ready facts for readers such as export: `recipes` (module path ->
                recipe name of every linear), `activation_amax` (module path -> float).
            reference: `{"tokens": int32 [n, L], "logits": float32 [n, L, V]}`, the model's
                forward at this checkpoint on fixed sequences (a PyTree item), or None.
        """
        integrity = state_integrity(state)  # per layer, of the stacked blocks as they are
        if not integrity["finite"]:
            kept = self.latest_step()
            raise NonFiniteState(
                f"not saving step {step}: the train state holds NaN or Inf (training diverged); "
                + (f"the newest checkpoint, step {kept}, is kept" if kept is not None else
                   "no checkpoint was saved before")
                + ". Lower optimizer.learning_rate, or resume from that checkpoint."
            )  # fmt: skip
        if self._per_layer is not None:
            state = self._per_layer.to_disk(state)
        items = {k: ocp.args.StandardSave(v) for k, v in state_items(state).items()}
        json_items = {CONFIG_ITEM: config, QUANT_STATS_ITEM: quant_stats}  # for readers (export)
        integrity["json_sha256"] = {
            k: json_sha256(v) for k, v in json_items.items() if v is not None
        }
        items[INTEGRITY_ITEM] = ocp.args.JsonSave(integrity)
        items[DATA_ITER_ITEM] = ocp.args.JsonSave(encode_iterator_state(data_iter_state))
        items[CONFIG_ITEM] = ocp.args.JsonSave(config)
        if quant_stats is not None:
            items[QUANT_STATS_ITEM] = ocp.args.JsonSave(quant_stats)
        if reference is not None:
            items[REFERENCE_ITEM] = ocp.args.StandardSave(reference)
        self._manager.save(step, args=ocp.args.Composite(**items), force=True)

    def read_config(self, step: int) -> dict[str, Any]:
        """The resolved config (plain data) saved with the checkpoint at `step`."""
        return read_config(self._manager, step)

    def restore(self, step: int, abstract_state: NamedTuple) -> Restored:
        """Restores the checkpoint at `step` into the tree, shapes and dtypes of `abstract_state`
        (`checkpoint.reading.restore_state`).

        Args:
            step: a step from `all_steps()`.
            abstract_state: a TrainState of arrays or `jax.ShapeDtypeStruct`s (e.g. from
                `jax.eval_shape`) whose non-step fields match the saved items.

        Raises:
            CorruptCheckpoint: the checkpoint is not what was saved, or holds NaN or Inf.
        """
        if step not in self.all_steps():
            raise ValueError(f"no checkpoint at step {step}; have steps {self.all_steps()}")
        return restore_state(self._manager, self.directory, step, abstract_state, self._per_layer)

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finishes pending saves and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
