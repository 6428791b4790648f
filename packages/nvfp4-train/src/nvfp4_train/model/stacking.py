"""Scanned layers: which consecutive blocks are stacked, and the per-layer <-> stacked trees.

With `model.scan_layers`, each run of r >= 2 repetitions of a group of p >= 1 consecutive blocks
that compute alike (block `start + q*p + j` like block `start + j`: the same recipe for each of
its linears, the same weight-decay mask) is stored ONCE, every parameter with a leading axis of
r, and runs as one `jax.lax.scan` over the r repetitions whose body applies the p blocks in
order: the compiled step holds p blocks per run instead of r*p (`layer_groups.groups_of`
picks the runs).
The entries of `layers` say what they hold:
    "3"      block 3, stored alone;
    "1-30"   blocks 1 to 30, all alike (period 1): one block's tree, leading axis 30;
    "1-8/2"  blocks 1 to 8, 4 repetitions of a group of 2 (period 2): {"0": the tree of blocks
             1, 3, 5, 7 (leading axis 4), "1": that of blocks 2, 4, 6, 8}.
So a stored path names the per-layer paths it holds without other information (`layer_paths`).

Checkpoints, the activation-amax statistics, telemetry and exports always see the per-layer
("canonical") tree, `layers.{i}...`: `LayerLayout.to_canonical` / `from_canonical` convert every
params-like dict inside a tree (the parameters, Adam's moments, gradients), so a run saved with one
layout resumes with another. `global_norm` gives the same bits for a stacked and a per-layer tree
(gradient clipping and the grad_norm metric use it).

Example:
    >>> layout = LayerLayout(4, runs=((1, 3),))
    >>> [key for key, _, _ in layout.entries]
    ['0', '1-2', '3']
    >>> stacked = layout.from_canonical({"layers": {str(i): np.full(2, i) for i in range(4)}})
    >>> sorted(stacked["layers"]), stacked["layers"]["1-2"].tolist()
    (['0', '1-2', '3'], [[1, 1], [2, 2]])
    >>> groups = LayerLayout(5, runs=((1, 5, 2),))  # blocks 1, 3 alike and 2, 4 alike
    >>> stacked = groups.from_canonical({"layers": {str(i): np.full(2, i) for i in range(5)}})
    >>> stacked["layers"]["1-4/2"]["1"].tolist()
    [[2, 2], [4, 4]]
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

RUN_KEY = re.compile(r"(\d+)-(\d+)(?:/(\d+))?")
"""A stacked entry of `layers`: first and last block index, inclusive, then "/period" for a
group of more than one block ("1-30", "1-8/2")."""
_STACKED_PATH = re.compile(r"(^|\.)layers\.(\d+)-\d+(?:/\d+\.(\d+))?(?=\.|$)")


def run_key(start: int, stop: int, period: int = 1) -> str:
    """The `layers` key of the stacked blocks `start` .. `stop - 1` in groups of `period`.

    Example:
        >>> run_key(1, 31), run_key(1, 9, period=2)
        ('1-30', '1-8/2')
    """
    return f"{start}-{stop - 1}" + (f"/{period}" if period > 1 else "")


def parse_run_key(key: str) -> tuple[int, int, int] | None:
    """(start, stop, period) of a stacked `layers` key, None for any other key.

    Example:
        >>> parse_run_key("1-30"), parse_run_key("1-8/2"), parse_run_key("3")
        ((1, 31, 1), (1, 9, 2), None)
    """
    run = RUN_KEY.fullmatch(key)
    return None if run is None else (int(run[1]), int(run[2]) + 1, int(run[3] or 1))


def canonical_path(dotted: str) -> str:
    """A dotted parameter path with a stacked entry replaced by the first block it holds:
    `layers.1-30.attn_norm.scale` -> `layers.1.attn_norm.scale`, `layers.1-8/2.1.mlp.down.kernel`
    -> `layers.2.mlp.down.kernel` (the path a rule sees)."""

    def first(m: re.Match) -> str:
        return f"{m[1]}layers.{int(m[2]) + int(m[3] or 0)}"

    return _STACKED_PATH.sub(first, dotted)


def is_stacked(path: Sequence[str]) -> bool:
    """Whether a parameter path (key names) lies inside a stacked entry of `layers`."""
    return any(
        a == "layers" and RUN_KEY.fullmatch(b) for a, b in zip(path[:-1], path[1:], strict=True)
    )


def layer_paths(path: Sequence[str]) -> tuple[str, ...]:
    """The dotted per-layer ("canonical") paths that a stored parameter path holds: itself for a
    block stored alone, one per block, in the order of the leading layer axis, for a stacked one.

    Example:
        >>> layer_paths(("layers", "1-3", "mlp", "down", "kernel"))
        ('layers.1.mlp.down.kernel', 'layers.2.mlp.down.kernel', 'layers.3.mlp.down.kernel')
        >>> layer_paths(("layers", "1-6/3", "2", "attn_norm", "scale"))
        ('layers.3.attn_norm.scale', 'layers.6.attn_norm.scale')
        >>> layer_paths(("layers", "0", "attn_norm", "scale"))
        ('layers.0.attn_norm.scale',)
    """
    path = tuple(path)
    for i in range(len(path) - 1):
        run = parse_run_key(path[i + 1]) if path[i] == "layers" else None
        if run is None:
            continue
        (start, stop, period), head, tail = run, path[: i + 1], path[i + 2 :]
        member = 0
        if period > 1:
            if not tail or not tail[0].isdigit() or int(tail[0]) >= period:
                raise ValueError(
                    f"a path into the group {path[i + 1]!r} must name one of its blocks "
                    f"0..{period - 1} next, got {'.'.join(path)!r}"
                )
            member, tail = int(tail[0]), tail[1:]
        blocks = range(start + member, stop, period)
        return tuple(".".join((*head, str(b), *tail)) for b in blocks)
    return (".".join(path),)


def _is_params(node: Any) -> bool:
    return isinstance(node, dict) and isinstance(node.get("layers"), dict)


def _without_layer_axis(sharding: Any) -> Any:
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
    return sharding


def _index(leaf: Any, j: int) -> Any:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        sharding = _without_layer_axis(getattr(leaf, "sharding", None))
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=sharding)
    return leaf[j]


def _stack(*leaves: Any) -> Any:
    first = leaves[0]
    if isinstance(first, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(leaves), *first.shape), first.dtype)
    if isinstance(first, np.ndarray | np.generic):
        return np.stack(leaves)
    return jnp.stack(leaves)


def _entry_start(key: str) -> int:
    run = parse_run_key(key)
    return run[0] if run else int(key)


def _members(stored: Any, period: int) -> tuple[Any, ...]:
    """The trees of the blocks of one group as stored (period 1: the entry itself), in order."""
    return (stored,) if period == 1 else tuple(stored[str(j)] for j in range(period))


def global_norm(tree: Any) -> jax.Array:
    """float32 L2 norm of all leaves of `tree`, the same bits whether its blocks are stacked or
    not when it is params-like (the gradients): the squares of the blocks are summed one block
    after another in model order (a stacked entry by a `jax.lax.scan` over its repetitions,
    each adding its blocks in order, so the compiled step does not grow with depth), before
    them those of the other parameters; each in sorted-key order. An optimization barrier keeps
    XLA from fusing the sums into the ops that produce `tree` (it orders fused reductions
    differently for stacked and unstacked blocks)."""
    tree = jax.lax.optimization_barrier(tree)
    if not _is_params(tree):
        return jnp.sqrt(_sum_of_squares(tree))
    layers = tree["layers"]
    total = _sum_of_squares({k: v for k, v in tree.items() if k != "layers"})
    for key in sorted(layers, key=_entry_start):
        run = parse_run_key(key)
        if run is None:
            total = total + _sum_of_squares(layers[key])
        else:
            total, _ = jax.lax.scan(_add_blocks, total, _members(layers[key], run[2]))
    return jnp.sqrt(total)


def _add_blocks(total: jax.Array, blocks: tuple) -> tuple[jax.Array, None]:
    """`total` plus the sums of squares of `blocks`, one block after another."""
    for block in blocks:
        total = total + _sum_of_squares(block)
    return total, None


def _sum_of_squares(tree: Any) -> jax.Array:
    """Sum of squares of the leaves of `tree` in float32, one dot per leaf, in leaf order."""
    flat = [leaf.astype(jnp.float32).ravel() for leaf in jax.tree.leaves(tree)]
    return sum((jnp.vdot(x, x) for x in flat), jnp.zeros((), jnp.float32))


class Segment(NamedTuple):
    """One stored entry of `layers`: blocks `start` .. `stop - 1`, stacked in groups of
    `period` when it holds more than one block."""

    key: str
    start: int
    stop: int
    period: int = 1

    @property
    def repeats(self) -> int:
        """The length of the leading axis of its arrays (1: a block stored alone)."""
        return (self.stop - self.start) // self.period


def _as_run(run: Sequence[int]) -> tuple[int, int, int]:
    if len(run) not in (2, 3) or not all(isinstance(v, int | np.integer) for v in run):
        raise ValueError(f"each run must be (start, stop) or (start, stop, period), got {run!r}")
    return (int(run[0]), int(run[1]), int(run[2]) if len(run) == 3 else 1)


@dataclasses.dataclass(frozen=True)
class LayerLayout:
    """How the `num_layers` blocks are stored: `runs` ((start, stop, period): [start, stop) in
    order, disjoint, r = (stop - start) / period >= 2 whole repetitions of a group of `period`
    blocks) are stacked; every other block is stored alone. A run given as (start, stop) has
    period 1 (stored as (start, stop, 1))."""

    num_layers: int
    runs: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        runs = tuple(_as_run(run) for run in self.runs)
        object.__setattr__(self, "runs", runs)
        previous = 0
        for start, stop, period in runs:
            if not (previous <= start and start + 2 <= stop <= self.num_layers):
                raise ValueError(
                    f"runs must be ordered, disjoint [start, stop) ranges of >= 2 of the "
                    f"{self.num_layers} blocks, got {runs}"
                )
            if period < 1 or (stop - start) % period or (stop - start) // period < 2:
                raise ValueError(
                    f"a run must hold >= 2 whole repetitions of its group of period >= 1 "
                    f"blocks, got [{start}, {stop}) of period {period}"
                )
            previous = stop

    @classmethod
    def of_keys(cls, keys: Sequence[str]) -> LayerLayout:
        """The layout whose `layers` dict has the keys `keys` ("0", "1-30", "31-34/2", ...)."""
        runs, last = [], -1
        for key in keys:
            run = parse_run_key(key)
            if run is None and not key.isdigit():
                raise ValueError(
                    "layers keys must be block indices, runs 'first-last' or runs of groups "
                    f"'first-last/period', got {key!r}"
                )
            if run is not None and key != run_key(*run):
                raise ValueError(f"layers key {key!r} must be spelled {run_key(*run)!r}")
            runs += [run] if run else []
            last = max(last, run[1] - 1 if run else int(key))
        layout = cls(last + 1, tuple(sorted(runs)))
        expected = sorted(segment.key for segment in layout.segments)
        if sorted(keys) != expected:
            raise ValueError(
                f"layers keys must hold blocks 0..{last} once each ({expected}), got {sorted(keys)}"
            )
        return layout

    @property
    def scanned(self) -> bool:
        """Whether any blocks are stacked."""
        return bool(self.runs)

    @property
    def segments(self) -> tuple[Segment, ...]:
        """Every stored entry, in model order."""
        segments, i, runs = [], 0, {start: (stop, p) for start, stop, p in self.runs}
        while i < self.num_layers:
            stop, period = runs.get(i, (i + 1, 1))
            key = run_key(i, stop, period) if stop - i > 1 else str(i)
            segments.append(Segment(key, i, stop, period))
            i = stop
        return tuple(segments)

    @property
    def entries(self) -> tuple[tuple[str, int, int], ...]:
        """(key in `layers`, start, stop) of every stored entry, in model order."""
        return tuple((s.key, s.start, s.stop) for s in self.segments)

    @property
    def bodies(self) -> int:
        """How many block bodies a compiled forward holds: a run its period, a block alone 1."""
        return sum(s.period for s in self.segments)

    def to_canonical(self, tree: Any, take: Callable[[Any, int], Any] | None = None) -> Any:
        """`tree` with every stacked entry of every params-like dict split into its blocks.

        Leaves may be arrays (sliced), NumPy arrays, or `jax.ShapeDtypeStruct`s (their sharding
        loses the layer axis). `take(array, j)`, when given, takes repetition `j` of a stacked
        array (e.g. a jitted program shared by every block). A tree that is already per-layer
        is returned unchanged; a group entry may hold only some of its blocks (the MoE
        statistics of a group with one MoE block).
        """
        return jax.tree.map(
            lambda n: self._split(n, take) if _is_params(n) else n, tree, is_leaf=_is_params
        )

    def from_canonical(self, tree: Any) -> Any:
        """`tree` with the blocks of every run of every params-like dict stacked (the inverse
        of `to_canonical`); entries already stacked are left as they are."""
        return jax.tree.map(
            lambda n: self._join(n) if _is_params(n) else n, tree, is_leaf=_is_params
        )

    def _split(self, node: dict, take: Callable[[Any, int], Any] | None = None) -> dict:
        layers = dict(node["layers"])

        def index(a: Any, q: int) -> Any:
            return _index(a, q) if take is None or not isinstance(a, jax.Array) else take(a, q)

        for key, start, stop, period in self.segments:
            if stop - start == 1 or key not in layers:
                continue
            members = {"0": layers.pop(key)} if period == 1 else layers.pop(key)
            for i in range(start, stop):
                q, j = divmod(i - start, period)
                if str(j) in members:  # a group's MoE statistics: its MoE blocks only
                    layers[str(i)] = jax.tree.map(lambda a, q=q: index(a, q), members[str(j)])
        return {**node, "layers": layers}

    def _join(self, node: dict) -> dict:
        layers = dict(node["layers"])
        for key, start, stop, period in self.segments:
            members = {}
            for j in range(period if stop - start > 1 else 0):
                names = [str(i) for i in range(start + j, stop, period)]
                if all(n in layers for n in names):
                    members[str(j)] = jax.tree.map(_stack, *(layers.pop(n) for n in names))
            if members:
                layers[key] = members["0"] if period == 1 else members
        return {**node, "layers": layers}
