"""From a `DataConfig` to a tokenizer and the training and validation token streams.

Text (the built-in corpus or your files) is split by characters first, so a BPE is trained on the
training text only, then each split is tokenized with every document followed by the separator.
Token corpora (synthetic or pre-tokenized) are split by token ranges of one stream.

Example:
    >>> corpus = load_corpus(DataConfig(source="synthetic", synthetic_tokens=1000))
    >>> corpus.vocab_size, corpus.train.stop - corpus.train.start, corpus.validation.stop
    (256, 980, 1000)
"""

import dataclasses

import numpy as np

from nvfp4_train.data.builtin_text import kjv_chapters
from nvfp4_train.data.config import BUILTIN_PATH, DataConfig
from nvfp4_train.data.packing import (
    FULL_CHECK_MAX_TOKENS,
    check_token_ids,
    split_documents,
    split_range,
)
from nvfp4_train.data.prepared import PreparedCorpus, file_sha256, is_prepared, open_prepared
from nvfp4_train.data.sources import (
    existing,
    read_documents,
    synthetic_stream,
    text_files,
    token_array,
)
from nvfp4_train.data.streams import PieceStream
from nvfp4_train.data.tokenization import (
    ByteTokenizer,
    Tokenizer,
    id_tokenizer,
    load_tokenizer,
    tokenizer_file,
    train_bpe,
)
from nvfp4_train.errors import DataError


@dataclasses.dataclass(frozen=True, eq=False)
class TokenRange:
    """Tokens `array[start:stop]` (the array may be memory-mapped and shared between splits)."""

    array: np.ndarray
    start: int
    stop: int

    @classmethod
    def whole(cls, array: np.ndarray) -> "TokenRange":
        return cls(array, 0, int(array.size))


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """A tokenizer, the vocabulary size the model must cover, and the two disjoint token ranges."""

    tokenizer: Tokenizer
    vocab_size: int
    train: TokenRange
    validation: TokenRange


def _text_tokenizer(cfg: DataConfig, train_documents: list[str]) -> Tokenizer:
    if cfg.tokenizer_path:
        return load_tokenizer(cfg.tokenizer_path, cfg.eos_token)
    if cfg.tokenizer == "bpe":
        return train_bpe(train_documents, cfg.bpe_vocab_size, cfg.eos_token)
    return ByteTokenizer(cfg.eos_token)


def text_corpus(cfg: DataConfig, documents: list[str]) -> Corpus:
    """Splits `documents` by characters, builds the tokenizer on the training part, tokenizes."""
    train_documents, validation_documents = split_documents(documents, cfg.validation_fraction)
    tokenizer = _text_tokenizer(cfg, train_documents)
    train = tokenizer.encode_documents(train_documents)
    validation = tokenizer.encode_documents(validation_documents)
    return Corpus(
        tokenizer, tokenizer.vocab_size, TokenRange.whole(train), TokenRange.whole(validation)
    )


def _split_stream(tokens: np.ndarray, fraction: float) -> tuple[TokenRange, TokenRange]:
    (train_start, train_stop), (val_start, val_stop) = split_range(int(tokens.size), fraction)
    return TokenRange(tokens, train_start, train_stop), TokenRange(tokens, val_start, val_stop)


def _prepared_tokenizer(cfg: DataConfig, path: str, prepared: PreparedCorpus) -> Tokenizer:
    """The tokenizer of a prepared corpus, after checking the config agrees with its manifest."""
    if cfg.eos_token != prepared.eos_token:
        raise DataError(
            f"data.eos_token={cfg.eos_token!r}, but {path!r} was prepared with separator "
            f"{prepared.eos_token!r}; set data.eos_token: {prepared.eos_token!r}"
        )
    if cfg.tokenizer_path:
        file = tokenizer_file(cfg.tokenizer_path)
        if not file.is_file() or file_sha256(file) != prepared.tokenizer_sha256:
            raise DataError(
                f"data.tokenizer_path {cfg.tokenizer_path!r} is not the tokenizer {path!r} was "
                "prepared with (SHA-256 differs from its manifest); leave data.tokenizer_path "
                "empty to use the corpus's own tokenizer.json"
            )
    return load_tokenizer(prepared.tokenizer_file, prepared.eos_token)


def _corpus_tokens(
    cfg: DataConfig, path: str, key: str
) -> tuple[Tokenizer, np.ndarray | PieceStream]:
    if is_prepared(path):
        prepared = open_prepared(path)
        return _prepared_tokenizer(cfg, path, prepared), prepared.stream
    existing(path, key)
    if cfg.tokenizer_path:
        tokenizer = load_tokenizer(cfg.tokenizer_path, cfg.eos_token)
    elif cfg.tokens_vocab_size:
        tokenizer = id_tokenizer(cfg.tokens_vocab_size)
    else:
        raise DataError(
            f"data.path {path!r} is not a prepared corpus, so source='tokens' needs "
            "data.tokens_vocab_size > 0 or data.tokenizer_path to give the ids a vocabulary"
        )
    return tokenizer, token_array(path, cfg.tokens_dtype, tokenizer.eos_id)


