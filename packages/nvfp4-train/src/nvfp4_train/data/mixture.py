"""Weighted mixtures of token corpora: which source every row of every batch comes from.

The rows of the global batch stream (row r of step s is row `s * global_batch + r`) follow a fixed
schedule of `PERIOD` slots in which source k holds about `weight_k * PERIOD` slots, spread by
smooth weighted round-robin, so every run of n consecutive rows holds each source's share to
within about one row: the realised token proportions equal the weights over any window, not only
on average. Row g takes the next unread sequence of its source, in an order reshuffled every
epoch of that source (a permutation seeded by the run seed, the source and the epoch), so a small
source repeats sooner than a large one, as its weight asks. Every row is a pure function of its
index, so a resumed iterator continues exactly, and each process reads its own rows of the same
global stream: the batches do not depend on the number of processes. Weights are normalized
without overflow (any finite positive numbers); a source whose share rounds to no slot would never
be read and is refused (`check_shares`, naming it). `rows_by_source(n)` counts each source's rows
among the first n, a function of n alone (the trainer logs it as `tokens_by_source`).

Example:
    >>> schedule = round_robin([0.5, 0.25, 0.25], period=8)
    >>> schedule.tolist()
    [0, 1, 2, 0, 0, 1, 2, 0]
"""

from collections.abc import Sequence

import numpy as np

from nvfp4_train.data.packing import PackedSequences
from nvfp4_train.errors import DataError

PERIOD = 1 << 14
"""Slots of the schedule: weights are realised to within 1 / PERIOD (6e-5)."""


def shares(weights: Sequence[float]) -> np.ndarray:
    """`weights` normalized to sum to 1 (float64), without overflow however large they are.

    Raises:
        ValueError: a weight that is not a finite number > 0, or no weights.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or not np.all(np.isfinite(w)) or not np.all(w > 0):
        raise ValueError(f"mixture weights must be finite numbers > 0, got {list(weights)}")
    w = w / w.max()  # in (0, 1]: the sum cannot overflow
    return w / w.sum()


def slot_counts(weights: Sequence[float], period: int = PERIOD) -> np.ndarray:
    """Slots of the schedule each source holds (int64, summing to `period`): its share of
    `period`, rounded down, the spare slots going to the largest remainders. A source whose share
    is far below one slot gets 0: `MixedSequences` refuses that (it would never be read)."""
    exact = shares(weights) * period
    counts = np.floor(exact).astype(np.int64)
    remainders = np.argsort(-(exact - counts), kind="stable")
    counts[remainders[: period - counts.sum()]] += 1
    return counts


def round_robin(weights: Sequence[float], period: int = PERIOD) -> np.ndarray:
    """The source of each of `period` slots (int32): `slot_counts` each, interleaved."""
    counts = slot_counts(weights, period)
    current = np.zeros(len(counts), dtype=np.int64)
    schedule = np.empty(period, dtype=np.int32)
    for slot in range(period):
        current += counts
        pick = int(np.argmax(current))
        current[pick] -= period
        schedule[slot] = pick
    return schedule


def check_shares(paths: Sequence[str], weights: Sequence[float]) -> np.ndarray:
    """The sources' shares of training tokens, after checking every one gets a slot."""
    for path, weight, slots, share in zip(
        paths, weights, slot_counts(weights), shares(weights), strict=True
    ):
        if slots == 0:
            raise DataError(
                f"data.mixture: {path!r} (weight {weight:g}) has a share of "
                f"{share:.3g} of the training tokens, under one of the {PERIOD:,} slots of the "
                f"schedule (a share of {1 / PERIOD:.2g}): it would never be read; raise its "
                "weight or remove it"
            )
    return shares(weights)


def source_names(paths: Sequence[str]) -> tuple[str, ...]:
    """Each mixture source's path; a path listed twice gets its index too."""
    return tuple(p if paths.count(p) == 1 else f"{p} [{k}]" for k, p in enumerate(paths))


