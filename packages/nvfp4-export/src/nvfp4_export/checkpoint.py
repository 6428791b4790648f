"""Read a training checkpoint through its on-disk schema (docs/export.md, "What export reads").

A run directory holds `config.yaml`, `tokenizer/` and `checkpoints/<step>/`; each step directory holds
orbax items: `params` (PyTree of float32 master weights), `config` (JSON, the resolved config) and,
optionally, `quant_stats` (JSON) and `reference` (PyTree), and `integrity` (JSON: checksums of
the parameters and of the `config` and `quant_stats` items, checked here). Only orbax's own readers
are used: this module never imports the training package.
"""

from __future__ import annotations

import dataclasses
import errno
import json
from pathlib import Path
from typing import Any

import numpy as np

from nvfp4_export.errors import ExportError
from nvfp4_export.json_files import json_sha256
from nvfp4_export.params_reader import CheckpointParams, tree_metadata

PARAMS_ITEM = "params"
CONFIG_ITEM = "config"
QUANT_STATS_ITEM = "quant_stats"
REFERENCE_ITEM = "reference"
INTEGRITY_ITEM = "integrity"
INTEGRITY_ALGORITHM = "u32-sum+golden-sum"
JSON_CHECKSUMS = "json_sha256"
"""The `integrity` item's key holding `{item name: json_sha256(item)}` of its JSON items."""
GOLDEN = np.uint32(0x9E3779B1)
CHECKPOINTS_DIR = "checkpoints"
TOKENIZER_DIR = "tokenizer"


@dataclasses.dataclass(frozen=True)
class CheckpointRef:
    """Where one checkpoint lies.

    Attributes:
        step_dir: `.../checkpoints/<step>` (holds the orbax items).
        step: the step (the directory's name).
        run_dir: the run directory above it, or None when the layout is not a run's.
    """

    step_dir: Path
    step: int
    run_dir: Path | None


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One checkpoint's contents as NumPy data.

    Attributes:
        ref: where it was read from.
        params: dotted path (`layers.0.attn.qkv.kernel`) -> float32 array, read from disk on
            each access (`CheckpointParams`; `params.shapes` reads nothing).
        config: the resolved training config (plain data).
        quant_stats: the optional `quant_stats` item (`recipes`, `activation_amax`), or None.
        reference: the optional `reference` item (`tokens` int32 [n, L], `logits` float32 [n, L, V]),
            or None.
        notes: what was not checked against the `integrity` item, one line each (empty when
            everything was).
    """

    ref: CheckpointRef
    params: CheckpointParams
    config: dict[str, Any]
    quant_stats: dict[str, Any] | None
    reference: dict[str, np.ndarray] | None
    notes: tuple[str, ...] = ()

    @property
    def tokenizer_dir(self) -> Path | None:
        """The run's `tokenizer/` directory, or None when there is none."""
        run_dir = self.ref.run_dir
        if run_dir is None or not (run_dir / TOKENIZER_DIR).is_dir():
            return None
        return run_dir / TOKENIZER_DIR


def existing_path(path: Path, what: str) -> Path:
    """`path` made absolute (symbolic links resolved), or ExportError saying why it cannot be.

    Orbax reads only absolute paths; a relative one ("runs/tiny", as the docs write it) is
    resolved here, once, for everything that follows.
    """
    try:
        return path.resolve(strict=True)
    except FileNotFoundError:
        raise ExportError(f"{what} {str(path)!r} does not exist") from None
    except RuntimeError:  # Python < 3.13 reports a symlink loop so
        raise ExportError(f"{what} {str(path)!r} is a loop of symbolic links") from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ExportError(f"{what} {str(path)!r} is a loop of symbolic links") from None
        raise ExportError(f"{what} {str(path)!r} cannot be accessed: {err.strerror}") from None


def _steps(checkpoints_dir: Path) -> list[int]:
    """Completed step directories (integer names; orbax's temporary directories are skipped)."""
    steps = []
    for child in checkpoints_dir.iterdir():
        if child.is_dir() and child.name.isdigit() and (child / PARAMS_ITEM).is_dir():
            steps.append(int(child.name))
    return sorted(steps)


def resolve_checkpoint(path: str | Path, step: int | None = None) -> CheckpointRef:
    """Finds the checkpoint for a run directory, a `checkpoints/` directory or a step directory.

    Args:
        path: a run directory, its `checkpoints/` directory, or one `checkpoints/<step>/`.
        step: the step to use (default: the newest); must match when `path` is a step directory.

    Raises:
        ExportError: nothing usable at `path`, or no checkpoint at `step`.
    """
    path = existing_path(Path(path), "checkpoint path")
    if (path / PARAMS_ITEM).is_dir():
        if not path.name.isdigit():
            raise ExportError(f"step directory name must be the step number, got {path.name!r}")
        if step is not None and step != int(path.name):
            raise ExportError(f"--step {step} does not match the step directory {str(path)!r}")
        run_dir = path.parent.parent if path.parent.name == CHECKPOINTS_DIR else None
        return CheckpointRef(path, int(path.name), run_dir)
    checkpoints_dir, run_dir = path / CHECKPOINTS_DIR, path
    if not checkpoints_dir.is_dir():
        checkpoints_dir, run_dir = path, (path.parent if path.name == CHECKPOINTS_DIR else None)
    steps = _steps(checkpoints_dir)
    if not steps:
        raise ExportError(
            f"no checkpoint under {str(path)!r}: expected a run directory with "
            f"checkpoints/<step>/params, a checkpoints/ directory, or a step directory"
        )
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        raise ExportError(f"no checkpoint at step {chosen} under {str(path)!r}; have steps {steps}")
    return CheckpointRef(checkpoints_dir / str(chosen), chosen, run_dir)


