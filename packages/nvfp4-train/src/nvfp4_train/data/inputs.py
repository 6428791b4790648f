"""Reading raw corpora for `prepare-data`: parquet, JSON Lines and plain text, in record batches.

Every reader yields `RecordBatch`es: the texts of consecutive records (None for a record whose
text is empty or null, which is skipped), the index of the first record, and how many bytes of
the file the batch stands for (for the progress bar). A parquet row, a JSON line and a text file
are one record each. `skip` records are passed over unread (resuming), so record indices are
the same on every run. Files are data: JSON is parsed with `json.loads`, nothing is executed.

Example:
    >>> import tempfile
    >>> file = Path(tempfile.mkdtemp()) / "a.jsonl"
    >>> _ = file.write_text('{"text": "hi"}\\n{"text": ""}\\n{"text": "yo"}\\n')
    >>> [b.texts for b in read_records(file, "text", skip=0, batch=2)]
    [['hi', None], ['yo']]
"""

import dataclasses
import gzip
import json
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from nvfp4_train.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
SUFFIXES = (".parquet", *JSONL_SUFFIXES, ".txt")


@dataclasses.dataclass(frozen=True)
class RecordBatch:
    texts: list[str | None]
    first: int
    bytes: float


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in SUFFIXES if name.endswith(s)), None)


def input_files(paths: Sequence[str | Path]) -> list[Path]:
    """The input files: each file as given, each directory's readable files (recursively, sorted)."""
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and _kind(p))
            if not found:
                raise DataError(f"{str(path)!r}: no {', '.join(SUFFIXES)} files in this directory")
            files.extend(found)
        elif path.is_file():
            if not _kind(path):
                raise DataError(f"{str(path)!r}: not a corpus file; expected {', '.join(SUFFIXES)}")
            files.append(path)
        else:
            raise DataError(f"{str(path)!r} does not exist")
    return files


def _text_or_none(value: object, file: Path, where: str, field: str) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise DataError(
            f"{str(file)!r}: {where}: field {field!r} holds {type(value).__name__}, not text"
        )
    return value


def _parquet(file: Path, field: str, skip: int, batch: int) -> Iterator[RecordBatch]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(file)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{str(file)!r}: not a readable parquet file ({e})") from None
    names = reader.schema_arrow.names
    if field not in names:
        raise DataError(f"{str(file)!r}: no column {field!r} (columns: {', '.join(names)})")
    rows = reader.metadata.num_rows
    size = file.stat().st_size
    first = 0
    for table in reader.iter_batches(batch_size=batch, columns=[field]):
        column = table.column(0)
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            raise DataError(f"{str(file)!r}: column {field!r} is {column.type}, not text")
        count = len(column)
        if first + count > skip:
            texts = column.to_pylist()[max(0, skip - first) :]
            yield RecordBatch(
                [t or None for t in texts], max(first, skip), size * len(texts) / rows
            )
        first += count


def _jsonl(file: Path, field: str, skip: int, batch: int) -> Iterator[RecordBatch]:
    texts, first, last = [], skip, 0
    with open(file, "rb") as raw:
        lines = gzip.GzipFile(fileobj=raw) if file.name.lower().endswith(".gz") else raw
        for index, line in enumerate(lines):
            if index < skip:
                continue
            texts.append(_json_text(line, file, index, field) if line.strip() else None)
            if len(texts) == batch:
                yield RecordBatch(texts, first, raw.tell() - last)
                texts, first, last = [], index + 1, raw.tell()
        if texts:
            yield RecordBatch(texts, first, raw.tell() - last)


def _json_text(line: bytes, file: Path, index: int, field: str) -> str | None:
    try:
        record = json.loads(line)
    except ValueError as e:
        raise DataError(f"{str(file)!r}: line {index + 1} is not JSON ({e})") from None
    if not isinstance(record, dict) or field not in record:
        raise DataError(f"{str(file)!r}: line {index + 1} has no field {field!r}")
    return _text_or_none(record[field], file, f"line {index + 1}", field)


def _unbroken(batches: Iterator[RecordBatch], file: Path) -> Iterator[RecordBatch]:
    """`batches`, with a file that breaks while being read (a truncated parquet page, a damaged
    gzip stream, bytes that are not UTF-8) reported as a DataError naming it."""
    import pyarrow as pa

    try:
        yield from batches
    except (pa.ArrowException, OSError, EOFError, UnicodeDecodeError, zlib.error) as e:
        raise DataError(f"{str(file)!r} is damaged: {type(e).__name__}: {e}") from None


def read_records(file: Path, field: str, *, skip: int, batch: int) -> Iterator[RecordBatch]:
    """Yields the records of `file` from record `skip` on, `batch` at a time.

    Raises:
        DataError: an unreadable file, a parquet file without column `field`, a JSON line that
            is not an object with `field`, a text that is not UTF-8.
    """
    kind = _kind(file)
    if kind == ".parquet":
        yield from _unbroken(_parquet(file, field, skip, batch), file)
    elif kind in JSONL_SUFFIXES:
        yield from _unbroken(_jsonl(file, field, skip, batch), file)
    elif skip == 0:
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{str(file)!r} is not UTF-8 text ({e})") from None
        yield RecordBatch([text or None], 0, file.stat().st_size)
