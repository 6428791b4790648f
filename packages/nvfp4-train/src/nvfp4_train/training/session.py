"""What training and evaluating a run directory share: its data and vocabulary, its
checkpoints, its lock, the config it was trained with, and where messages go."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import jax

from nvfp4_train.checkpoint.checkpoints import Checkpoints
from nvfp4_train.checkpoint.run_dir import CHECKPOINT_DIR, CONFIG_FILE, run_lock
from nvfp4_train.config.run_config import Config, config_from_dict, read_config_file, upgraded
from nvfp4_train.data import make_datasets
from nvfp4_train.errors import ConfigError
from nvfp4_train.precision.policy import run_layout
from nvfp4_train.training.step import with_vocab_size


def datasets_of(cfg: Config) -> Any:
    """The data in global order: every process iterates the same global batches and places only
    the rows its devices hold (`global_batch`), so a run's numerics do not depend on how many
    processes share it."""
    return make_datasets(
        cfg.data, seq_len=cfg.train.seq_len, batch_size=cfg.train.batch_size, seed=cfg.train.seed
    )


def with_data(cfg: Config) -> tuple[Config, Any]:
    """(cfg with `model.vocab_size` filled from the data, the data): the prologue of training
    and of evaluation."""
    datasets = datasets_of(cfg)
    return with_vocab_size(cfg, datasets.vocab_size), datasets


def sayer(stream: TextIO) -> Callable[[str], None]:
    """`say(text)`: prints a line of the run's messages to `stream`, flushed."""

    def say(text: str) -> None:
        print(text, file=stream, flush=True)

    return say


def run_checkpoints(cfg: Config, run_dir: Path) -> Checkpoints:
    """The run directory's checkpoints, kept and laid out as `cfg` says."""
    return Checkpoints(
        run_dir / CHECKPOINT_DIR,
        keep=cfg.checkpoint.keep,
        keep_period=cfg.checkpoint.keep_period,
        async_save=cfg.checkpoint.async_save,
        layout=run_layout(cfg),
    )


def exclusive(run_dir: Path):
    """The run directory's lock (process 0 of a multi-process run takes it for all)."""
    return run_lock(run_dir) if jax.process_index() == 0 else contextlib.nullcontext()


def load_run_config(run_dir: str | Path, overrides: Sequence[str] = ()) -> Config:
    """The resolved config a run directory was trained with (its `config.yaml`; one written by
    an earlier version is read with its moved keys at their new places: `config.upgraded`)."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{str(run_dir)!r} is not a run directory: it has no {CONFIG_FILE}")
    saved = read_config_file(path)
    return config_from_dict(upgraded(saved) if isinstance(saved, dict) else saved, overrides)
