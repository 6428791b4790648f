"""JSON files an export writes: one spelling (two-space indent, a final newline)."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(path: Path, content: dict) -> None:
    """Writes `content` to `path` as indented JSON (the export's config and metadata files)."""
    path.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
