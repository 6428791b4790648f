"""The one exception type the export raises for bad input (a `ValueError`, so callers may catch either)."""

from __future__ import annotations


class ExportError(ValueError):
    """A checkpoint, option or output directory the export cannot use; the message says why."""
