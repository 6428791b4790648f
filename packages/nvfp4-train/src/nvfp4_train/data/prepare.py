"""`prepare-data`: raw corpora to token shards with a tokenizer, resumable and byte-reproducible.

Records are read in order (files sorted, records in file order), tokenized in batches by the Hugging
Face `tokenizers` library (its Rust encoder runs a batch on every core), each document followed
by the separator, and cut into shards of at least `shard_tokens` tokens at document boundaries.
A shard is written to a temporary file and renamed; then `prepare-state.json` records it with the
record to read next. Interrupted and rerun with the same arguments, the preparation deletes its
own shards the state does not list and continues from that record: as every shard depends only
on the records before it, the output is byte-identical to an uninterrupted run. The manifest is
written last (see `nvfp4_train.data.prepared`). Which output directories it may write into, and
what a resume or a rerun checks first, is `nvfp4_train.data.prepare_output`.
"""

import dataclasses
import hashlib
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import tokenizers

from nvfp4_train.data.inputs import input_files, read_records
from nvfp4_train.data.prepare_output import (
    claim_output,
    finished_problem,
    read_own,
    remove_leftovers,
    remove_own_files,
    resume_problem,
)
from nvfp4_train.data.prepared import (
    FORMAT,
    MANIFEST,
    STATE,
    VERSION,
    file_sha256,
    shard_name,
    write_json_atomically,
)
from nvfp4_train.data.tokenization import (
    TOKENIZER_FILE,
    encode_joined,
    token_dtype,
    tokenizer_file,
)
from nvfp4_train.errors import DataError

BATCH_RECORDS = 1024


@dataclasses.dataclass(frozen=True)
class Progress:
    """What `prepare_corpus` reports after every batch (for a progress bar)."""

    bytes_done: float
    bytes_total: int
    documents: int
    tokens: int
    shards: int


def _tokenizer(path: str | Path, eos_token: str) -> tuple[Path, tokenizers.Tokenizer, int]:
    file = tokenizer_file(path)
    try:
        hf = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises a bare Exception
        raise DataError(f"--tokenizer: cannot read {str(file)!r} as tokenizer.json ({e})") from None
    eos_id = hf.token_to_id(eos_token) if eos_token else None
    if eos_id is None:
        raise DataError(
            f"--eos-token {eos_token!r} is not in the vocabulary of {str(file)!r}: documents "
            "need a separator token (the boundary that document masks cut at)"
        )
    return file, hf, eos_id


def _settings(files, tokenizer_path, hf, eos_token, text_field, shard_tokens) -> dict:
    vocab_size = hf.get_vocab_size(with_added_tokens=True)
    return {
        "tokenizer": {
            "sha256": file_sha256(tokenizer_path),
            "vocab_size": vocab_size,
            "eos_token": eos_token,
        },
        "dtype": token_dtype(vocab_size).name,
        "text_field": text_field,
        "shard_tokens": shard_tokens,
        "inputs": [str(f) for f in files],
    }


def _fresh_state(settings: dict, files: list[Path]) -> dict:
    sources = [{"path": str(f), "bytes": f.stat().st_size, "sha256": file_sha256(f)} for f in files]
    return {
        "format": FORMAT,
        "version": VERSION,
        **settings,
        "sources": sources,
        "shards": [],
        "next": {"source": 0, "record": 0},
        "documents": 0,
        "tokens": 0,
        "literal_separators": 0,
    }


COUNTS = ("documents", "tokens", "literal_separators")


