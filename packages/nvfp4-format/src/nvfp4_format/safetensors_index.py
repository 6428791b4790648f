"""The index of a sharded safetensors checkpoint, ``model.safetensors.index.json``.

It maps each tensor name to the shard file that holds it (a file in the index's directory) and
may declare ``metadata.total_size``. Each shard is then an ordinary safetensors file.

Example:
    >>> index = read_safetensors_index("model.safetensors.index.json")  # doctest: +SKIP
    >>> index.shard_files[:1]  # doctest: +SKIP
    ('model-00001-of-00002.safetensors',)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from nvfp4_format.safetensors_header import is_nonnegative_int

__all__ = ["SafetensorsIndex", "read_safetensors_index"]


@dataclass(frozen=True)
class SafetensorsIndex:
    """A sharded checkpoint's ``model.safetensors.index.json``.

    Attributes:
        path: the index file.
        weight_map: tensor name -> shard file name (a bare name in the index's directory).
        total_size: the declared ``metadata.total_size`` in bytes, None when absent.
    """

    path: str
    weight_map: Mapping[str, str]
    total_size: int | None

    @property
    def shard_files(self) -> tuple[str, ...]:
        """Paths of the shards named by the index, sorted, each once."""
        directory = os.path.dirname(self.path)
        return tuple(os.path.join(directory, f) for f in sorted(set(self.weight_map.values())))


def read_safetensors_index(path: str | os.PathLike) -> SafetensorsIndex:
    """Reads and validates a ``model.safetensors.index.json``.

    Args:
        path: the index file.

    Returns:
        The `SafetensorsIndex`.

    Raises:
        ValueError: not a JSON object with a ``weight_map`` of tensor name -> bare file name,
            or a ``metadata.total_size`` that is not a non-negative integer.
    """
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a valid JSON index: {e}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ValueError(f"{path}: expected an object with a 'weight_map' of strings")
    for shard in set(weight_map.values()):
        if shard != os.path.basename(shard) or shard in ("", ".", ".."):
            raise ValueError(
                f"{path}: weight_map names shard {shard!r}; expected a file name in the "
                f"index's directory"
            )
    metadata = index.get("metadata") or {}
    total_size = metadata.get("total_size") if isinstance(metadata, dict) else None
    if total_size is not None and not is_nonnegative_int(total_size):
        raise ValueError(f"{path}: metadata.total_size must be a non-negative integer")
    return SafetensorsIndex(path, MappingProxyType(dict(weight_map)), total_size)
