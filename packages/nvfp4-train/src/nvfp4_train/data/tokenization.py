"""Tokenizers: UTF-8 bytes (the default), a byte-level BPE trained on the corpus, or a loaded file.

Every tokenizer here has the same small interface: `vocab_size`, `eos_id` (the document
separator, or None), `encode(str) -> list[int]`, `decode(ids) -> str`,
`encode_documents(docs) -> uint array` (each document followed by the separator) and
`save(directory)`, which writes `tokenizer.json` (Hugging Face `tokenizers` format) plus
`tokenizer_config.json` and `special_tokens_map.json`, so that
`transformers.AutoTokenizer.from_pretrained(directory)` loads a `PreTrainedTokenizerFast`.

Example:
    >>> tok = ByteTokenizer()
    >>> tok.encode("hé"), tok.vocab_size, tok.eos_id
    ([104, 195, 169], 257, 256)
    >>> tok.decode([104, 195, 169])
    'hé'
"""

import dataclasses
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from nvfp4_train.errors import DataError

TOKENIZER_FILE = "tokenizer.json"
CHUNK_CHARS = 1 << 18
"""A longer document is encoded in pieces of at most this many characters (`text_chunks`)."""
BATCH_CHARS = 1 << 21
"""Characters per `encode_batch` call: the tokenizer's memory (~140 bytes a character while it
encodes) is bounded by a call (~300 MB), whatever the length of a document."""


