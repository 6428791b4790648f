"""`make_datasets`: the training iterator (grain) and the fixed validation batches.

The training iterator is a `grain.DataLoader` over `PackedSequences`: an `IndexSampler` shards the
sequences by JAX process (a contiguous part each), shuffles them with `seed` (a new permutation every
epoch, the same for the same seed), repeats forever, and batches them. Its state is a small JSON
blob: `get_state()` after N batches, `set_state()` on a fresh iterator, and the next batches match.

`batch_size` is the global batch: each of the `process_count` processes gets
`batch_size // process_count` rows per batch.

Example:
    >>> cfg = DataConfig(source="synthetic", synthetic_tokens=4096)
    >>> datasets = make_datasets(cfg, seq_len=16, batch_size=4, seed=0)
    >>> batch = next(datasets.train_iterator())
    >>> batch["inputs"].shape, batch["targets"].dtype
    ((4, 16), dtype('int32'))
"""

import dataclasses

import grain
import numpy as np
from absl import flags

from nvfp4_train.data.config import DataConfig
from nvfp4_train.data.corpus import Corpus, TokenRange, load_corpus, mixture_corpora
from nvfp4_train.data.mixture import MixedSequences, check_shares, source_names
from nvfp4_train.data.packing import PackedSequences
from nvfp4_train.data.tokenization import Tokenizer
from nvfp4_train.errors import DataError

Batch = dict[str, np.ndarray]


def _check_arguments(seq_len: int, batch_size: int, seed: int, index: int, count: int) -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if count < 1 or not 0 <= index < count:
        raise ValueError(
            f"need process_count >= 1 and 0 <= process_index < process_count, got "
            f"process_index={index}, process_count={count}"
        )
    if batch_size < 1 or batch_size % count:
        raise ValueError(
            f"batch_size must be a positive multiple of process_count={count}, got {batch_size}"
        )
    if not 0 <= seed < 2**32:
        raise DataError(f"seed must be in [0, 2**32) for grain's shuffle, got {seed}")


def _sequences(
    tokens: TokenRange, seq_len: int, vocab_size: int, eos_id: int | None
) -> PackedSequences:
    return PackedSequences(
        tokens.array, tokens.start, tokens.stop, seq_len=seq_len, vocab_size=vocab_size,
        eos_id=eos_id,
    )  # fmt: skip


def _no_separator(cfg: DataConfig) -> str:
    """Why a corpus whose tokenizer has no eos id carries no document boundaries."""
    if cfg.source == "synthetic":
        return "the synthetic stream has no documents"
    if cfg.source == "tokens" and not cfg.tokenizer_path:
        return "a tokens corpus without data.tokenizer_path has no separator id"
    return "data.eos_token is '', so documents are joined without a separator"


def document_separator(cfg: DataConfig, eos_id: int | None) -> tuple[int | None, str]:
    """(the id that batches' `segment_ids` cut at, or None; the start-up line that says so).

    Raises:
        DataError: `data.document_mask: true` on a corpus without a separator.
    """
    if cfg.document_mask is False:
        return None, "data: no document masks (data.document_mask=false)"
    if eos_id is None:
        why = _no_separator(cfg)
        if cfg.document_mask is True:
            raise DataError(
                f"data.document_mask=true needs document separators, but {why}; set "
                "data.document_mask to false or 'auto'"
            )
        return None, f"data: no document masks ({why}): every row attends as one document"
    return eos_id, f"data: document masks at separator id {eos_id} (data.document_mask)"


def _allow_unparsed_absl_flags() -> None:
    """Lets grain worker processes start outside an `absl.app` program.

    Works around google/grain#1355 (fixed after grain 0.2.18): the workers read an absl flag and
    fail unless flags were parsed. Marking them parsed keeps every flag at its default.
    """
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _process_range(length: int, index: int, count: int) -> tuple[int, int]:
    per_process = length // count
    return index * per_process, (index + 1) * per_process


