"""Atomic output: build the result in a temporary sibling, rename it into place at the very end.

A failed export leaves no directory (or file) under the requested name; an existing one is only
replaced with `overwrite=True`, and only after the new one is complete.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from nvfp4_export.errors import ExportError


def check_target(target: Path, overwrite: bool) -> None:
    """Raises ExportError when `target` exists and `overwrite` is False."""
    if target.exists() and not overwrite:
        raise ExportError(f"output {str(target)!r} already exists; pass --overwrite to replace it")
    if not target.parent.exists():
        raise ExportError(f"the parent directory of output {str(target)!r} does not exist")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _replace(staging: Path, target: Path) -> None:
    if not target.exists():
        os.replace(staging, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    old.rmdir()
    os.replace(target, old)
    os.replace(staging, target)
    _remove(old)


@contextlib.contextmanager
def atomic_output(target: str | Path, *, overwrite: bool) -> Iterator[Path]:
    """Yields a temporary directory beside `target`; renamed to `target` on normal exit.

    On any exception the temporary directory is deleted and `target` is left as it was.

    Example:
        >>> with atomic_output(tmp_path / "out", overwrite=False) as d:  # doctest: +SKIP
        ...     (d / "config.json").write_text("{}")
    """
    target = Path(target)
    check_target(target, overwrite)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield staging
        _replace(staging, target)
    except BaseException:
        _remove(staging)
        raise


@contextlib.contextmanager
def atomic_file(target: str | Path, *, overwrite: bool) -> Iterator[Path]:
    """Yields a temporary file path beside `target`; `os.replace`d onto `target` on normal exit."""
    target = Path(target)
    check_target(target, overwrite)
    if target.is_dir():
        raise ExportError(f"output file {str(target)!r} is a directory")
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    os.close(fd)
    staging = Path(name)
    try:
        yield staging
        os.replace(staging, target)
    except BaseException:
        _remove(staging)
        raise
