"""Orbax checkpoints of a run: the train state, the data iterator position and the config.

On disk (see docs/checkpoint-schema.md): `<run_dir>/checkpoints/<step>/` holds one orbax item per
`TrainState` field except `step` (`params`, `opt_state`: orbax PyTree/OCDBT, restorable without a
target), `data_iter` (JSON: the grain iterator state), `config` (JSON: the resolved config) and
`quant_stats` (JSON: `recipes` and `activation_amax` by module path), `reference` (PyTree: the
model's logits on fixed tokens) and `integrity` (JSON: checksums of every saved array and the
SHA-256 of the `config` and `quant_stats` items, see `nvfp4_train.integrity`). The step is the directory name. A state holding NaN or Inf is never
saved (`NonFiniteState`); a restored one whose checksums differ, or that holds NaN or Inf, is
refused (`CorruptCheckpoint`), so a run resumes from the previous checkpoint instead.

Checkpoints are always per layer: with a `layout` that stacks blocks (`model.scan_layers`), the
parameters and optimizer state are split into their layers on save (one transient copy of them)
and stacked again on restore, so a checkpoint does not depend on the layout that wrote it.

Example:
    >>> with Checkpoints(run_dir / "checkpoints", keep=3) as ckpts:  # doctest: +SKIP
    ...     ckpts.save(100, state, data_iter_state=it.get_state(), config=to_dict(cfg))
    ...     restored = ckpts.restore(ckpts.latest_step(), abstract_state)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from nvfp4_train.errors import RunError
from nvfp4_train.integrity import integrity_problems, json_sha256, state_integrity
from nvfp4_train.stacking import LayerLayout

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


def _state_items(state: NamedTuple) -> dict[str, Any]:
    """The checkpoint items of a train state: every field but `step`."""
    return {name: getattr(state, name) for name in state._fields if name != "step"}


def _restore_target(leaf: Any) -> Any:
    """A restore target leaf: shape and dtype of `leaf`, placed like it (default device if abstract)."""
    sharding = getattr(leaf, "sharding", None) or jax.sharding.SingleDeviceSharding(
        jax.devices()[0]
    )
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


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
        self.layout = layout if layout is not None and layout.scanned else None
        self._split = jax.jit(self._per_layer) if self.layout else None

    def _per_layer(self, items: dict[str, Any]) -> dict[str, Any]:
        return {k: self.layout.to_canonical(v) for k, v in items.items()}

    def _on_disk(self, state: NamedTuple) -> NamedTuple:
        """`state` with its stacked items split per layer (unchanged without a layout)."""
        if self.layout is None:
            return state
        return state._replace(**self._split({k: getattr(state, k) for k in LAYOUT_ITEMS}))

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
        state = self._on_disk(state)
        integrity = state_integrity(state)
        if not integrity["finite"]:
            kept = self.latest_step()
            raise NonFiniteState(
                f"not saving step {step}: the train state holds NaN or Inf (training diverged); "
                + (f"the newest checkpoint, step {kept}, is kept" if kept is not None else
                   "no checkpoint was saved before")
                + ". Lower optimizer.learning_rate, or resume from that checkpoint."
            )  # fmt: skip
        items = {k: ocp.args.StandardSave(v) for k, v in _state_items(state).items()}
        json_items = {CONFIG_ITEM: config, QUANT_STATS_ITEM: quant_stats}  # for readers (export)
        sums = {k: json_sha256(v) for k, v in json_items.items() if v is not None}
        integrity["json_sha256"] = sums
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
        args = ocp.args.Composite(**{CONFIG_ITEM: ocp.args.JsonRestore()})
        return self._manager.restore(step, args=args)[CONFIG_ITEM]

    def restore(self, step: int, abstract_state: NamedTuple) -> Restored:
        """Restores the checkpoint at `step` into the tree, shapes and dtypes of `abstract_state`.

        Args:
            step: a step from `all_steps()`.
            abstract_state: a TrainState of arrays or `jax.ShapeDtypeStruct`s (e.g. from
                `jax.eval_shape`) whose non-step fields match the saved items.
        """
        if step not in self.all_steps():
            raise ValueError(f"no checkpoint at step {step}; have steps {self.all_steps()}")
        in_layout = jax.tree.map(_restore_target, _state_items(abstract_state))
        targets = dict(in_layout)
        if self.layout is not None:
            targets.update(self._per_layer({k: in_layout[k] for k in LAYOUT_ITEMS}))
        items = {k: ocp.args.StandardRestore(v) for k, v in targets.items()}
        items[DATA_ITER_ITEM] = ocp.args.JsonRestore()
        items[CONFIG_ITEM] = ocp.args.JsonRestore()
        has_integrity = (self.directory / str(step) / INTEGRITY_ITEM).is_dir()
        if has_integrity:  # checkpoints written before checksums have none
            items[INTEGRITY_ITEM] = ocp.args.JsonRestore()
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        step_dtype = getattr(abstract_state.step, "dtype", jnp.int32)
        state = abstract_state._replace(
            step=jnp.asarray(step, dtype=step_dtype), **{k: restored[k] for k in targets}
        )
        problems = integrity_problems(state, restored[INTEGRITY_ITEM] if has_integrity else None)
        if problems:
            raise CorruptCheckpoint(f"checkpoint of step {step}: {'; '.join(problems)}")
        if self.layout is not None:
            shardings = jax.tree.map(lambda t: t.sharding, {k: in_layout[k] for k in LAYOUT_ITEMS})
            stack = jax.jit(
                lambda items: {k: self.layout.from_canonical(v) for k, v in items.items()},
                out_shardings=shardings,
            )
            state = state._replace(**stack({k: getattr(state, k) for k in LAYOUT_ITEMS}))
        return Restored(
            step=step,
            state=state,
            data_iter_state=decode_iterator_state(restored[DATA_ITER_ITEM]),
            config=restored[CONFIG_ITEM],
        )

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