class Tokenizer(Protocol):
    """What the data pipeline and the exporter need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_documents(self, documents: Sequence[str]) -> np.ndarray: ...

    def save(self, directory: str | Path) -> list[Path]: ...


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds ids below `vocab_size` (uint16 or uint32)."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def _join_with_separator(pieces: Sequence[np.ndarray], eos_id: int | None, dtype) -> np.ndarray:
    """Concatenates token arrays, appending `eos_id` after each one (when it is not None)."""
    if eos_id is not None:
        separator = np.array([eos_id], dtype=dtype)
        pieces = [part for piece in pieces for part in (piece, separator)]
    if not pieces:
        return np.zeros(0, dtype=dtype)
    return np.concatenate([np.asarray(p, dtype=dtype) for p in pieces])


def text_chunks(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """`text` in pieces of at most `size` characters, each cut (where one lies in the second half
    of the window) before a single space between two non-space characters.

    Byte-level BPE with GPT-2's pre-tokenizer, Metaspace (SentencePiece style) and whitespace
    pre-tokenizers all start a pre-token there, and merges never cross pre-tokens, so encoding the
    pieces one by one gives the ids of the whole text. A window without such a space (no spaces at
    all, e.g. Chinese or base64) is cut at `size`, and the ids there may differ from the whole.
    """
    chunks, start = [], 0
    while len(text) - start > size:
        cut = _cut(text, start + size // 2, start + size)
        chunks.append(text[start:cut])
        start = cut
    chunks.append(text[start:])
    return chunks


def _cut(text: str, low: int, high: int) -> int:
    at = text.rfind(" ", low, high)
    while at > low:
        if not (text[at - 1].isspace() or text[at + 1].isspace()):
            return at
        at = text.rfind(" ", low, at)
    return high


def _groups(pieces: list, limit: int) -> Iterator[list]:
    """`pieces` ((document, last, text) triples) in runs of at most `limit` characters (or one)."""
    group, size = [], 0
    for piece in pieces:
        if group and size + len(piece[2]) > limit:
            yield group
            group, size = [], 0
        group.append(piece)
        size += len(piece[2])
    if group:
        yield group


def encode_joined(
    hf: tokenizers.Tokenizer,
    texts: Sequence[str],
    eos_id: int | None,
    dtype: np.dtype,
    *,
    chunk_chars: int = CHUNK_CHARS,
    batch_chars: int = BATCH_CHARS,
) -> tuple[np.ndarray, np.ndarray]:
    """(the ids of `texts`, each followed by `eos_id` unless it is None, as one `dtype` array;
    the end offset of each text's ids, separator included).

    Text never produces a special token: a literal `<|endoftext|>` in a document is encoded as
    the characters it is (the tokenizer's `encode_special_tokens`), so the only separators are
    the ones appended here. Texts are encoded (Rust, every core) in calls of at most
    `batch_chars` characters, a long text in `text_chunks` of `chunk_chars`: memory is bounded by
    a call, not by the longest document.

    Raises:
        DataError: the text of a document encodes to `eos_id` (a separator that is an ordinary,
            not a special, token of the tokenizer).
    """
    pieces = []  # (document, is its last piece, text)
    for doc, text in enumerate(texts):
        chunks = text_chunks(text, chunk_chars)
        pieces += [(doc, k == len(chunks) - 1, chunk) for k, chunk in enumerate(chunks)]
    tail = np.array([] if eos_id is None else [eos_id], dtype=dtype)
    parts, lengths = [], np.zeros(len(texts), dtype=np.int64)
    special = getattr(hf, "encode_special_tokens", None)
    if special is not None:
        hf.encode_special_tokens = True
    try:
        for group in _groups(pieces, batch_chars):
            encodings = hf.encode_batch([text for _, _, text in group], add_special_tokens=False)
            for (doc, last, _), encoding in zip(group, encodings, strict=True):
                ids = np.array(encoding.ids, dtype=dtype)
                if eos_id is not None and (ids == eos_id).any():
                    raise DataError(
                        f"the text of a document encodes to the separator id {eos_id}: the "
                        "tokenizer holds the separator as an ordinary token, not a special one; "
                        "choose a special token as the separator"
                    )
                parts += [ids, tail] if last else [ids]
                lengths[doc] += ids.size + (tail.size if last else 0)
    finally:
        if special is not None:
            hf.encode_special_tokens = special
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    return flat, np.cumsum(lengths)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of `pre_tokenizers.ByteLevel`."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = [b for b in range(256) if b not in printable]
    chars = [*printable, *range(256, 256 + len(extra))]
    return dict(zip([*printable, *extra], map(chr, chars), strict=True))


def _write_hf_files(hf: tokenizers.Tokenizer, eos_token: str, directory: str | Path) -> list[Path]:
    """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json into `directory`."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    hf.save(str(out / TOKENIZER_FILE))
    special = {"eos_token": eos_token} if eos_token else {}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000_000,
        **special,
    }
    for name, content in (
        ("tokenizer_config.json", tokenizer_config),
        ("special_tokens_map.json", special),
    ):
        (out / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    return [out / TOKENIZER_FILE, out / "tokenizer_config.json", out / "special_tokens_map.json"]


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus `eos_token` as id 256 when it is not empty.

    Encoding is a NumPy view of the UTF-8 bytes, so a whole corpus encodes in milliseconds. A
    literal `eos_token` string inside the text stays bytes here (it is not a separator).
    """

    eos_token: str = "<|endoftext|>"

    @property
    def vocab_size(self) -> int:
        return 256 + (1 if self.eos_token else 0)

    @property
    def eos_id(self) -> int | None:
        return 256 if self.eos_token else None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Decodes ids; the separator prints as `eos_token`, broken UTF-8 as U+FFFD."""
        ids_array = np.asarray(ids, dtype=np.int64).reshape(-1)
        bad = ids_array[(ids_array < 0) | (ids_array >= self.vocab_size)]
        if bad.size:
            raise ValueError(f"ids must be in [0, {self.vocab_size}), got {bad[:5].tolist()}")
        runs = np.split(ids_array, np.flatnonzero(ids_array == 256))
        texts = [bytes(run[run < 256].astype(np.uint8)).decode("utf-8", "replace") for run in runs]
        return self.eos_token.join(texts)

    def encode_documents(self, documents: Sequence[str]) -> np.ndarray:
        pieces = [np.frombuffer(doc.encode("utf-8"), dtype=np.uint8) for doc in documents]
        return _join_with_separator(pieces, self.eos_id, np.uint16)

    def to_hf(self) -> tokenizers.Tokenizer:
        """The same tokenizer as a Hugging Face `tokenizers.Tokenizer` (id = byte value)."""
        vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
        hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        hf.decoder = decoders.ByteLevel()
        if self.eos_token:
            hf.add_special_tokens([self.eos_token])
        return hf

    def save(self, directory: str | Path) -> list[Path]:
        return _write_hf_files(self.to_hf(), self.eos_token, directory)


@dataclasses.dataclass(frozen=True, eq=False)
class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` with a document separator `eos_token` ("" for none)."""

    hf: tokenizers.Tokenizer
    eos_token: str = ""

    def __post_init__(self) -> None:
        if self.eos_token and self.hf.token_to_id(self.eos_token) is None:
            raise DataError(
                f"data.eos_token {self.eos_token!r} is not in the tokenizer's vocabulary; set "
                "data.eos_token to one of its special tokens, or to '' for no separator"
            )

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int | None:
        return self.hf.token_to_id(self.eos_token) if self.eos_token else None

    def encode(self, text: str) -> list[int]:
        try:
            return self.hf.encode(text, add_special_tokens=False).ids
        except Exception as e:  # the Rust side raises a bare Exception
            raise DataError(f"cannot encode {text[:40]!r}: {e}") from None

    def decode(self, ids: Sequence[int]) -> str:
        ids_list = [int(i) for i in np.asarray(ids).reshape(-1)]
        bad = [i for i in ids_list if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        return self.hf.decode(ids_list, skip_special_tokens=False)

    def encode_documents(self, documents: Sequence[str]) -> np.ndarray:
        return encode_joined(self.hf, documents, self.eos_id, token_dtype(self.vocab_size))[0]

    def save(self, directory: str | Path) -> list[Path]:
        return _write_hf_files(self.hf, self.eos_token, directory)


def train_bpe(documents: Sequence[str], vocab_size: int, eos_token: str) -> HFTokenizer:
    """Trains a byte-level BPE (GPT-2 style pre-tokenization) on `documents`; deterministic.

    Args:
        documents: the training text (never the validation split).
        vocab_size: entries in the vocabulary, the 256 byte symbols and `eos_token` included; a
            small corpus may stop with fewer merges.
        eos_token: the separator special token ("" for none).
    """
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos_token] if eos_token else [],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(documents, trainer=trainer, length=len(documents))
    return HFTokenizer(hf, eos_token)


def tokenizer_file(path: str | Path) -> Path:
    """`path` itself, or the `tokenizer.json` inside it when `path` is a directory."""
    file = Path(path)
    return file / TOKENIZER_FILE if file.is_dir() else file


def load_tokenizer(path: str | Path, eos_token: str) -> HFTokenizer:
    """Loads a `tokenizer.json` (or the one inside directory `path`)."""
    file = tokenizer_file(path)
    if not file.is_file():
        raise DataError(f"data.tokenizer_path: no tokenizer file at {str(file)!r}")
    try:
        hf = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises a bare Exception
        raise DataError(
            f"data.tokenizer_path: cannot read {str(file)!r} as tokenizer.json: {e}"
        ) from None
    return HFTokenizer(hf, eos_token)


def id_tokenizer(vocab_size: int) -> HFTokenizer:
    """A tokenizer for corpora without text: id `i` is the word `t{i}` ("t3 t7" <-> [3, 7])."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    hf = tokenizers.Tokenizer(models.WordLevel(vocab=vocab))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return HFTokenizer(hf, "")
