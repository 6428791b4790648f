"""Files a command writes where the user says (`-o`): never over a file the command did not
write, and (figures) only in a format matplotlib can write, checked before anything is drawn.

Example:
    >>> check_figure_output("notes.txt")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    nvfp4_train.errors.ConfigError: -o 'notes.txt': matplotlib cannot write '.txt' files; ...
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from nvfp4_train.errors import ConfigError

PLOT_SOFTWARE = "nvfp4-train plot"
"""The PNG `Software` text `nvfp4-train plot` writes: a PNG holding it is the command's own."""


def refuse_existing(path: str | Path, ours: Callable[[Path], bool] = lambda _: False) -> None:
    """Raises unless `path` does not exist or `ours(path)` says this command wrote it.

    Raises:
        ConfigError: `path` exists (the wording of `eval -o` and `plot -o`).
    """
    path = Path(path)
    if path.exists() and not ours(path):
        raise ConfigError(f"{str(path)!r} exists; not overwriting it (remove it or choose -o)")


def supported_figure_formats() -> dict[str, str]:
    """{extension: description} of what matplotlib's `savefig` writes (png, pdf, svg, ...)."""
    from matplotlib.figure import Figure

    return Figure().canvas.get_supported_filetypes()


def figure_metadata(path: str | Path) -> dict[str, str] | None:
    """The `savefig(metadata=)` marking a PNG as written by `nvfp4-train plot` (None otherwise)."""
    return {"Software": PLOT_SOFTWARE} if Path(path).suffix.lower() == ".png" else None


def written_by_plot(path: Path) -> bool:
    """Whether `path` is a PNG `nvfp4-train plot` wrote (its `Software` text)."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            return image.format == "PNG" and image.info.get("Software") == PLOT_SOFTWARE
    except (OSError, ValueError):  # not an image (PIL's UnidentifiedImageError is an OSError)
        return False


def check_figure_output(path: str | Path) -> None:
    """Checks a figure's `-o` before anything is drawn: a format matplotlib writes, and not a
    file `nvfp4-train plot` did not write.

    Raises:
        ConfigError: an extension matplotlib cannot write (naming those it can), or an
            existing file that is not one of the command's own PNGs.
    """
    path = Path(path)
    formats = supported_figure_formats()
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in formats:
        kind = f"'.{suffix}'" if suffix else "(no extension)"
        raise ConfigError(f"-o {str(path)!r}: matplotlib cannot write {kind} files; use one of "
                          f"{', '.join('.' + f for f in sorted(formats))}")  # fmt: skip
    refuse_existing(path, ours=written_by_plot)