def _restore_pytree(item_dir: Path) -> Any:
    """An orbax PyTree item as nested dicts of NumPy arrays (no target needed)."""
    import jax  # orbax needs JAX; imported here so `import nvfp4_export` stays light
    import orbax.checkpoint as ocp

    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree_metadata(item_dir))
    checkpointer = ocp.PyTreeCheckpointer()
    try:
        return checkpointer.restore(item_dir, restore_args=args)
    finally:
        checkpointer.close()


def _restore_json(item_dir: Path) -> Any:
    import orbax.checkpoint as ocp

    checkpointer = ocp.Checkpointer(ocp.JsonCheckpointHandler())
    try:
        return checkpointer.restore(item_dir)
    finally:
        checkpointer.close()


def _read_item(step_dir: Path, name: str, reader, *, required: bool) -> Any:
    item_dir = step_dir / name
    if not item_dir.is_dir():
        if required:
            raise ExportError(f"checkpoint {str(step_dir)!r} has no {name!r} item")
        return None
    try:
        return reader(item_dir)
    except Exception as err:  # orbax raises many types for a damaged item
        first = str(err).splitlines()[0] if str(err) else ""
        raise ExportError(
            f"checkpoint item {str(item_dir)!r} cannot be read: {type(err).__name__}: {first}"
        ) from err


def _config_yaml(ref: CheckpointRef) -> dict[str, Any]:
    """The run's config.yaml, for checkpoints without a `config` item."""
    yaml_file = ref.run_dir / "config.yaml" if ref.run_dir else None
    if yaml_file is None or not yaml_file.is_file():
        raise ExportError(
            f"checkpoint {str(ref.step_dir)!r} has no 'config' item and no run config.yaml"
        )
    import yaml

    return yaml.safe_load(yaml_file.read_text(encoding="utf-8"))


def _reference(ref: CheckpointRef) -> dict[str, np.ndarray] | None:
    tree = _read_item(ref.step_dir, REFERENCE_ITEM, _restore_pytree, required=False)
    if tree is None:
        return None
    missing = {"tokens", "logits"} - set(tree)
    if missing:
        raise ExportError(
            f"checkpoint 'reference' item lacks {sorted(missing)}; has {sorted(tree)}"
        )
    tokens, logits = np.asarray(tree["tokens"]), np.asarray(tree["logits"], np.float32)
    if tokens.ndim != 2 or logits.shape[:2] != tokens.shape:
        raise ExportError(
            f"checkpoint 'reference': tokens must be [n, L] and logits [n, L, V], got "
            f"{tokens.shape} and {logits.shape}"
        )
    return {"tokens": tokens.astype(np.int32), "logits": logits}


CHECKSUM_CHUNK = 1 << 18
"""Elements per step of `checksums` (its temporary stays in cache)."""


def checksums(x: np.ndarray) -> list[int]:
    """The checkpoint schema's two 32-bit checksums of an array's bits (docs/checkpoint-schema.md):
    u = the bits as unsigned integers (64-bit folded as hi ^ lo); sum(u) and sum(u * 0x9E3779B1),
    both mod 2^32."""
    x = np.ascontiguousarray(x)
    if x.dtype == np.bool_:
        u = x.astype(np.uint32)
    else:
        u = x.view(np.dtype(f"uint{x.dtype.itemsize * 8}"))
        u = (u >> 32).astype(np.uint32) ^ u.astype(np.uint32) if x.dtype.itemsize == 8 else u
        u = u.astype(np.uint32, copy=False).reshape(-1)
    total = weighted = 0
    for start in range(0, u.size, CHECKSUM_CHUNK):  # u * GOLDEN a chunk at a time, in cache
        part = u[start : start + CHECKSUM_CHUNK]
        total = (total + int(np.sum(part, dtype=np.uint32))) % 2**32
        weighted = (weighted + int(np.sum(part * GOLDEN, dtype=np.uint32))) % 2**32
    return [total, weighted]