@dataclasses.dataclass(frozen=True, eq=False)
class Datasets:
    """The data of one run, for one process.

    Attributes:
        vocab_size: ids are in [0, vocab_size); the model's embedding must cover it.
        tokenizer: encode/decode/save (see `nvfp4_train.data.tokenization`).
        train_sequences: the packed training sequences (all processes' shards), or, for a
            mixture, this process's rows of the mixed stream.
        validation_sequences: the packed (or mixed) held-out sequences.
        batch_size: rows per batch on this process (the global batch / process_count).
        seed, process_index, process_count, shuffle, num_workers: as passed / configured.
        num_validation_batches: how many batches `validation_batches()` returns.
        documents: the start-up line saying whether batches carry document masks and why.
        mixed: `train_sequences` is a `MixedSequences` (`data.mixture`).
        mixture_sources: the names of its sources (their paths), in order.
    """

    vocab_size: int
    tokenizer: Tokenizer
    train_sequences: PackedSequences
    validation_sequences: PackedSequences
    batch_size: int
    seed: int
    process_index: int
    process_count: int
    shuffle: bool
    num_workers: int
    num_validation_batches: int
    documents: str
    mixed: bool = False
    mixture_sources: tuple[str, ...] = ()

    def _sampler(self) -> grain.samplers.IndexSampler:
        if self.mixed:  # `MixedSequences` already holds this process's rows, in their order
            return grain.samplers.IndexSampler(
                num_records=len(self.train_sequences), shuffle=False, num_epochs=None
            )
        return grain.samplers.IndexSampler(
            num_records=len(self.train_sequences),
            shard_options=grain.sharding.ShardOptions(
                shard_index=self.process_index,
                shard_count=self.process_count,
                drop_remainder=True,
            ),
            shuffle=self.shuffle,
            num_epochs=None,
            seed=self.seed,
        )

    def max_documents_per_row(self) -> int | None:
        """The most documents any training or validation row holds (one pass over the corpus;
        what `model.attention_max_documents: 0` resolves to), or None when rows carry no
        documents."""
        counts = [
            s.max_documents_per_row() for s in (self.train_sequences, self.validation_sequences)
        ]
        return None if None in counts else max(counts)

    def train_loader(self) -> grain.DataLoader:
        """The grain `DataLoader`: infinite, sharded, shuffled with `seed`, batched."""
        if self.num_workers > 0:
            _allow_unparsed_absl_flags()
        return grain.DataLoader(
            data_source=self.train_sequences,
            sampler=self._sampler(),
            operations=[grain.transforms.Batch(batch_size=self.batch_size, drop_remainder=True)],
            worker_count=self.num_workers,
            read_options=grain.ReadOptions(num_threads=2, prefetch_buffer_size=4 * self.batch_size),
        )

    def train_iterator(self) -> grain.DataLoaderIterator:
        """A fresh iterator from the start; restore a run with `it.set_state(saved_state)`."""
        return iter(self.train_loader())

    def tokens_by_source(self, steps: int) -> dict[str, int]:
        """Training tokens each mixture source has given in the first `steps` steps of the run,
        all processes together ({} without a mixture): a function of `steps` alone."""
        if not self.mixed:
            return {}
        rows = self.train_sequences.rows_by_source(steps * self.batch_size * self.process_count)
        seq_len = self.train_sequences.seq_len
        return {name: int(r) * seq_len for name, r in zip(self.mixture_sources, rows, strict=True)}

    def validation_batches(self) -> list[Batch]:
        """The fixed validation batches of this process: the same arrays on every call."""
        start, _ = _process_range(
            len(self.validation_sequences), self.process_index, self.process_count
        )
        batches = []
        for b in range(self.num_validation_batches):
            first = start + b * self.batch_size
            rows = [self.validation_sequences[first + r] for r in range(self.batch_size)]
            batches.append({key: np.stack([row[key] for row in rows]) for key in rows[0]})
        return batches


def _too_short(what: str, sequences: PackedSequences, seq_len: int, rows: int, fix: str) -> str:
    return (
        f"the {what} has {sequences.num_tokens} tokens = {len(sequences)} sequences of "
        f"seq_len+1={seq_len + 1} tokens, but one batch needs {rows}; {fix}"
    )


