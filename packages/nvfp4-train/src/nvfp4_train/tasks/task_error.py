"""`TaskError`: a task file the evaluation cannot read or score."""

from __future__ import annotations

from nvfp4_train.errors import DataError


class TaskError(DataError):
    """A task file the evaluation cannot read or score, named with its example (the CLI prints
    it and exits 2)."""
