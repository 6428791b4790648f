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
import os
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from nvfp4_train.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
SUFFIXES = (".parquet", *JSONL_SUFFIXES, ".txt")
COMPRESSED = (".zst", ".zstd", ".bz2", ".xz", ".lz4", ".gz", ".zip", ".tar", ".7z")
NOT_CORPUS_STEMS = ("license", "licence", "copying", "notice", "readme", "changelog")
"""Files in an input directory named like these (`LICENSE.txt`, `README.txt`) are not text to
train on; name one as an INPUT to take it anyway."""


@dataclasses.dataclass(frozen=True)
class RecordBatch:
    texts: list[str | None]
    first: int
    bytes: float
    skipped: float = 0.0  # bytes of the records before `first` passed over unread (resuming)


@dataclasses.dataclass(frozen=True)
class InputFiles:
    """What `input_files` found: the files to read, in order, and every file (or directory)
    under an input directory that is not read, with the reason."""

    files: list[Path]
    skipped: list[dict[str, str]]


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in SUFFIXES if name.endswith(s)), None)


def _not_corpus(path: Path) -> str | None:
    """Why a file cannot be read as corpus (None: it can)."""
    if _kind(path):
        return None
    name = path.name.lower()
    packed = next((s for s in COMPRESSED if name.endswith(s)), None)
    if packed:
        return (
            f"compressed ({packed}); only .jsonl.gz / .json.gz are read compressed: decompress it"
        )
    return f"not a corpus file ({path.suffix or 'no suffix'}); expected {', '.join(SUFFIXES)}"


def _found_skip(path: Path) -> str | None:
    """Why a file found in an input directory is not read (None: it is)."""
    if path.name.startswith("."):
        return "hidden"
    if not path.is_file():
        return "not a regular file (a broken link?)"
    reason = _not_corpus(path)
    if reason is None and path.name.split(".")[0].lower() in NOT_CORPUS_STEMS:
        reason = "a licence / readme file, not corpus text (name it as an INPUT to take it)"
    return reason


def _walk(root: Path, output: Path, skipped: list[dict[str, str]]) -> list[Path]:
    """The readable files under `root` (sorted); records what is not read in `skipped`."""
    found = []
    for folder, dirs, names in os.walk(root):
        here = Path(folder)
        for name in sorted(dirs):
            sub = here / name
            reason = (
                "hidden directory" if name.startswith(".")
                else "the --output directory" if sub.resolve() == output
                else "a link to a directory (not followed; name it as an INPUT)"
                if sub.is_symlink() else None
            )  # fmt: skip
            if reason:
                dirs.remove(name)
                skipped.append({"path": str(sub), "reason": reason})
        for name in names:
            file = here / name
            reason = _found_skip(file)
            if reason:
                skipped.append({"path": str(file), "reason": reason})
            else:
                found.append(file)
    return sorted(found)


def _inside(path: Path, output: Path) -> bool:
    resolved = path.resolve()
    return resolved == output or output in resolved.parents


def input_files(paths: Sequence[str | Path], output: str | Path | None = None) -> InputFiles:
    """The input files: each file as given, each directory's readable files (recursively, sorted,
    hidden ones and the `output` directory left out); a file reached twice is read once.

    Raises:
        DataError: a missing input, a file that is not a corpus file, a directory without one,
            an input inside `output`, or no input at all.
    """
    out = Path(output).resolve() if output is not None else None
    given = [Path(p) for p in paths]
    inside = [p for p in given if out is not None and p.exists() and _inside(p, out)]
    if inside:
        left = "no input left" if len(inside) == len(given) else "it is not read"
        raise DataError(
            f"input {str(inside[0])!r} lies in --output {str(output)!r}, which prepare-data "
            f"never reads as input ({left}); choose an --output outside the inputs"
        )
    files, skipped, first_as = [], [], {}
    for path in given:
        if path.is_dir():
            before = len(skipped)
            found = _walk(path, out, skipped)
            if not found:
                passed = [f"{Path(e['path']).name}: {e['reason']}" for e in skipped[before:]]
                why = f" (skipped: {'; '.join(passed[:3])}{'; ...' if len(passed) > 3 else ''})"
                raise DataError(
                    f"{str(path)!r}: no {', '.join(SUFFIXES)} files in this directory"
                    + (why if passed else "")
                )
        elif path.is_file():
            reason = _not_corpus(path)
            if reason:
                raise DataError(f"{str(path)!r}: {reason}")
            found = [path]
        else:
            raise DataError(f"{str(path)!r} does not exist")
        for file in found:
            key = file.resolve()
            if key in first_as:
                skipped.append(
                    {"path": str(file), "reason": f"already an input (as {first_as[key]})"}
                )
            else:
                first_as[key] = str(file)
                files.append(file)
    if not files:
        raise DataError("no input files")
    return InputFiles(files, sorted(skipped, key=lambda entry: entry["path"]))


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
    string_view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16
    text_types = (pa.types.is_string, pa.types.is_large_string, string_view)
    rows = reader.metadata.num_rows
    size = file.stat().st_size
    first, passed = 0, skip  # the records passed over, reported with the first batch
    for table in reader.iter_batches(batch_size=batch, columns=[field]):
        column = table.column(0)
        if pa.types.is_dictionary(column.type):  # what pandas writes for a categorical
            column = column.dictionary_decode()
        if not any(is_text(column.type) for is_text in text_types):
            raise DataError(f"{str(file)!r}: column {field!r} is {column.type}, not text")
        count = len(column)
        if first + count > skip:
            texts = column.to_pylist()[max(0, skip - first) :]
            start, share = max(first, skip), size / rows
            yield RecordBatch([t or None for t in texts], start, share * len(texts), share * passed)
            passed = 0
        first += count


def _jsonl(file: Path, field: str, skip: int, batch: int) -> Iterator[RecordBatch]:
    texts, first, last = [], skip, 0
    with open(file, "rb") as raw:
        lines = gzip.GzipFile(fileobj=raw) if file.name.lower().endswith(".gz") else raw
        passed = 0.0  # bytes of the records passed over, reported with the first batch
        for index, line in enumerate(lines):
            if index < skip:
                continue
            if index == skip and skip:
                passed = last = raw.tell()  # where reading starts (to a buffer's read-ahead)
            texts.append(_json_text(line, file, index, field) if line.strip() else None)
            if len(texts) == batch:
                yield RecordBatch(texts, first, raw.tell() - last, passed)
                texts, first, last, passed = [], index + 1, raw.tell(), 0.0
        if texts:
            yield RecordBatch(texts, first, raw.tell() - last, passed)


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
