"""Packing a token stream into fixed-length training sequences, and the held-out split.

A stream of N tokens (documents already joined with their separator) is cut into
`(N - 1) // seq_len` sequences of `seq_len + 1` tokens; sequence i starts at token `i * seq_len`,
so consecutive sequences share one boundary token: the last target of sequence i is the first input
of sequence i + 1, and every token is a target exactly once. The tail that does not fill a sequence
is dropped.

The validation split is taken from the END of the corpus, before any shuffling, so the training and
validation sequences come from disjoint token (or text) ranges.

With a document separator (`eos_id`), every sequence also carries its documents: `segment_ids`
(0 for the document the sequence starts in, +1 after every separator: a separator belongs to the
document it ends) and `positions` (each token's index within its document, counted from the
sequence start for the first one), so that attention stays within a document and RoPE restarts.
Both are a function of the sequence's own tokens, so a resumed iterator yields them exactly.

Example:
    >>> source = PackedSequences(np.arange(10, dtype=np.uint16), 0, 10, seq_len=4, vocab_size=10)
    >>> len(source), source[1]["inputs"].tolist(), source[1]["targets"].tolist()
    (2, [4, 5, 6, 7], [5, 6, 7, 8])
    >>> [a.tolist() for a in document_fields(np.array([7, 7, 0, 7, 0, 0, 7]), eos_id=0)]
    [[0, 0, 0, 1, 1, 2, 3], [0, 1, 2, 0, 1, 0, 0]]
"""

import hashlib
from collections.abc import Sequence

import numpy as np

from nvfp4_train.errors import DataError

FULL_CHECK_MAX_TOKENS = 2**28


def split_documents(documents: Sequence[str], fraction: float) -> tuple[list[str], list[str]]:
    """Splits documents by characters: the last `fraction` of the text becomes validation.

    A document that straddles the boundary is cut, at a line break if one lies within as many
    characters before the cut as are still to be held out (so at most twice the target is held).

    Returns:
        (train_documents, validation_documents), disjoint, together the whole text.
    """
    train, held = list(documents), []
    remaining = round(sum(len(d) for d in documents) * fraction)
    while remaining > 0 and train:
        last = train.pop()
        if len(last) <= remaining:
            held.insert(0, last)
            remaining -= len(last)
            continue
        cut = len(last) - remaining
        line_break = last.rfind("\n", max(0, cut - remaining), cut)
        cut = line_break + 1 if line_break > 0 else cut
        train.append(last[:cut])
        held.insert(0, last[cut:])
        remaining = 0
    return train, held


def split_range(num_tokens: int, fraction: float) -> tuple[tuple[int, int], tuple[int, int]]:
    """Token ranges [start, stop) of the training and validation parts of a stream."""
    held = round(num_tokens * fraction)
    return (0, num_tokens - held), (num_tokens - held, num_tokens)


def check_token_ids(tokens: np.ndarray, vocab_size: int, what: str) -> None:
    """Raises DataError if any id is negative or >= vocab_size (in chunks, memory-mapped friendly)."""
    chunk = 1 << 24
    for start in range(0, tokens.size, chunk):
        part = tokens[start : start + chunk]
        low, high = int(part.min()), int(part.max())
        if low < 0 or high >= vocab_size:
            bad = high if high >= vocab_size else low
            raise DataError(
                f"{what} holds token id {bad}, outside the vocabulary [0, {vocab_size}); set "
                "data.tokens_vocab_size (or data.tokenizer_path) to match the tokenizer that "
                "wrote the ids"
            )


