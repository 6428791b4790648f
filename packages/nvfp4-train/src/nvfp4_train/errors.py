"""Errors a run raises for the command line to report in one line (see `nvfp4_train.cli`).

The project's error types, and what `nvfp4-train` does with each: a user mistake
(`ConfigError`, `DataError`, `hf_config.HFConfigError` and its `hf_weights.HFImportError`: `cli.USER_ERRORS`) prints one
`error:` line and exits 2; a run that cannot go on (`RunError` and its subclass
`checkpoint.items.NonFiniteState`) prints one and exits 1. Any other
exception is a bug and keeps its traceback. (`checkpoint.items.CorruptCheckpoint` never reaches the
CLI: `nvfp4_train.training.resume` passes over an unreadable checkpoint.)
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A user mistake in a config file or an override (unknown key, wrong type, bad syntax, a
    rule or override that matches no linear): the CLI prints the message and exits with status 2.
    (Also `nvfp4_train.config.run_config.ConfigError`.)"""


class RunError(RuntimeError):
    """A run that cannot go on (e.g. a backend that disagrees with the reference under
    `precision.verify_backend=strict`): the CLI prints the message and exits with status 1."""


class DataError(ValueError):
    """A user mistake the data pipeline finds (a missing corpus or tokenizer file, a corpus too
    short for one batch, a token id outside the vocabulary): the CLI prints the message and exits
    with status 2. A `ValueError`, so callers that catch that keep working."""
