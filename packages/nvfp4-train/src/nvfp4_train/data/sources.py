"""Reading corpora: text files into documents, token files into (memory-mapped) id arrays.

Files from users are data: text is decoded as UTF-8, `.npy` files are loaded with
`allow_pickle=False`, raw files are memory-mapped read-only. Nothing is cached on disk.

Example:
    >>> tokens = synthetic_stream(vocab_size=16, num_tokens=8)
    >>> tokens.shape, int(tokens.max()) < 16
    ((8,), True)
"""

from pathlib import Path

import numpy as np

from nvfp4_train.data.streams import ArrayRecordStream, PieceStream
from nvfp4_train.errors import DataError

SYNTHETIC_STEPS = (1, 2, 3, 5)
SYNTHETIC_SEED = 0
ARRAY_RECORD_SUFFIX = ".array_record"
TOKEN_FILE_KINDS = (".npy", ".bin", ARRAY_RECORD_SUFFIX, "a directory of .array_record shards")


def existing(path: str, key: str = "data.path") -> Path:
    """`path` (with `~` expanded), which must exist: else a DataError naming `key`."""
    resolved = Path(path).expanduser()
    if not resolved.exists():
        hint = " (the built-in corpus is data.source=builtin)" if path == "builtin" else ""
        raise DataError(f"{key}: {path!r} does not exist{hint}")
    return resolved


def text_files(path: str, text_glob: str) -> list[Path]:
    """The text files of a "text" source: `path` itself, or the sorted matches of `text_glob`."""
    root = existing(path)
    if root.is_file():
        return [root]
    files = sorted(p for p in root.glob(text_glob) if p.is_file())
    if not files:
        raise DataError(
            f"data.path: no files match data.text_glob={text_glob!r} in directory {path!r} "
            "(use '**/*.txt' to search subdirectories)"
        )
    return files


def read_documents(files: list[Path]) -> list[str]:
    """Reads each file as one UTF-8 document; empty files are skipped."""
    documents = []
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"data.path: {str(file)!r} is not UTF-8 text ({e})") from None
        if text:
            documents.append(text)
    if not documents:
        raise DataError(f"data.path: the corpus is empty ({len(files)} file(s), all empty)")
    return documents


def synthetic_stream(vocab_size: int, num_tokens: int) -> np.ndarray:
    """A learnable token stream: each id is the previous one plus 1, 2, 3 or 5 (mod `vocab_size`).

    Uniform guessing costs log(vocab_size) nats per token, the best model log(4), so a training
    loss that falls shows the model learns. The stream is fixed (seeded by `SYNTHETIC_SEED`).
    """
    rng = np.random.default_rng(SYNTHETIC_SEED)
    steps = rng.choice(np.array(SYNTHETIC_STEPS, dtype=np.int64), size=num_tokens)
    tokens = np.cumsum(steps) % vocab_size
    return tokens.astype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def _check_integer(array: np.ndarray, where: str) -> None:
    if array.dtype.kind not in "ui":
        raise DataError(
            f"data.path: {where} holds {array.dtype} values; token ids must be an integer dtype "
            "(uint16, uint32, int32, int64)"
        )


def _load_npy(file: Path) -> np.ndarray:
    try:
        array = np.load(file, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        raise DataError(
            f"data.path: cannot memory-map {str(file)!r} as a .npy array: {e}"
        ) from None
    _check_integer(array, repr(str(file)))
    return array.reshape(-1)


def _load_bin(file: Path, dtype: str) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    size = file.stat().st_size
    if size % itemsize:
        raise DataError(
            f"data.path: {str(file)!r} has {size} bytes, not a multiple of {itemsize}: is "
            f"data.tokens_dtype={dtype!r} the dtype it was written with?"
        )
    if size == 0:
        raise DataError(f"data.path: {str(file)!r} is empty")
    return np.memmap(file, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")


def _array_record_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    files = sorted(p for p in root.glob(f"*{ARRAY_RECORD_SUFFIX}*") if p.is_file())
    if not files:
        raise DataError(f"data.path: no *{ARRAY_RECORD_SUFFIX} files in directory {str(root)!r}")
    return files


def _load_array_record(root: Path, dtype: str, eos_id: int | None) -> ArrayRecordStream:
    """Every record (one document: raw little-endian `dtype` ids), `eos_id` after each, read lazily."""
    stream = ArrayRecordStream(_array_record_files(root), dtype, eos_id)
    if stream.size == 0:
        raise DataError(f"data.path: the ArrayRecord corpus {str(root)!r} has no records")
    return stream


def token_array(path: str, dtype: str, eos_id: int | None) -> np.ndarray | PieceStream:
    """Opens a pre-tokenized corpus as one flat id stream, read lazily (memory-mapped or by record).

    Args:
        path: a `.npy` file, a raw `.bin` file, an `.array_record` file or a directory of them.
        dtype: element type of `.bin` files and ArrayRecord records ("uint16" or "uint32").
        eos_id: separator appended after each ArrayRecord record (None: no separator); `.npy`
            and `.bin` streams are used as they are.
    """
    root = existing(path)
    if root.is_dir() or root.name.endswith(ARRAY_RECORD_SUFFIX):
        tokens = _load_array_record(root, dtype, eos_id)
    elif root.suffix == ".npy":
        tokens = _load_npy(root)
    elif root.suffix == ".bin":
        tokens = _load_bin(root, dtype)
    else:
        raise DataError(
            f"data.path: {path!r} is not a token file; expected one of {', '.join(TOKEN_FILE_KINDS)}"
        )
    if tokens.size == 0:
        raise DataError(f"data.path: the token corpus {path!r} is empty")
    return tokens