def document_fields(inputs_L: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(segment ids, positions), int32 [L], of a packed row whose documents end with `eos_id`."""
    ends_L = inputs_L == eos_id
    segment_ids_L = (np.cumsum(ends_L) - ends_L).astype(np.int32)
    index_L = np.arange(inputs_L.size, dtype=np.int32)
    starts_L = np.concatenate([[True], segment_ids_L[1:] != segment_ids_L[:-1]])
    positions_L = index_L - np.maximum.accumulate(np.where(starts_L, index_L, 0))
    return segment_ids_L, positions_L.astype(np.int32)


def _fingerprint(tokens: np.ndarray, start: int, stop: int) -> str:
    """A short content hash of the range's first and last 4096 tokens (for checkpoint checks)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(np.ascontiguousarray(tokens[start : min(stop, start + 4096)]).tobytes())
    digest.update(np.ascontiguousarray(tokens[max(start, stop - 4096) : stop]).tobytes())
    return digest.hexdigest()


class PackedSequences:
    """A grain `RandomAccessDataSource` of packed sequences over `tokens[start:stop]`.

    Item i is `{"inputs": int32[seq_len], "targets": int32[seq_len]}`, targets being the inputs
    shifted by one, plus `segment_ids` and `positions` (int32[seq_len], `document_fields`) when
    `eos_id` (the document separator) is given. Ids are checked against `vocab_size` as they are
    read, so a bad id in a corpus too large to scan up front still fails loudly. A memory-mapped `tokens` is pickled
    (for grain worker processes) as its file name, not its contents.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        start: int,
        stop: int,
        *,
        seq_len: int,
        vocab_size: int,
        eos_id: int | None = None,
    ) -> None:
        if not 0 <= start <= stop <= tokens.size:
            raise ValueError(f"need 0 <= start <= stop <= {tokens.size}, got {start}, {stop}")
        self._tokens = tokens
        self._start, self._stop = start, stop
        self._seq_len, self._vocab_size, self._eos_id = seq_len, vocab_size, eos_id
        self._length = max(0, (stop - start - 1) // seq_len)
        self._fingerprint = _fingerprint(tokens, start, stop)

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def num_tokens(self) -> int:
        return self._stop - self._start

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self._length:
            raise IndexError(f"sequence index {index} out of range [0, {self._length})")
        begin = self._start + index * self._seq_len
        window = np.asarray(self._tokens[begin : begin + self._seq_len + 1], dtype=np.int64)
        if window.min() < 0 or window.max() >= self._vocab_size:
            check_token_ids(window, self._vocab_size, f"the corpus (tokens {begin}..)")
        window = window.astype(np.int32)
        item = {"inputs": window[:-1], "targets": window[1:]}
        if self._eos_id is not None:
            item["segment_ids"], item["positions"] = document_fields(item["inputs"], self._eos_id)
        return item

    def max_documents_per_row(self) -> int | None:
        """The most documents any sequence holds (what attention "te" is compiled for), counted
        in one pass over the tokens (memory-mapped friendly); None without a separator.

        Example:
            >>> PackedSequences(np.array([5, 0, 0, 5, 0, 5, 5, 5, 5]), 0, 9, seq_len=4,
            ...                 vocab_size=6, eos_id=0).max_documents_per_row()
            3
        """
        if self._eos_id is None:
            return None
        most, rows_per_chunk = 0, max(1, (1 << 24) // self._seq_len)
        for first in range(0, self._length, rows_per_chunk):
            rows = min(rows_per_chunk, self._length - first)
            begin = self._start + first * self._seq_len
            inputs = np.asarray(self._tokens[begin : begin + rows * self._seq_len])
            # a separator ends its document: the ones before a row's last input start new ones
            ends = inputs.reshape(rows, self._seq_len)[:, :-1] == self._eos_id
            most = max(most, int(ends.sum(axis=1).max()) + 1)
        return max(most, 1)

    def __repr__(self) -> str:
        # grain compares repr(source) when restoring an iterator state: describe the content
        # (the order of the sequences, which masking documents or not does not change).
        return (
            f"PackedSequences(tokens={self._stop - self._start}, seq_len={self._seq_len}, "
            f"vocab_size={self._vocab_size}, fingerprint={self._fingerprint})"
        )

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        tokens = self._tokens
        if isinstance(tokens, np.memmap) and tokens.filename is not None:
            state["_tokens"] = (
                "memmap",
                tokens.filename,
                tokens.offset,
                tokens.dtype,
                tokens.shape,
            )
        return state

    def __setstate__(self, state: dict) -> None:
        tokens = state["_tokens"]
        if isinstance(tokens, tuple):
            _, filename, offset, dtype, shape = tokens
            state["_tokens"] = np.memmap(
                filename, dtype=dtype, mode="r", offset=offset, shape=shape
            )
        self.__dict__.update(state)