def _validation_batch_count(
    cfg: DataConfig, sequences: PackedSequences, seq_len: int, rows: int, process_count: int
) -> int:
    if cfg.validation_batches == 0:
        return 0
    per_process = len(sequences) // process_count
    if per_process < rows:
        fix = (
            "raise data.validation_fraction, lower train.batch_size or train.seq_len, or set "
            "data.validation_batches=0 to skip validation"
        )
        raise DataError(
            _too_short("validation split", sequences, seq_len, rows * process_count, fix)
        )
    return min(cfg.validation_batches, per_process // rows)


def make_datasets(
    cfg: DataConfig,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> Datasets:
    """Loads, tokenizes, splits and packs the corpus; builds nothing on disk.

    Args:
        cfg: the `data:` config section.
        seq_len: tokens per row of `inputs` / `targets` (sequences hold seq_len + 1 tokens).
        batch_size: the global batch size (a multiple of `process_count`).
        seed: shuffle seed in [0, 2**32).
        process_index: this JAX process (`jax.process_index()`).
        process_count: all JAX processes (`jax.process_count()`).

    Raises:
        DataError: a missing path, an empty or too short corpus, a bad token file, a token id
            outside the vocabulary, or a validation split too small for one batch (a
            `ValueError`, see `nvfp4_train.errors`).
    """
    _check_arguments(seq_len, batch_size, seed, process_index, process_count)
    rows = batch_size // process_count
    if cfg.mixture:
        return _mixed_datasets(cfg, seq_len, seed, rows, process_index, process_count)
    corpus = load_corpus(cfg)
    eos_id, documents = document_separator(cfg, corpus.tokenizer.eos_id)
    train = _sequences(corpus.train, seq_len, corpus.vocab_size, eos_id)
    validation = _sequences(corpus.validation, seq_len, corpus.vocab_size, eos_id)
    if len(train) // process_count < rows:
        fix = "use more text, or lower train.batch_size or train.seq_len"
        raise DataError(_too_short("training split", train, seq_len, batch_size, fix))
    return _datasets(
        cfg, corpus, train, validation, documents,
        seq_len=seq_len, seed=seed, rows=rows, process=(process_index, process_count),
    )  # fmt: skip


def _datasets(
    cfg: DataConfig, corpus: Corpus, train, validation, documents: str, *, seq_len: int,
    seed: int, rows: int, process: tuple[int, int], mixture_sources: tuple[str, ...] = (),
) -> Datasets:  # fmt: skip
    return Datasets(
        vocab_size=corpus.vocab_size,
        tokenizer=corpus.tokenizer,
        train_sequences=train,
        validation_sequences=validation,
        batch_size=rows,
        seed=seed,
        process_index=process[0],
        process_count=process[1],
        shuffle=cfg.shuffle,
        num_workers=cfg.num_workers,
        num_validation_batches=_validation_batch_count(cfg, validation, seq_len, rows, process[1]),
        documents=documents,
        mixed=bool(mixture_sources),
        mixture_sources=mixture_sources,
    )


def _mixed_datasets(
    cfg: DataConfig, seq_len: int, seed: int, rows: int, process_index: int, process_count: int
) -> Datasets:
    paths = [source.path for source in cfg.mixture]
    weights = [source.weight for source in cfg.mixture]
    source_shares = check_shares(paths, weights)
    corpora = mixture_corpora(cfg)
    tokenizer, vocab_size = corpora[0].tokenizer, corpora[0].vocab_size
    eos_id, documents = document_separator(cfg, tokenizer.eos_id)
    trains = [_sequences(c.train, seq_len, vocab_size, eos_id) for c in corpora]
    for source, train in zip(cfg.mixture, trains, strict=True):
        if len(train) == 0:
            raise DataError(
                f"data.mixture: {source.path!r} has {train.num_tokens} training tokens, fewer "
                f"than one sequence of seq_len+1={seq_len + 1}"
            )
    validations = [_sequences(c.validation, seq_len, vocab_size, eos_id) for c in corpora]
    held = min(int(len(v) / share) for v, share in zip(validations, source_shares, strict=True))
    train = MixedSequences(
        trains, weights, seed=seed, shuffle=cfg.shuffle, rows=rows,
        process_index=process_index, process_count=process_count,
    )  # fmt: skip
    validation = MixedSequences(validations, weights, seed=seed, shuffle=False, length=held)
    names = source_names(paths)
    realised = ", ".join(
        f"{name} {100 * share:.3g}%"
        for name, share in zip(names, train.realised_shares, strict=True)
    )
    documents = (
        f"{documents}; mixture of {len(corpora)} sources (data.mixture), shares of training "
        f"tokens: {realised}"
    )
    return _datasets(
        cfg, corpora[0], train, validation, documents, seq_len=seq_len, seed=seed, rows=rows,
        process=(process_index, process_count), mixture_sources=names,
    )  # fmt: skip
