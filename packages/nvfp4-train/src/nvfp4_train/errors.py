"""Errors a run raises for the command line to report in one line (see `nvfp4_train.cli`)."""

from __future__ import annotations


class RunError(RuntimeError):
    """A run that cannot go on (e.g. a backend that disagrees with the reference under
    `precision.verify_backend=strict`): the CLI prints the message and exits with status 1."""