class _ShardWriter:
    """Buffers tokenized documents and writes a shard once it holds `shard_tokens` tokens."""

    def __init__(self, out: Path, state: dict, dtype: np.dtype) -> None:
        self.out, self.state, self.dtype = out, state, dtype
        self.pieces: list[np.ndarray] = []
        self.tokens = self.documents = 0
        self.per_source: dict[int, np.ndarray] = {}  # COUNTS of each input since the last shard
        self.sizes = [source["bytes"] for source in state["sources"]]
        self.bytes_done = float(sum(self.sizes[: state["next"]["source"]]))
        self.begun = False

    def begin(self, report) -> None:
        """Reports, once, where this run starts (after the records a resumed run passes over):
        what earlier runs did is not this run's progress."""
        if report is not None and not self.begun:
            report(self.progress())
        self.begun = True

    def progress(self) -> Progress:
        return Progress(
            bytes_done=self.bytes_done,
            bytes_total=sum(self.sizes),
            documents=self.state["documents"] + self.documents,
            tokens=self.state["tokens"] + self.tokens,
            shards=len(self.state["shards"]),
        )

    def add(self, ids: np.ndarray, counts: np.ndarray, source: int, at: dict) -> None:
        """Buffers whole documents (`counts`: their COUNTS) of input `source`; `at`: the record
        after them."""
        self.pieces.append(ids)
        self.tokens += ids.size
        self.documents += int(counts[0])
        self.per_source[source] = self.per_source.get(source, 0) + counts
        if self.tokens >= self.state["shard_tokens"]:
            self.flush(at)

    def flush(self, at: dict) -> None:
        """Writes the buffer as the next shard; `at` is the record to read after it."""
        if self.tokens:
            data = np.concatenate(self.pieces).astype(self.dtype.newbyteorder("<")).tobytes()
            name = shard_name(len(self.state["shards"]))
            partial = self.out / (name + ".tmp")
            with open(partial, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            partial.replace(self.out / name)
            digest = hashlib.sha256(data).hexdigest()
            shard = {
                "file": name,
                "tokens": self.tokens,
                "documents": self.documents,
                "sha256": digest,
            }
            self.state["shards"].append(shard)
            for source, counts in self.per_source.items():
                entry = self.state["sources"][source]
                for key, count in zip(COUNTS, counts.tolist(), strict=True):
                    entry[key] = entry.get(key, 0) + count
                    self.state[key] = self.state.get(key, 0) + count
        self.state["next"] = at
        write_json_atomically(self.out / STATE, self.state)
        self.pieces, self.tokens, self.documents, self.per_source = [], 0, 0, {}


def _encode(hf, texts: list[str], eos_id: int, dtype, file: Path, records: list[int]):
    """`encode_joined`, with text that is not valid Unicode (a lone surrogate, which JSON can
    spell as \\ud800) named by its record."""
    try:
        return encode_joined(hf, texts, eos_id, dtype)
    except TypeError:  # the Rust side takes only valid Unicode
        bad = next((k for k, t in enumerate(texts) if not _is_unicode(t)), None)
        if bad is None:
            raise
        raise DataError(
            f"{str(file)!r}: record {records[bad] + 1} holds text that is not valid Unicode "
            "(a lone surrogate such as \\ud800)"
        ) from None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _add_batch(writer: _ShardWriter, hf, eos_id: int, batch, file: Path, source: int) -> None:
    """Tokenizes one batch and hands it to `writer` in pieces that end where shards must end."""
    records = [batch.first + k for k, text in enumerate(batch.texts) if text is not None]
    texts = [text for text in batch.texts if text is not None]
    flat, ends = _encode(hf, texts, eos_id, writer.dtype, file, records)
    eos_token = writer.state["tokenizer"]["eos_token"]
    literal = np.array([text.count(eos_token) for text in texts], dtype=np.int64)
    doc = 0
    while doc < len(texts):
        base = int(ends[doc - 1]) if doc else 0
        last = int(np.searchsorted(ends, base + writer.state["shard_tokens"] - writer.tokens))
        last = min(last, len(texts) - 1)
        at = {"source": source, "record": records[last] + 1}
        counts = np.array([last - doc + 1, ends[last] - base, literal[doc : last + 1].sum()])
        writer.add(flat[base : ends[last]], counts, source, at)
        doc = last + 1


def _prepare_file(writer, hf, eos_id, file: Path, source: int, skip: int, report) -> None:
    """Tokenizes input `source` from record `skip` on."""
    documents = 0
    for batch in read_records(file, writer.state["text_field"], skip=skip, batch=BATCH_RECORDS):
        writer.bytes_done += batch.skipped
        writer.begin(report)
        if any(text is not None for text in batch.texts):
            _add_batch(writer, hf, eos_id, batch, file, source)
            documents += sum(text is not None for text in batch.texts)
        writer.bytes_done += batch.bytes
        if report is not None:
            report(writer.progress())
    if skip == 0 and documents == 0:
        raise DataError(f"{str(file)!r} holds no documents (no non-empty text)")
    writer.bytes_done = float(sum(writer.sizes[: source + 1]))  # exact, however it was read


def prepare_corpus(
    inputs: Sequence[str | Path],
    *,
    tokenizer: str | Path,
    output: str | Path,
    text_field: str = "text",
    eos_token: str = "<|endoftext|>",
    shard_tokens: int = 100_000_000,
    report: Callable[[Progress], None] | None = None,
) -> dict:
    """Tokenizes `inputs` into the prepared corpus `output`; returns its manifest.

    Args:
        inputs: parquet, JSON Lines (optionally gzipped) and text files, or directories of them
            (searched recursively; hidden files, licence / readme files and other types are
            skipped and listed in the manifest's `skipped`; a file reached twice is read once).
        tokenizer: a `tokenizer.json` (or a directory holding one), copied into `output`.
        output: the corpus directory: new, empty, or one prepare-data made (an interrupted
            preparation there is resumed; a finished one is checked and returned).
        text_field: the parquet column / JSON field holding each document's text.
        eos_token: the separator written after every document (must be in the tokenizer); the
            same string inside a document's text is encoded as text (counted in the manifest's
            `literal_separators`).
        shard_tokens: a shard is closed at the first document end at or past this many tokens.
        report: called with a `Progress` where this run starts (what earlier runs did, once the
            records they read are passed over), after every batch of records, and at the end.

    Raises:
        DataError: a missing or unreadable input, a column or field that is not there, an input
            without documents, a tokenizer without `eos_token`, an `output` that prepare-data did
            not make or that lies around an input, an interrupted preparation with other
            arguments, or inputs, shards or a tokenizer copy that changed since.
    """
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise DataError(f"--shard-tokens must be a whole number >= 1, got {shard_tokens!r}")
    out = Path(output)
    found = input_files(inputs, out)
    tokenizer_path, hf, eos_id = _tokenizer(tokenizer, eos_token)
    settings = _settings(found.files, tokenizer_path, hf, eos_token, text_field, shard_tokens)
    if claim_output(out) == "finished":
        manifest = read_own(out, MANIFEST)
        problem = finished_problem(out, manifest, settings, found.files)
        if problem:
            raise DataError(problem)
        return manifest
    created = not out.exists()
    state = _resumable_state(out, settings, found.files)
    if state is None:
        out.mkdir(parents=True, exist_ok=True)
        state = _fresh_state(settings, found.files)
        write_json_atomically(out / STATE, state)  # first: the directory is now prepare-data's
        partial = out / (TOKENIZER_FILE + ".tmp")  # never half a tokenizer
        shutil.copyfile(tokenizer_path, partial)
        partial.replace(out / TOKENIZER_FILE)
    try:
        return _run(out, state, hf, eos_id, found, report)
    except DataError as e:
        raise DataError(_stopped(out, state, created, str(e))) from None


def _resumable_state(out: Path, settings: dict, files: list[Path]) -> dict | None:
    """The state of an interrupted preparation in `out` to continue (None: start afresh)."""
    if not (out / STATE).is_file():
        return None
    state = read_own(out, STATE)
    problem = resume_problem(out, state, settings, files)
    if problem is None:
        remove_leftovers(out, state)
        state.pop("failed", None)  # the same command again: retried
        return state
    if state.get("failed"):  # stopped on a bad input: the corrected command starts afresh
        remove_own_files(out, state)
        return None
    raise DataError(problem)


def _run(out: Path, state: dict, hf, eos_id: int, found, report) -> dict:
    writer = _ShardWriter(out, state, np.dtype(state["dtype"]))
    start, files = state["next"], found.files
    for source in range(start["source"], len(files)):
        skip = start["record"] if source == start["source"] else 0
        _prepare_file(writer, hf, eos_id, files[source], source, skip, report)
    writer.flush({"source": len(files), "record": 0})
    writer.begin(report)
    if report is not None:
        report(writer.progress())
    manifest = {k: v for k, v in state.items() if k not in ("next", "failed")}
    manifest["skipped"] = found.skipped
    write_json_atomically(out / MANIFEST, manifest)
    (out / STATE).unlink()
    return manifest


def _stopped(out: Path, state: dict, created: bool, message: str) -> str:
    """After a bad input stopped the preparation: with no shard written, removes what it wrote
    (the directory too, if it made it); else marks the state failed, so that the same command
    retries and a corrected one starts afresh. Returns the error message to report."""
    if not state["shards"]:
        remove_own_files(out, state)
        if created and not any(out.iterdir()):
            out.rmdir()
        return message
    state["failed"] = message
    write_json_atomically(out / STATE, state)
    return (
        f"{message} ({len(state['shards'])} shard(s) kept in {str(out)!r}: the same command "
        "retries, a corrected one starts afresh)"
    )