def tokens_corpus(cfg: DataConfig, path: str | None = None, key: str = "data.path") -> Corpus:
    """A pre-tokenized corpus (at `path`, default `cfg.path`, the config key `key`); its ids are
    checked up front when it has at most 2**28 tokens, else as sequences are read."""
    path = cfg.path if path is None else path
    tokenizer, tokens = _corpus_tokens(cfg, path, key)
    vocab_size = cfg.tokens_vocab_size or tokenizer.vocab_size
    if vocab_size < tokenizer.vocab_size:
        raise DataError(
            f"data.tokens_vocab_size={vocab_size} is smaller than the vocabulary of "
            f"data.tokenizer_path ({tokenizer.vocab_size}); use 0 to take the tokenizer's"
        )
    if tokens.size <= FULL_CHECK_MAX_TOKENS:
        check_token_ids(tokens, vocab_size, f"data.path {path!r}")
    train, validation = _split_stream(tokens, cfg.validation_fraction)
    return Corpus(tokenizer, vocab_size, train, validation)


def builtin_tokens_corpus(cfg: DataConfig, tokenizer: Tokenizer, vocab_size: int) -> Corpus:
    """The built-in corpus tokenized with `tokenizer` (a mixture source, `path: builtin`): all of
    it, each chapter followed by the separator, split by tokens like any token corpus."""
    tokens = tokenizer.encode_documents(kjv_chapters())
    train, validation = _split_stream(tokens, cfg.validation_fraction)
    return Corpus(tokenizer, vocab_size, train, validation)


def synthetic_corpus(cfg: DataConfig) -> Corpus:
    tokens = synthetic_stream(cfg.synthetic_vocab_size, cfg.synthetic_tokens)
    train, validation = _split_stream(tokens, cfg.validation_fraction)
    return Corpus(
        id_tokenizer(cfg.synthetic_vocab_size), cfg.synthetic_vocab_size, train, validation
    )


def load_corpus(cfg: DataConfig) -> Corpus:
    """Reads, splits and tokenizes the corpus that `cfg.source` names."""
    if cfg.source == "builtin":
        return text_corpus(cfg, kjv_chapters())
    if cfg.source == "text":
        return text_corpus(cfg, read_documents(text_files(cfg.path, cfg.text_glob)))
    if cfg.source == "tokens":
        return tokens_corpus(cfg)
    if cfg.source == "synthetic":
        return synthetic_corpus(cfg)
    raise ValueError(
        f"data.source must be one of builtin, synthetic, text, tokens, got {cfg.source!r}"
    )


def _mixture_tokenizer(cfg: DataConfig, corpora: dict[int, Corpus]) -> tuple[Tokenizer, int]:
    """The tokenizer (and vocabulary size) that tokenizes `path: builtin` in a mixture: the
    other sources' (a prepared corpus's own, or data.tokenizer_path)."""
    textual = cfg.tokenizer_path or any(
        is_prepared(s.path) for s in cfg.mixture if s.path != BUILTIN_PATH
    )
    if not textual:
        raise DataError(
            "data.mixture: 'builtin' is tokenized with the mixture's tokenizer, but no source "
            "brings one (token files without data.tokenizer_path); set "
            "data.tokenizer_path, or add a corpus prepared with nvfp4-train prepare-data"
        )
    if corpora:
        first = next(iter(corpora.values()))
        return first.tokenizer, first.vocab_size
    tokenizer = load_tokenizer(cfg.tokenizer_path, cfg.eos_token)
    return tokenizer, cfg.tokens_vocab_size or tokenizer.vocab_size


def mixture_corpora(cfg: DataConfig) -> list[Corpus]:
    """The corpus of every mixture source, after checking they share one tokenizer."""
    paths = [source.path for source in cfg.mixture]
    opened = {
        k: tokens_corpus(cfg, path, key="data.mixture")
        for k, path in enumerate(paths)
        if path != BUILTIN_PATH
    }
    if BUILTIN_PATH in paths:
        builtin = builtin_tokens_corpus(cfg, *_mixture_tokenizer(cfg, opened))
        opened |= {k: builtin for k, path in enumerate(paths) if path == BUILTIN_PATH}
    corpora = [opened[k] for k in range(len(paths))]
    first = corpora[0]
    for source, corpus in zip(cfg.mixture[1:], corpora[1:], strict=True):
        same = corpus.vocab_size == first.vocab_size and _tokenizer_text(
            corpus.tokenizer
        ) == _tokenizer_text(first.tokenizer)
        if not same:
            raise DataError(
                f"data.mixture: {source.path!r} has another tokenizer or vocabulary than "
                f"{cfg.mixture[0].path!r} (vocab {corpus.vocab_size} vs {first.vocab_size}); "
                "every source of a mixture must be tokenized alike"
            )
    return corpora


def _tokenizer_text(tokenizer: Tokenizer) -> str:
    hf = getattr(tokenizer, "hf", None)
    return hf.to_str() if hf is not None else repr(tokenizer)
