"""Safe output: never the source, only ever replacing a previous export, complete or absent.

- `check_target` refuses an output that is the checkpoint it is exported from, contains it, or
  lies inside its run's checkpoint tree (nothing a user trained is ever deleted), and an existing
  output unless `overwrite` is set AND it is a previous export (an export directory holds
  `nvfp4_export.json`; an ONNX file was produced by "nvfp4-export").
- `atomic_output` / `atomic_file` build the result in a sibling named
  `.<name>.tmp-<host>-<pid>-<random>` and rename it into place at the very end, so a failed or
  killed export leaves no partial output under the requested name. Leftovers of a killed export
  (siblings whose process on this host is gone) are removed by the next export to the same place.
- Everything is created with the user's umask like any other file (no 0700/0600 temporaries), so
  an inference server running as another user can read the export.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

from nvfp4_export.checkpoint import CHECKPOINTS_DIR, CheckpointRef
from nvfp4_export.errors import ExportError
from nvfp4_export.manifest import MANIFEST

ONNX_PRODUCER = "nvfp4-export"


def _inside(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def _is_export_dir(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()


def _is_export_onnx(path: Path) -> bool:
    try:
        import onnx

        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - not readable as ONNX: not ours
        return False
    return model.producer_name == ONNX_PRODUCER


def _protected(source: CheckpointRef | None) -> tuple[tuple[Path, ...], tuple[Path, ...]]:
    """(paths an output may not be or contain, trees an output may not lie inside)."""
    if source is None:
        return (), ()
    trees = [source.step_dir.resolve()]
    if source.run_dir is not None:
        trees.append((source.run_dir / CHECKPOINTS_DIR).resolve())
        return (*trees, source.run_dir.resolve()), tuple(trees)
    return tuple(trees), tuple(trees)


def check_target(
    target: Path,
    overwrite: bool,
    *,
    source: CheckpointRef | None = None,
    is_previous_export: Callable[[Path], bool] = _is_export_dir,
) -> Path:
    """The absolute output path, or ExportError if writing there could lose data.

    Args:
        target: the requested output.
        overwrite: replace an existing output (only ever a previous export).
        source: the checkpoint exported: the output may not be or contain its step directory,
            its run's checkpoints/ or its run directory, nor lie inside the first two.
        is_previous_export: tells whether an existing `target` is a previous export.
    """
    try:
        absolute = target.resolve()
    except (OSError, RuntimeError) as err:  # a symlink loop: RuntimeError before Python 3.13
        raise ExportError(f"output {str(target)!r} cannot be resolved: {err}") from None
    kept, trees = _protected(source)
    for path in kept:
        if _inside(path, absolute) or (path in trees and _inside(absolute, path)):
            raise ExportError(
                f"output {str(target)!r} would overwrite the checkpoint it is exported from "
                f"({str(path)!r}); choose an output outside the run's checkpoints"
            )
    if absolute.exists() or absolute.is_symlink():
        if not overwrite:
            raise ExportError(
                f"output {str(target)!r} already exists; pass overwrite=True (--overwrite) to "
                "replace a previous export"
            )
        if not is_previous_export(absolute):
            raise ExportError(
                f"output {str(target)!r} exists and is not an nvfp4-export export (no "
                f"{MANIFEST}, or not an ONNX file of {ONNX_PRODUCER}); refusing to replace it"
            )
    if not absolute.parent.is_dir():
        raise ExportError(f"the parent directory of output {str(target)!r} does not exist")
    if not os.access(absolute.parent, os.W_OK | os.X_OK):
        raise ExportError(
            f"cannot write output {str(target)!r}: its directory {str(absolute.parent)!r} is not "
            "writable by this user"
        )
    return absolute


def check_file_target(
    target: Path, overwrite: bool, *, source: CheckpointRef | None = None
) -> Path:
    """`check_target` for a single output file (an existing one must be an nvfp4-export ONNX)."""
    if target.is_dir():
        raise ExportError(f"output file {str(target)!r} is a directory")
    return check_target(target, overwrite, source=source, is_previous_export=_is_export_onnx)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _sibling(target: Path, kind: str) -> Path:
    host = socket.gethostname().replace("-", "_")
    return target.parent / f".{target.name}.{kind}-{host}-{os.getpid()}-{secrets.token_hex(4)}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_leftovers(target: Path) -> list[Path]:
    """Removes `.<name>.tmp-*` / `.<name>.old-*` siblings of exports on this host that died."""
    host = socket.gethostname().replace("-", "_")
    removed = []
    for kind in ("tmp", "old"):
        for path in target.parent.glob(f".{target.name}.{kind}-{host}-*"):
            pid = path.name[len(f".{target.name}.{kind}-{host}-") :].split("-")[0]
            if pid.isdigit() and not _alive(int(pid)):
                _remove(path)
                removed.append(path)
    return removed


def _umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it; set it straight back
    os.umask(mask)
    return mask


def _default_modes(path: Path) -> None:
    """Give `path` (and everything in it) the modes the user's umask gives new files.

    Some writers (the safetensors library among them) create their files 0600; an export must
    be readable by whoever the user's umask lets read it, e.g. a server running as another user.
    """
    mask = _umask()
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if not p.is_symlink():
            p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


def _replace(staging: Path, target: Path) -> None:
    if not (target.exists() or target.is_symlink()):
        os.replace(staging, target)
        return
    old = _sibling(target, "old")
    os.replace(target, old)
    os.replace(staging, target)
    _remove(old)


def _os_error(target: Path, err: OSError) -> ExportError:
    return ExportError(f"cannot write output {str(target)!r}: {err.strerror or err}")


@contextlib.contextmanager
def _published(staging: Path, target: Path, publish) -> Iterator[None]:
    """Around the writing of `staging`: on normal exit its modes are set and `publish(staging,
    target)` puts it in place; on any exception it is deleted (an `OSError` becomes the
    `ExportError` naming `target`)."""
    try:
        yield
        _default_modes(staging)
        publish(staging, target)
    except OSError as err:
        _remove(staging)
        raise _os_error(target, err) from err
    except BaseException:
        _remove(staging)
        raise


@contextlib.contextmanager
def atomic_output(
    target: str | Path, *, overwrite: bool, source: CheckpointRef | None = None
) -> Iterator[Path]:
    """Yields a new directory beside `target`; renamed to `target` on normal exit.

    On any exception the directory is deleted and `target` is left as it was.

    Example:
        >>> with atomic_output(tmp_path / "out", overwrite=False) as d:  # doctest: +SKIP
        ...     (d / "config.json").write_text("{}")
    """
    target = check_target(Path(target), overwrite, source=source)
    remove_leftovers(target)
    staging = _sibling(target, "tmp")
    try:
        staging.mkdir()
    except OSError as err:
        raise _os_error(target, err) from None
    with _published(staging, target, _replace):
        yield staging


@contextlib.contextmanager
def atomic_file(
    target: str | Path, *, overwrite: bool, source: CheckpointRef | None = None
) -> Iterator[Path]:
    """Yields a temporary file path beside `target`; `os.replace`d onto `target` on normal exit."""
    target = check_file_target(Path(target), overwrite, source=source)
    remove_leftovers(target)
    staging = _sibling(target, "tmp")
    try:
        staging.touch(exist_ok=False)
    except OSError as err:
        raise _os_error(target, err) from None
    with _published(staging, target, os.replace):
        yield staging
