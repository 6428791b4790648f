"""`prepare-data`: raw corpora to token shards with a tokenizer, resumable and byte-reproducible.

Records are read in order (files sorted, records in file order), tokenized in batches by the Hugging
Face `tokenizers` library (its Rust encoder runs a batch on every core), each document followed
by the separator, and cut into shards of at least `shard_tokens` tokens at document boundaries.
A shard is written to a temporary file and renamed; then `prepare-state.json` records it with the
record to read next. Interrupted and rerun with the same arguments, the preparation drops any
shard the state does not list and continues from that record: as every shard depends only on
the records before it, the output is byte-identical to an uninterrupted run. The manifest is
written last (see `nvfp4_train.data.prepared`).
"""

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import tokenizers

from nvfp4_train.data.inputs import input_files, read_records
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


def _source_identity(file: Path) -> dict:
    stat = file.stat()
    return {"path": str(file), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _fresh_state(settings: dict, files: list[Path]) -> dict:
    sources = [{**_source_identity(f), "sha256": file_sha256(f)} for f in files]
    return {
        "format": FORMAT,
        "version": VERSION,
        **settings,
        "sources": sources,
        "shards": [],
        "next": {"source": 0, "record": 0},
        "documents": 0,
        "tokens": 0,
    }


def _resumed_state(out: Path, settings: dict, files: list[Path]) -> dict:
    """The saved state, after checking that the arguments and the inputs are unchanged."""
    state = json.loads((out / STATE).read_text(encoding="utf-8"))
    saved = {key: state.get(key) for key in settings}
    if saved != settings:
        changed = ", ".join(k for k in settings if saved[k] != settings[k])
        raise DataError(
            f"--output {str(out)!r} holds an interrupted preparation with other settings "
            f"({changed}); rerun it with its arguments, or choose a new --output"
        )
    for source, file in zip(state["sources"], files, strict=True):
        identity = _source_identity(file)
        unchanged = all(source[k] == identity[k] for k in identity)
        if not unchanged and file_sha256(file) != source["sha256"]:
            raise DataError(f"{str(file)!r} changed since the interrupted preparation began")
    listed = {shard["file"] for shard in state["shards"]}
    for leftover in out.glob("shard-*"):  # written after the state was saved: redone
        if leftover.name not in listed:
            leftover.unlink()
    return state


class _ShardWriter:
    """Buffers tokenized documents and writes a shard once it holds `shard_tokens` tokens."""

    def __init__(self, out: Path, state: dict, dtype: np.dtype) -> None:
        self.out, self.state, self.dtype = out, state, dtype
        self.pieces: list[np.ndarray] = []
        self.tokens = self.documents = 0
        self.per_source: dict[int, list[int]] = {}
        done = state["sources"][: state["next"]["source"]]
        self.bytes_done = float(sum(source["bytes"] for source in done))
        self.bytes_total = sum(source["bytes"] for source in state["sources"])

    def progress(self) -> Progress:
        return Progress(
            bytes_done=self.bytes_done,
            bytes_total=self.bytes_total,
            documents=self.state["documents"] + self.documents,
            tokens=self.state["tokens"] + self.tokens,
            shards=len(self.state["shards"]),
        )

    def add(self, ids: np.ndarray, documents: int, source: int, at: dict) -> None:
        """Buffers `documents` whole documents of input `source`; `at`: the record after them."""
        self.pieces.append(ids)
        self.tokens += ids.size
        self.documents += documents
        counts = self.per_source.setdefault(source, [0, 0])
        counts[0] += documents
        counts[1] += ids.size
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
            self.state["documents"] += self.documents
            self.state["tokens"] += self.tokens
            for source, (documents, tokens) in self.per_source.items():
                entry = self.state["sources"][source]
                entry["documents"] = entry.get("documents", 0) + documents
                entry["tokens"] = entry.get("tokens", 0) + tokens
        self.state["next"] = at
        write_json_atomically(self.out / STATE, self.state)
        self.pieces, self.tokens, self.documents, self.per_source = [], 0, 0, {}


def _add_batch(writer: _ShardWriter, hf, eos_id: int, texts, records, source: int) -> None:
    """Tokenizes one batch and hands it to `writer` in pieces that end where shards must end."""
    flat, ends = encode_joined(hf, texts, eos_id, writer.dtype)
    doc = 0
    while doc < len(texts):
        base = int(ends[doc - 1]) if doc else 0
        last = int(np.searchsorted(ends, base + writer.state["shard_tokens"] - writer.tokens))
        last = min(last, len(texts) - 1)
        at = {"source": source, "record": records[last] + 1}
        writer.add(flat[base : ends[last]], last - doc + 1, source, at)
        doc = last + 1


def _prepare_file(writer, hf, eos_id, file: Path, source: int, skip: int, report) -> None:
    """Tokenizes input `source` from record `skip` on."""
    documents = 0
    for batch in read_records(file, writer.state["text_field"], skip=skip, batch=BATCH_RECORDS):
        records = [batch.first + k for k, text in enumerate(batch.texts) if text is not None]
        texts = [text for text in batch.texts if text is not None]
        if texts:
            _add_batch(writer, hf, eos_id, texts, records, source)
            documents += len(texts)
        writer.bytes_done += batch.bytes
        if report is not None:
            report(writer.progress())
    if skip == 0 and documents == 0:
        raise DataError(f"{str(file)!r} holds no documents (no non-empty text)")


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
        inputs: parquet, JSON Lines (optionally gzipped) and text files, or directories of them.
        tokenizer: a `tokenizer.json` (or a directory holding one), copied into `output`.
        output: the corpus directory (created; an interrupted preparation there is resumed).
        text_field: the parquet column / JSON field holding each document's text.
        eos_token: the separator written after every document (must be in the tokenizer).
        shard_tokens: a shard is closed at the first document end at or past this many tokens.
        report: called with a `Progress` after every batch of records.

    Raises:
        DataError: a missing or unreadable input, a column or field that is not there, an input
            without documents, a tokenizer without `eos_token`, or an `output` that holds an
            interrupted preparation with other arguments or inputs that changed since.
    """
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
    out = Path(output)
    inside = out.resolve()  # an output directory inside an input directory is not input
    files = [f for f in input_files(inputs) if inside not in f.resolve().parents]
    tokenizer_path, hf, eos_id = _tokenizer(tokenizer, eos_token)
    settings = _settings(files, tokenizer_path, hf, eos_token, text_field, shard_tokens)
    if (out / MANIFEST).is_file():
        return _finished(out, settings)
    out.mkdir(parents=True, exist_ok=True)
    state = _resumed_state(out, settings, files) if (out / STATE).is_file() else None
    if state is None:
        state = _fresh_state(settings, files)
        shutil.copyfile(tokenizer_path, out / TOKENIZER_FILE)
        write_json_atomically(out / STATE, state)
    writer = _ShardWriter(out, state, np.dtype(state["dtype"]))
    start = state["next"]
    for source in range(start["source"], len(files)):
        skip = start["record"] if source == start["source"] else 0
        _prepare_file(writer, hf, eos_id, files[source], source, skip, report)
    writer.flush({"source": len(files), "record": 0})
    manifest = {k: v for k, v in state.items() if k != "next"}
    write_json_atomically(out / MANIFEST, manifest)
    (out / STATE).unlink()
    return manifest


def _finished(out: Path, settings: dict) -> dict:
    manifest = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    if any(manifest.get(key) != value for key, value in settings.items()):
        raise DataError(
            f"--output {str(out)!r} already holds a prepared corpus made with other arguments; "
            "choose a new --output"
        )
    return manifest