class MixedSequences:
    """A grain `RandomAccessDataSource` over the sequences of several sources, mixed by weight.

    Args:
        sources: the packed sequences of each source (same `seq_len`, same vocabulary).
        weights: positive, one per source (normalized here).
        seed: the run seed; with `shuffle`, every source is read in a new order every epoch.
        shuffle: False reads each source's sequences in order.
        rows: rows of a batch on this process; item j of this process is global row
            `(j // rows) * rows * process_count + process_index * rows + j % rows`.
        process_index, process_count: this JAX process and all of them.
        length: how many items this source claims (an iterator never wraps around it).
    """

    def __init__(
        self,
        sources: Sequence[PackedSequences],
        weights: Sequence[float],
        *,
        seed: int,
        shuffle: bool,
        rows: int = 1,
        process_index: int = 0,
        process_count: int = 1,
        length: int = 1 << 40,
    ) -> None:
        if length and any(len(s) == 0 for s in sources):
            raise ValueError("every source of a mixture needs at least one sequence")
        unread = np.flatnonzero(slot_counts(weights) == 0)
        if unread.size:
            share = shares(weights)[unread[0]]
            raise ValueError(
                f"mixture source {int(unread[0])} has a share of {share:.3g}, under one of the "
                f"{PERIOD:,} slots of the schedule: it would never be read"
            )
        self._sources, self._weights = list(sources), [float(w) for w in weights]
        self._seed, self._shuffle = seed, shuffle
        self._rows, self._index, self._count = rows, process_index, process_count
        self._length = length
        self._schedule = round_robin(self._weights)
        one_hot = self._schedule[None, :] == np.arange(len(sources))[:, None]
        self._before = np.cumsum(one_hot, axis=1) - one_hot  # [K, PERIOD] slots of k before
        self._per_period = one_hot.sum(axis=1)
        self._orders: dict[int, tuple[int, np.ndarray]] = {}

    @property
    def seq_len(self) -> int:
        return self._sources[0].seq_len

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self._sources)

    def __len__(self) -> int:
        return self._length

    @property
    def realised_shares(self) -> np.ndarray:
        """The share of rows (= of tokens) each source gets: its slots of the schedule / PERIOD."""
        return self._per_period / PERIOD

    def rows_by_source(self, rows: int) -> np.ndarray:
        """How many of global rows [0, rows) each source provides (int64 [K])."""
        return (rows // PERIOD) * self._per_period + self._before[:, rows % PERIOD]

    def source_of(self, row: int) -> tuple[int, int]:
        """(source, sequence index within it) of global row `row`."""
        slot = row % PERIOD
        source = int(self._schedule[slot])
        read = (row // PERIOD) * int(self._per_period[source]) + int(self._before[source, slot])
        epoch, position = divmod(read, len(self._sources[source]))
        return source, self._order(source, epoch, position)

    def _order(self, source: int, epoch: int, position: int) -> int:
        if not self._shuffle:
            return position
        cached = self._orders.get(source)
        if cached is None or cached[0] != epoch:
            rng = np.random.default_rng([self._seed, source, epoch])
            cached = (epoch, rng.permutation(len(self._sources[source])))
            self._orders[source] = cached
        return int(cached[1][position])

    def max_documents_per_row(self) -> int | None:
        """The most documents any row holds (rows are its sources' sequences), or None."""
        counts = [s.max_documents_per_row() for s in self._sources]
        return None if None in counts else max(counts)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self._length:
            raise IndexError(f"sequence index {index} out of range [0, {self._length})")
        step, row = divmod(index, self._rows)
        source, sequence = self.source_of((step * self._count + self._index) * self._rows + row)
        return self._sources[source][sequence]

    def __repr__(self) -> str:
        # grain compares repr(source) when restoring an iterator state: name what decides the rows.
        parts = ", ".join(
            f"{w:g}: {s!r}" for w, s in zip(self._weights, self._sources, strict=True)
        )
        return (
            f"MixedSequences({parts}; seed={self._seed}, shuffle={self._shuffle}, "
            f"rows={self._rows}, process={self._index}/{self._count})"
        )

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_orders": {}}
