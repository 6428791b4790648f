"""The `params` item of a checkpoint, read one tensor at a time (bounded memory).

`CheckpointParams` is a read-only mapping, dotted path (`layers.0.attn.qkv.kernel`) -> float32
array, whose shapes come from the item's metadata and whose values are restored on access through
orbax's partial restore (only the requested leaf is read). Nothing is cached: holding a value is
the caller's choice, so an export that handles one tensor at a time holds one tensor at a time.
Every value read is checked (finite, and its checksums against the `integrity` item when the
checkpoint has one).
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from nvfp4_export.errors import ExportError

READ_AHEAD = 8
"""Most tensors `CheckpointParams.read_ahead` reads ahead of the one being used."""
READ_AHEAD_BYTES = 512 << 20
"""Most bytes of float32 tensors read ahead (the next tensor is read whatever its size)."""


def tree_metadata(item_dir: Path) -> Any:
    """The tree of an orbax PyTree item's metadata (leaves carry shape and dtype; nothing read)."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.PyTreeCheckpointer()
    try:
        metadata = checkpointer.metadata(item_dir)
    finally:
        checkpointer.close()
    tree = getattr(metadata, "item_metadata", metadata)
    return getattr(tree, "tree", tree)


def _leaf_shapes(tree: Any, prefix: str = "") -> dict[str, tuple[int, ...]]:
    if isinstance(tree, Mapping):
        shapes: dict[str, tuple[int, ...]] = {}
        for key, value in tree.items():
            shapes.update(_leaf_shapes(value, f"{prefix}{key}."))
        return shapes
    shape = getattr(tree, "shape", None)
    if shape is None:
        raise ExportError(f"params leaf {prefix[:-1]!r} is not an array ({type(tree).__name__})")
    return {prefix[:-1]: tuple(int(n) for n in shape)}


def _nested(path: str, leaf: Any) -> dict[str, Any]:
    """`a.b.c`, leaf -> {"a": {"b": {"c": leaf}}}."""
    tree: Any = leaf
    for key in reversed(path.split(".")):
        tree = {key: tree}
    return tree


def _restore_leaf(item_dir: Path, path: str) -> np.ndarray:
    """One leaf of an orbax PyTree item (orbax partial restore: only that leaf is read)."""
    import orbax.checkpoint as ocp

    args = _nested(path, ocp.RestoreArgs(restore_type=np.ndarray))
    checkpointer = ocp.PyTreeCheckpointer()
    try:
        restore = ocp.args.PyTreeRestore(item=args, restore_args=args, partial_restore=True)
        tree = checkpointer.restore(item_dir, args=restore)
    finally:
        checkpointer.close()
    for key in path.split("."):
        tree = tree[key]
    return np.asarray(tree)


class CheckpointParams(Mapping[str, np.ndarray]):
    """Read-only mapping of a `params` item's leaves, each read from disk on access.

    Args:
        item_dir: the `params` item directory (absolute).
        expected_checksums: `params.<path>` -> the two checksums training saved (the
            `integrity` item), or None when the checkpoint has none.
        checksums: the checksum function (`checkpoint.checksums`).

    Example:
        >>> params = CheckpointParams(step_dir / "params", None, checksums)  # doctest: +SKIP
        >>> params.shapes["embed.embedding"], params["embed.embedding"].dtype  # doctest: +SKIP
        ((32000, 2048), dtype('float32'))
    """

    def __init__(
        self,
        item_dir: Path,
        expected_checksums: Mapping[str, list[int]] | None,
        checksums: Callable[[np.ndarray], list[int]],
    ) -> None:
        self._item_dir = item_dir
        self._expected = expected_checksums
        self._checksums = checksums
        self._shapes = _leaf_shapes(tree_metadata(item_dir))

    @property
    def shapes(self) -> Mapping[str, tuple[int, ...]]:
        """Path -> shape, from the metadata (nothing read)."""
        return dict(self._shapes)

    def nbytes(self, name: str) -> int:
        """Bytes of leaf `name` as float32 (from its shape)."""
        return 4 * int(np.prod(self._shapes[name], dtype=np.int64))

    def __len__(self) -> int:
        return len(self._shapes)

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __contains__(self, name: object) -> bool:
        return name in self._shapes

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._shapes:
            raise KeyError(name)
        try:
            value = _restore_leaf(self._item_dir, name)
        except Exception as err:  # orbax raises many types for a damaged item
            first = str(err).splitlines()[0] if str(err) else ""
            raise ExportError(
                f"checkpoint item {str(self._item_dir)!r} cannot be read at {name!r}: "
                f"{type(err).__name__}: {first}"
            ) from err
        self._check(name, value)
        return value

    def _check(self, name: str, value: np.ndarray) -> None:
        # NaN propagates through max and min, +Inf shows in max, -Inf in min: two reductions,
        # no temporary the size of the tensor (np.isfinite(value).all() allocates one)
        if value.size and not (np.isfinite(value.max()) and np.isfinite(value.min())):
            raise ExportError(f"parameter {name!r} holds NaN or Inf; refusing to export it")
        if self._expected is None:
            return
        if self._expected.get(f"params.{name}") != self._checksums(value):
            raise ExportError(
                f"checkpoint {str(self._item_dir.parent)!r} is not what was saved: the checksums "
                f"of {name} differ from its integrity item (bytes changed on disk?); refusing to "
                "export it"
            )

    def read_ahead(
        self, names: Iterable[str], depth: int = READ_AHEAD, budget_bytes: int = READ_AHEAD_BYTES
    ) -> Iterator[tuple[str, np.ndarray]]:
        """(name, value) for each of `names` in order, read in a background thread while the
        caller works on earlier values: up to `depth` values ahead, together at most
        `budget_bytes` (but always the next one, whatever its size), so what is held is bounded
        by `budget_bytes` (or the next tensor) plus the value in use, whatever the model's size.

        Reading is the slow half of an export (zstd-decoded chunks, one tensor at a time) and
        tensors take unequal times to read and to convert: a queue several deep keeps the
        reader busy (the 1.1B benchmark: 17.5 s one ahead, 14.8 s two, ~10 s with this budget).
        """
        names = list(names)
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            pending: collections.deque = collections.deque()  # (bytes, future), in order
            queued = held = 0
            try:
                for name in names:
                    while queued < len(names) and len(pending) < depth:
                        size = self.nbytes(names[queued])
                        if pending and held + size > budget_bytes:
                            break
                        pending.append((size, pool.submit(self.__getitem__, names[queued])))
                        held, queued = held + size, queued + 1
                    size, future = pending.popleft()
                    held -= size
                    value = future.result()
                    yield name, value
                    del value, future
            finally:  # stopped early (an error downstream): reads not started are dropped
                for _, future in pending:
                    future.cancel()
