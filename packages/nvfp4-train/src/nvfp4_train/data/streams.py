"""Token streams made of many pieces (shard files, ArrayRecord records), read lazily.

A `PieceStream` looks like a flat 1-D id array to `PackedSequences`: `size`, `dtype`, and
`stream[a:b]`, which reads only the pieces the slice touches. Its memory is the table of piece
offsets (8 bytes a piece) plus the slice read, whatever the corpus size. It pickles (for grain
worker processes) as file names and offsets, never as contents.

- `ShardStream`: raw little-endian token files (the shards `nvfp4-train prepare-data` writes),
  memory-mapped one at a time as slices reach them.
- `ArrayRecordStream`: ArrayRecord records, one document each, with the separator appended to
  every record; one pass over the records at start-up measures them.

Example:
    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> for name, ids in (("a.bin", [1, 2, 3]), ("b.bin", [4, 5])):
    ...     np.array(ids, dtype="<u2").tofile(d / name)
    >>> stream = ShardStream([d / "a.bin", d / "b.bin"], "uint16")
    >>> stream.size, stream[2:5].tolist()
    (5, [3, 4, 5])
"""

import abc
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from nvfp4_train.errors import DataError


class PieceStream(abc.ABC):
    """The concatenation of `len(lengths)` pieces; a subclass says how to read one piece."""

    def __init__(self, lengths: Sequence[int], dtype: np.dtype) -> None:
        self._ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
        self.dtype = np.dtype(dtype)
        self.size = int(self._ends[-1]) if self._ends.size else 0
        self.shape = (self.size,)

    def __len__(self) -> int:
        return self.size

    @abc.abstractmethod
    def _read(self, piece: int, lo: int, hi: int) -> np.ndarray:
        """Elements [lo, hi) of piece `piece`."""

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"{type(self).__name__} reads contiguous slices, got {key!r}")
        start, stop, _ = key.indices(self.size)
        if stop <= start:
            return np.zeros(0, dtype=self.dtype)
        first = int(np.searchsorted(self._ends, start, side="right"))
        parts = []
        for piece in range(first, self._ends.size):
            begin = int(self._ends[piece - 1]) if piece else 0
            if begin >= stop:
                break
            parts.append(
                self._read(
                    piece, max(start, begin) - begin, min(stop, int(self._ends[piece])) - begin
                )
            )
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


class ShardStream(PieceStream):
    """Raw little-endian `dtype` token files, read through one memory map per file."""

    def __init__(self, files: Sequence[Path], dtype: str) -> None:
        self._files = [Path(f) for f in files]
        little = np.dtype(dtype).newbyteorder("<")
        lengths = []
        for file in self._files:
            size = file.stat().st_size
            if size == 0 or size % little.itemsize:
                raise DataError(
                    f"data.path: shard {str(file)!r} has {size} bytes, not a positive multiple "
                    f"of {little.itemsize} ({dtype} ids)"
                )
            lengths.append(size // little.itemsize)
        super().__init__(lengths, little)
        self._maps: dict[int, np.memmap] = {}

    def _read(self, piece: int, lo: int, hi: int) -> np.ndarray:
        if piece not in self._maps:
            self._maps[piece] = np.memmap(self._files[piece], dtype=self.dtype, mode="r")
        return self._maps[piece][lo:hi]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": {}}


class ArrayRecordStream(PieceStream):
    """ArrayRecord records (the raw little-endian ids of one document each), `eos_id` after each.

    Args:
        files: the `.array_record` shards, in order.
        dtype: "uint16" or "uint32", the ids' type in every record.
        eos_id: the separator appended after every record (None: records are joined as they are).
    """

    def __init__(self, files: Sequence[Path], dtype: str, eos_id: int | None) -> None:
        self._files = [str(f) for f in files]
        self._eos = np.zeros(0 if eos_id is None else 1, dtype=np.dtype(dtype).newbyteorder("<"))
        self._eos[:] = eos_id or 0
        self._source = self._open()
        little = self._eos.dtype
        lengths = np.empty(len(self._source), dtype=np.int64)
        for index in range(len(self._source)):
            size = len(self._source[index])
            if size % little.itemsize:
                raise DataError(
                    f"data.path: ArrayRecord record {index} has {size} bytes, not a multiple "
                    f"of {little.itemsize}: is data.tokens_dtype={dtype!r} right?"
                )
            lengths[index] = size // little.itemsize + self._eos.size
        super().__init__(lengths, little)

    def _open(self):
        try:
            from grain.python import ArrayRecordDataSource
        except ImportError as e:  # grain without the array_record extra
            raise DataError(
                f"data.path: reading ArrayRecord files needs `array_record` ({e})"
            ) from e
        return ArrayRecordDataSource(self._files)

    def _read(self, piece: int, lo: int, hi: int) -> np.ndarray:
        ids = np.frombuffer(self._source[piece], dtype=self.dtype)
        return np.concatenate([ids, self._eos])[lo:hi]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_source": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._source = self._open()
