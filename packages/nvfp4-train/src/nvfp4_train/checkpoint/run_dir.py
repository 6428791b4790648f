"""The run directory: created with errors a person can act on, and used by one run at a time.

`make_run_dir` creates `output_dir` (and its parents) or says why it cannot: it is a file, a
parent is a file, it is not writable; `run_directory` removes one it created if the run fails
before writing anything into it. `run_lock` takes an exclusive lock on it for the whole run
(`nvfp4-train run` and `nvfp4-train eval` both write to it): a second process is refused with the
holder's pid, host and start time. The lock is an `fcntl.flock` on `.nvfp4-train.lock`, which the
operating system releases when its process ends, however it ends (SIGKILL included), so a stale
lock file never blocks a later run. On network file systems whose flock is local to one host the
lock only excludes runs on the same host.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from nvfp4_train.errors import ConfigError

LOCK_FILE = ".nvfp4-train.lock"
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoints"
TENSORBOARD_DIR = "tensorboard"
TOKENIZER_DIR = "tokenizer"
"""What a run directory holds (docs/checkpoint-schema.md): the resolved config, the metrics rows,
orbax checkpoints, TensorBoard events and the tokenizer."""


def make_run_dir(path: Path) -> Path:
    """Creates `path` (with parents) if missing; ConfigError naming the path and the fix if not."""
    where = f"output_dir {str(path)!r}"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(
            f"{where} is a file, not a directory; choose another output_dir"
        ) from None
    except NotADirectoryError:
        raise ConfigError(
            f"{where} cannot be created: one of its parents is a file; choose another output_dir"
        ) from None
    except PermissionError:
        raise ConfigError(
            f"{where} cannot be created: permission denied; choose a directory you can write to"
        ) from None
    except OSError as e:
        raise ConfigError(f"{where} cannot be created: {e.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{where} is not writable by this user; choose another output_dir")
    return path


@contextlib.contextmanager
def run_directory(path: Path) -> Iterator[Path]:
    """`make_run_dir(path)` for the block; a directory this call created is removed again if
    the block fails while no file but the run lock is in it (empty directories, such as the
    checkpoint manager's, aside): a run that never started leaves no run directory behind. A
    directory that existed is never touched."""
    created = not path.exists()
    make_run_dir(path)
    try:
        yield path
    except BaseException:
        if created and all(p.is_dir() or p.name == LOCK_FILE for p in path.rglob("*")):
            (path / LOCK_FILE).unlink(missing_ok=True)
            for directory in sorted(path.rglob("*"), key=lambda p: -len(p.parts)):
                directory.rmdir()
            path.rmdir()
        raise


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return "another process"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
    return f"pid {info.get('pid')} on {info.get('host')} since {started}: {info.get('command')}"


@contextlib.contextmanager
def run_lock(path: Path) -> Iterator[None]:
    """Holds an exclusive lock on the run directory `path` while the block runs.

    Raises:
        ConfigError: another live process holds the lock (the message says which).
    """
    lock = path / LOCK_FILE
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise ConfigError(f"cannot create the lock file {str(lock)!r}: {e.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError(f"cannot lock {str(lock)!r}: {e.strerror}") from None
            raise ConfigError(
                f"output_dir {str(path)!r} is in use by another nvfp4-train process "
                f"({_holder(fd)}); wait for it to finish, or choose another output_dir"
            ) from None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        info["command"] = " ".join(sys.argv) or "python"
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock
