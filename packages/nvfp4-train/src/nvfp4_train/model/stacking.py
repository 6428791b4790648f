"""Scanned layers: which consecutive blocks are stacked, and the per-layer <-> stacked trees.

With `model.scan_layers`, each run of two or more consecutive blocks that compute alike (the same
recipe for each of the four linears, the same weight-decay mask) is stored as ONE block whose
parameters carry a leading layer axis, under the key "<first>-<last>" of `layers` ("1-30" holds
blocks 1 to 30), and runs under `jax.lax.scan`: the compiled step holds one copy of the block per
run instead of one per layer. A block alone keeps its index as key ("0").

Checkpoints, the activation-amax statistics, telemetry and exports always see the per-layer
("canonical") tree, `layers.{i}...`: `LayerLayout.to_canonical` / `from_canonical` convert every
params-like dict inside a tree (the parameters, Adam's moments, gradients), so a run saved with one
layout resumes with another. `global_norm` gives the same bits for a stacked and a per-layer tree
(gradient clipping and the grad_norm metric use it).

Which blocks to stack: `nvfp4_train.model.layer_groups`.

Example:
    >>> layout = LayerLayout(4, runs=((1, 3),))
    >>> [key for key, _, _ in layout.entries]
    ['0', '1-2', '3']
    >>> stacked = layout.from_canonical({"layers": {str(i): np.full(2, i) for i in range(4)}})
    >>> sorted(stacked["layers"]), stacked["layers"]["1-2"].tolist()
    (['0', '1-2', '3'], [[1, 1], [2, 2]])
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

RUN_KEY = re.compile(r"(\d+)-(\d+)")
"""A stacked entry of `layers`: first and last block index, inclusive."""
_STACKED_PATH = re.compile(r"(^|\.)layers\.(\d+)-\d+(\.|$)")


def run_key(start: int, stop: int) -> str:
    """The `layers` key of the stacked blocks `start` .. `stop - 1`."""
    return f"{start}-{stop - 1}"


def canonical_path(dotted: str) -> str:
    """A dotted parameter path with a stacked entry replaced by its first block:
    `layers.1-30.attn_norm.scale` -> `layers.1.attn_norm.scale` (the path a rule sees)."""
    return _STACKED_PATH.sub(lambda m: f"{m.group(1)}layers.{m.group(2)}{m.group(3)}", dotted)


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
        >>> layer_paths(("layers", "0", "attn_norm", "scale"))
        ('layers.0.attn_norm.scale',)
    """
    path = tuple(path)
    for i in range(len(path) - 1):
        run = RUN_KEY.fullmatch(path[i + 1]) if path[i] == "layers" else None
        if run:
            first, last = int(run.group(1)), int(run.group(2))
            return tuple(
                ".".join((*path[: i + 1], str(j), *path[i + 2 :])) for j in range(first, last + 1)
            )
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
    run = RUN_KEY.fullmatch(key)
    return int(run.group(1)) if run else int(key)


def global_norm(tree: Any) -> jax.Array:
    """float32 L2 norm of all leaves of `tree`, the same bits whether its blocks are stacked or
    not when it is params-like (the gradients): the squares of the blocks are summed one block
    after another in model order (a stacked entry by a `jax.lax.scan` over its layers, so the
    compiled step does not grow with depth), before them those of the other parameters; each
    in sorted-key order. An optimization barrier keeps XLA from fusing the sums into the ops that
    produce `tree` (it orders fused reductions differently for stacked and unstacked blocks)."""
    tree = jax.lax.optimization_barrier(tree)
    if not _is_params(tree):
        return jnp.sqrt(_sum_of_squares(tree))
    layers = tree["layers"]
    total = _sum_of_squares({k: v for k, v in tree.items() if k != "layers"})
    for key in sorted(layers, key=_entry_start):
        if RUN_KEY.fullmatch(key):
            step = lambda acc, block: (acc + _sum_of_squares(block), None)  # noqa: E731
            total, _ = jax.lax.scan(step, total, layers[key])
        else:
            total = total + _sum_of_squares(layers[key])
    return jnp.sqrt(total)


def _sum_of_squares(tree: Any) -> jax.Array:
    """Sum of squares of the leaves of `tree` in float32, one dot per leaf, in leaf order."""
    flat = [leaf.astype(jnp.float32).ravel() for leaf in jax.tree.leaves(tree)]
    return sum((jnp.vdot(x, x) for x in flat), jnp.zeros((), jnp.float32))


@dataclasses.dataclass(frozen=True)
class LayerLayout:
    """How the `num_layers` blocks are stored: `runs` ([start, stop), >= 2 blocks each, in
    order, disjoint) are stacked; every other block is stored alone."""

    num_layers: int
    runs: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        previous = 0
        for start, stop in self.runs:
            if not (previous <= start and start + 2 <= stop <= self.num_layers):
                raise ValueError(
                    f"runs must be ordered, disjoint [start, stop) ranges of >= 2 of the "
                    f"{self.num_layers} blocks, got {self.runs}"
                )
            previous = stop

    @classmethod
    def of_keys(cls, keys: Sequence[str]) -> LayerLayout:
        """The layout whose `layers` dict has the keys `keys` ("0", "1-30", "31", ...)."""
        runs, last = [], -1
        for key in keys:
            run = RUN_KEY.fullmatch(key)
            if run:
                runs.append((int(run.group(1)), int(run.group(2)) + 1))
            elif not key.isdigit():
                raise ValueError(
                    f"layers keys must be block indices or runs 'first-last', got {key!r}"
                )
            last = max(last, runs[-1][1] - 1 if run else int(key))
        return cls(last + 1, tuple(sorted(runs)))

    @property
    def scanned(self) -> bool:
        """Whether any blocks are stacked."""
        return bool(self.runs)

    @property
    def entries(self) -> tuple[tuple[str, int, int], ...]:
        """(key in `layers`, start, stop) of every stored entry, in model order."""
        entries, i, runs = [], 0, dict(self.runs)
        while i < self.num_layers:
            stop = runs.get(i, i + 1)
            entries.append((run_key(i, stop) if stop - i > 1 else str(i), i, stop))
            i = stop
        return tuple(entries)

    def to_canonical(self, tree: Any, take: Callable[[Any, int], Any] | None = None) -> Any:
        """`tree` with every stacked entry of every params-like dict split into its blocks.

        Leaves may be arrays (sliced), NumPy arrays, or `jax.ShapeDtypeStruct`s (their sharding
        loses the layer axis). `take(array, j)`, when given, takes block `j` of a stacked array
        (e.g. a jitted program shared by every block). A tree that is already per-layer is
        returned unchanged.
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

        def index(a: Any, j: int) -> Any:
            return _index(a, j) if take is None or not isinstance(a, jax.Array) else take(a, j)

        for key, start, stop in self.entries:
            if stop - start > 1 and key in layers:
                stacked = layers.pop(key)
                for j in range(stop - start):
                    layers[str(start + j)] = jax.tree.map(lambda a, j=j: index(a, j), stacked)
        return {**node, "layers": layers}

    def _join(self, node: dict) -> dict:
        layers = dict(node["layers"])
        for key, start, stop in self.entries:
            names = [str(i) for i in range(start, stop)]
            if stop - start > 1 and all(n in layers for n in names):
                layers[key] = jax.tree.map(_stack, *(layers.pop(n) for n in names))
        return {**node, "layers": layers}
