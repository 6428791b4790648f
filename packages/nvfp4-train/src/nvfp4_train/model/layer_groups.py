"""Which consecutive blocks to stack: pure functions of the blocks' signatures (anything
comparable that is equal for blocks that compute alike; `model.layer_layout` builds them), with
no JAX. `nvfp4_train.model.stacking` stores and converts what they choose."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

MAX_GROUP_PERIOD = 8
"""The longest group of blocks `model.layer_layout` stacks (`groups_of`'s `max_period`)."""


def runs_of(signatures: Sequence[Hashable], min_length: int = 2) -> tuple[tuple[int, int], ...]:
    """[start, stop) of every maximal run of equal consecutive `signatures` of >= `min_length`."""
    runs, start = [], 0
    for i in range(1, len(signatures) + 1):
        if i == len(signatures) or signatures[i] != signatures[start]:
            if i - start >= min_length:
                runs.append((start, i))
            start = i
    return tuple(runs)


def _periodic_spans(signatures: Sequence[Hashable], period: int) -> list[int]:
    """For each block i, the length of the longest stretch from i on with period `period`
    (`signatures[k] == signatures[k - period]` for every k of it past its first group)."""
    n = len(signatures)
    matches = [0] * (n + 1)  # consecutive k >= i with signatures[k] == signatures[k - period]
    for k in range(n - 1, period - 1, -1):
        matches[k] = matches[k + 1] + 1 if signatures[k] == signatures[k - period] else 0
    return [min(n - i, period + matches[i + period]) if i + period < n else n - i for i in range(n)]


def groups_of(
    signatures: Sequence[Hashable], max_period: int = MAX_GROUP_PERIOD
) -> tuple[tuple[int, int, int], ...]:
    """(start, stop, period) of the runs to stack: r >= 2 repetitions of a group of
    1 <= period <= `max_period` consecutive blocks (`signatures[start + q*period + j] ==
    signatures[start + j]`), chosen by dynamic programming to minimise the block bodies the
    compiled program holds (a run costs its period, a block alone 1); ties go to fewer segments,
    then to the longer first segment, then to the shorter period. Period 1 alone gives the
    maximal runs of `runs_of`.

    Example (each letter a block signature; `bodies` counts the block bodies of the program):
        >>> bodies = lambda runs, n: n - sum(stop - start - p for start, stop, p in runs)
        >>> groups_of("abbbc"), groups_of("abababa"), groups_of("aabaabaab")
        (((1, 4, 1),), ((0, 6, 2),), ((0, 9, 3),))

    Nemotron 3 Nano's 52 blocks (M Mamba, E MoE, * attention) have no two consecutive blocks
    alike, so runs of period 1 stack nothing (52 bodies); its first 8 blocks compile as 6
    bodies ("ME" twice, then 4 alone), all 52 as 14 ("MEMEM*E" 5 times, "ME" 3 times, M, *,
    "EM" 4 times, E):
        >>> nano = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
        >>> groups_of(nano[:8]), bodies(groups_of(nano[:8]), 8)
        (((0, 4, 2),), 6)
        >>> groups_of(nano), bodies(groups_of(nano), 52)
        (((0, 35, 7), (35, 41, 2), (43, 51, 2)), 14)
        >>> runs_of(nano), bodies(groups_of(nano, max_period=1), 52)
        ((), 52)
    """
    if max_period < 1:
        raise ValueError(f"max_period must be >= 1, got {max_period}")
    n = len(signatures)
    spans = {p: _periodic_spans(signatures, p) for p in range(1, min(max_period, n // 2) + 1)}
    cost: list[tuple[int, int, int]] = [(0, 0, 0)] * (n + 1)  # (bodies, segments, -length)
    choice: list[tuple[int, int]] = [(n, 1)] * (n + 1)  # (stop, period) of the first segment
    for i in range(n - 1, -1, -1):
        cost[i], choice[i] = (1 + cost[i + 1][0], 1 + cost[i + 1][1], -1), (i + 1, 1)
        for p, span in spans.items():
            for stop in range(i + 2 * p, i + span[i] // p * p + 1, p):
                option = (p + cost[stop][0], 1 + cost[stop][1], i - stop)
                if option < cost[i]:
                    cost[i], choice[i] = option, (stop, p)
    runs, i = [], 0
    while i < n:
        stop, period = choice[i]
        if stop - i > 1:
            runs.append((i, stop, period))
        i = stop
    return tuple(runs)
