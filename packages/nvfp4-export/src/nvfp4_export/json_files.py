"""JSON files an export writes (one spelling: two-space indent, a final newline), and the SHA-256
digests that say a JSON value or a file is the one written (`json_sha256`, `file_sha256`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

CHUNK = 1 << 20
"""Bytes read per step when hashing a file."""


def write_json(path: Path, content: dict) -> None:
    """Writes `content` to `path` as indented JSON (the export's config and metadata files)."""
    path.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")


def canonical_json(value: Any) -> bytes:
    """`value` as canonical JSON bytes: object keys sorted, no whitespace, ASCII only (other
    characters as \\u escapes), floats in Python's shortest round-trip form. A value written as
    JSON and read back has the same canonical form, whatever spacing the file used.

    Example:
        >>> canonical_json({"b": [1, 2.5], "a": "é"})
        b'{"a":"\\\\u00e9","b":[1,2.5]}'
    """
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return text.encode("ascii")


def json_sha256(value: Any) -> str:
    """SHA-256 (hex) of `canonical_json(value)`: the checksum of a checkpoint's `config` and
    `quant_stats` items (docs/checkpoint-schema.md) and of an export's manifest."""
    return hashlib.sha256(canonical_json(value)).hexdigest()


def file_sha256(path: Path) -> str:
    """SHA-256 (hex) of a file's bytes, read a chunk at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