def read_integrity(step_dir: Path) -> dict[str, Any] | None:
    """The `integrity` item, checked for form, or None when the checkpoint has none.

    Raises:
        ExportError: an unknown algorithm, or an item that is not the schema's object.
    """
    saved = _read_item(step_dir, INTEGRITY_ITEM, _restore_json, required=False)
    if saved is None:
        return None
    algorithm = saved.get("algorithm") if isinstance(saved, dict) else None
    if algorithm != INTEGRITY_ALGORITHM:
        raise ExportError(
            f"checkpoint {str(step_dir)!r} has an integrity item with unknown algorithm "
            f"{algorithm!r}, expected {INTEGRITY_ALGORITHM!r}; refusing to use it"
        )
    sums = saved.get(JSON_CHECKSUMS, {})
    if not isinstance(saved.get("checksums"), dict) or not isinstance(sums, dict):
        raise ExportError(
            f"checkpoint {str(step_dir)!r} has an integrity item whose 'checksums' or "
            f"{JSON_CHECKSUMS!r} is not a JSON object; refusing to use it"
        )
    return saved


def _missing_integrity(step_dir: Path) -> ExportError:
    return ExportError(
        f"checkpoint {str(step_dir)!r} has no 'integrity' item, so neither its parameters nor "
        "its config can be checked against what training saved (written by an nvfp4-train "
        "older than checksums, or the item was deleted); pass --no-integrity-check "
        "(integrity_check=False) to use it unchecked"
    )


UNCHECKED = (
    "INTEGRITY NOT CHECKED (--no-integrity-check): the checkpoint's parameters and config are "
    "used as found on disk, without comparing them with the checksums training saved"
)
"""The note of a checkpoint read with `integrity_check=False`."""


def _json_item_problem(name: str, value: Any, saved_sum: str | None) -> str | None:
    if saved_sum is None and value is None:
        return None
    if saved_sum is None:
        return f"it has a {name!r} item that was not saved with it (added after training?)"
    if value is None:
        return f"it has no {name!r} item, but one was saved with it (deleted?)"
    if json_sha256(value) != saved_sum:
        return f"its {name!r} item differs from the checksum saved with it (edited after training?)"
    return None


def check_json_items(
    step_dir: Path, saved: dict[str, Any], items: dict[str, Any]
) -> tuple[str, ...]:
    """Compares the JSON items (`config`, `quant_stats`: name -> value, None for an absent one)
    with the checksums of the `integrity` item; returns the notes of what could not be checked.

    Raises:
        ExportError: an item differs from its checksum, or was added or deleted after saving.
    """
    sums = saved.get(JSON_CHECKSUMS)
    if sums is None:
        return (
            f"config not checked: the integrity item of checkpoint {str(step_dir)!r} has no "
            "checksum of its config or quant_stats (written by an older nvfp4-train); its "
            "parameters are checked",
        )
    for name, value in items.items():
        problem = _json_item_problem(name, value, sums.get(name))
        if problem:
            raise ExportError(
                f"checkpoint {str(step_dir)!r} is not what was saved: {problem}; refusing to use "
                "it. Pass --no-integrity-check (integrity_check=False) to use it as it is now"
            )
    return ()


def read_checkpoint(ref: CheckpointRef, *, integrity_check: bool = True) -> Checkpoint:
    """Opens `ref`: params lazily (shapes now, each value read and checked on access), config and
    the optional `quant_stats` / `reference` items, the JSON ones checked against the
    `integrity` item.

    Args:
        ref: the checkpoint.
        integrity_check: compare parameters, config and quant_stats with the checksums of the
            `integrity` item, which must exist. False: use them as found (`Checkpoint.notes`
            says so); parameters are still checked finite.

    Raises:
        ExportError: a required item is missing or cannot be read; no `integrity` item (unless
            `integrity_check` is False); a config or quant_stats item that is not what was
            saved; later, on access, a parameter that holds NaN or Inf or whose checksums differ
            from the `integrity` item.
    """
    saved = read_integrity(ref.step_dir) if integrity_check else None
    if integrity_check and saved is None:
        raise _missing_integrity(ref.step_dir)
    expected = None if saved is None else saved["checksums"]
    reader = lambda item_dir: CheckpointParams(item_dir, expected, checksums)  # noqa: E731
    params = _read_item(ref.step_dir, PARAMS_ITEM, reader, required=True)
    stats = _read_item(ref.step_dir, QUANT_STATS_ITEM, _restore_json, required=False)
    if stats is not None and not isinstance(stats, dict):
        raise ExportError(
            f"checkpoint 'quant_stats' must be a JSON object, got {type(stats).__name__}"
        )
    config = _read_item(ref.step_dir, CONFIG_ITEM, _restore_json, required=False)
    items = {CONFIG_ITEM: config, QUANT_STATS_ITEM: stats}
    notes = check_json_items(ref.step_dir, saved, items) if saved is not None else (UNCHECKED,)
    if config is None:
        config = _config_yaml(ref)
    return Checkpoint(ref, params, config, stats, _reference(ref), notes)


def read_json(path: Path) -> Any:
    """A JSON file's content (used for export directories)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ExportError(f"cannot read JSON file {str(path)!r}: {err}") from err
