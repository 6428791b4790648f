"""Is a train state fit to be saved, and is a restored one what was saved?

`state_integrity(state)` gives, for every array of a `TrainState` but `step`, two 32-bit checksums
of its bits, and whether every floating value is finite. A checkpoint stores them (its `integrity`
item, docs/checkpoint-schema.md); a restore recomputes and compares them, so bytes flipped on disk
are detected instead of trained on, and a state holding NaN or Inf is never saved.

The checksums of an array x with its bits read as unsigned integers u (64-bit values folded to
32 bits as hi ^ lo, narrower ones zero-extended): s1 = sum(u) mod 2^32 and
s2 = sum(u * 0x9E3779B1 mod 2^32) mod 2^32. Integer sums in any order give the same result, so
the checksums do not depend on the device mesh, and any single flipped bit changes s1.

The checkpoint's JSON items (`config`, `quant_stats`) are covered too: `json_sha256(value)` is the
SHA-256 of the value's canonical JSON (keys sorted, no whitespace, ASCII), which the value read
back from its item has as well.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
from jax.tree_util import keystr

from nvfp4_train.mesh.sharding import host_value
from nvfp4_train.model.stacking import LayerLayout, is_stacked, layer_paths

ALGORITHM = "u32-sum+golden-sum"
GOLDEN = 0x9E3779B1


def json_sha256(value: Any) -> str:
    """SHA-256 (hex) of `value` as canonical JSON: `json.dumps(value, sort_keys=True,
    separators=(",", ":"), ensure_ascii=True)` encoded as ASCII (docs/checkpoint-schema.md;
    nvfp4-export computes the same, `nvfp4_export.json_files.json_sha256`)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _as_u32(x: jax.Array) -> jax.Array:
    bits = jnp.dtype(x.dtype).itemsize * 8
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    u = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}"))
    if bits == 64:
        return (u >> 32).astype(jnp.uint32) ^ u.astype(jnp.uint32)
    return u.astype(jnp.uint32)


def _checksums(x: jax.Array) -> jax.Array:
    """uint32 [2]: (s1, s2) of `x` (see the module docstring)."""
    u = _as_u32(x).reshape(-1)
    mixed = u * jnp.uint32(GOLDEN)
    return jnp.stack([jnp.sum(u, dtype=jnp.uint32), jnp.sum(mixed, dtype=jnp.uint32)])


def _items(state: Any) -> dict[str, Any]:
    return {name: getattr(state, name) for name in state._fields if name != "step"}


def _names(path: tuple) -> tuple[str, ...]:
    return tuple(keystr((key,), simple=True, separator=".") for key in path)


SMALL_BYTES = 1 << 16
"""Arrays of at most this many bytes that are not stacked (per-layer activation amax, norms of an
unstacked block) are checksummed by shape and dtype, stacked together: one vmapped reduction per
shape and dtype instead of one per array, and no large array is ever copied."""


def _finite(x: jax.Array) -> jax.Array:
    return jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.bool_(True)


def _plan(flat: list) -> list[tuple[str, list[int]]]:
    """The arrays of `flat` ((names, array) pairs) grouped for `_integrity`: ("stacked", [i]) an
    array of stacked blocks, ("alike", [i, ...]) small unstacked arrays of one shape and dtype,
    ("one", [i]) any other array."""
    plan, alike = [], {}
    for i, (names, x) in enumerate(flat):
        if is_stacked(names):
            plan.append(("stacked", [i]))
        elif x.size * jnp.dtype(x.dtype).itemsize <= SMALL_BYTES:
            alike.setdefault((tuple(x.shape), jnp.dtype(x.dtype)), []).append(i)
        else:
            plan.append(("one", [i]))
    return plan + [("alike", indices) for indices in alike.values()]


@functools.partial(jax.jit, static_argnums=0)
def _integrity(kinds: tuple[str, ...], groups: tuple[tuple[jax.Array, ...], ...]) -> tuple:
    """(checksums of each group: uint32 [2] one array, [layers, 2] the blocks of a stacked one,
    [arrays, 2] alike arrays; all finite). The program holds one reduction per group."""
    sums, finite = [], []
    for kind, arrays in zip(kinds, groups, strict=True):
        x = jnp.stack(arrays) if kind == "alike" else arrays[0]
        sums.append(_checksums(x) if kind == "one" else jax.vmap(_checksums)(x))
        finite.append(_finite(x))
    return sums, jnp.all(jnp.stack(finite)) if finite else jnp.bool_(True)


def state_integrity(state: Any) -> dict[str, Any]:
    """{"algorithm", "finite": bool, "checksums": {item.path: [s1, s2]}} of a TrainState.

    The paths are per layer whatever the layout: an array of stacked blocks
    (`params.layers.1-30...`, `params.layers.1-30/2.0...`: `model.stacking`) has one checksum
    pair per block, under the path each block has once split (`params.layers.1...`, ...), the
    same pair its slice has. One jitted program computes them all, vmapped over the blocks of each stacked array and over
    the small arrays of each shape and dtype, so it does not grow with depth.
    """
    flat = [(_names(path), x) for path, x in jax.tree_util.tree_flatten_with_path(_items(state))[0]]
    plan = _plan(flat)
    kinds = tuple(kind for kind, _ in plan)
    groups = tuple(tuple(flat[i][1] for i in indices) for _, indices in plan)
    sums, finite = jax.tree.map(host_value, _integrity(kinds, groups))
    checksums = {}
    for (kind, indices), rows in zip(plan, sums, strict=True):
        if kind == "one":
            paths, rows = layer_paths(flat[indices[0]][0]), rows[None]
        elif kind == "stacked":
            paths = layer_paths(flat[indices[0]][0])
        else:
            paths = tuple(".".join(flat[i][0]) for i in indices)
        if rows.shape[0] != len(paths):
            raise ValueError(
                f"{'.'.join(flat[indices[0]][0])} holds {len(paths)} arrays or stacked blocks "
                f"but its checksums have a leading axis of {rows.shape[0]}"
            )
        checksums.update({p: [int(r[0]), int(r[1])] for p, r in zip(paths, rows, strict=True)})
    return {
        "algorithm": ALGORITHM,
        "finite": bool(finite),
        "checksums": {path: checksums[path] for path in _per_layer_paths(_items(state))},
    }


def _per_layer_paths(items: dict[str, Any]) -> list[str]:
    """The dotted paths of the arrays of `items` split per layer, in the order of that per-layer
    tree's leaves (the order the checksums have always been written in)."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), items)
    layers = (
        items.get("params", {}).get("layers") if isinstance(items.get("params"), dict) else None
    )
    if isinstance(layers, dict):
        abstract = LayerLayout.of_keys(list(layers)).to_canonical(abstract)
    flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
    return [".".join(_names(path)) for path, _ in flat]


def integrity_problems(state: Any, saved: dict[str, Any] | None) -> list[str]:
    """What is wrong with a restored state: non-finite values, checksums that differ from the
    `saved` integrity item (None for a checkpoint written before checksums: finiteness only)."""
    now = state_integrity(state)
    problems = [] if now["finite"] else ["it holds NaN or Inf"]
    if saved is None:
        return problems
    if saved.get("algorithm") != ALGORITHM:
        return [
            *problems,
            f"its integrity item has an unknown algorithm {saved.get('algorithm')!r}",
        ]
    expected = saved.get("checksums", {})
    differ = sorted(p for p in now["checksums"] if expected.get(p) != now["checksums"][p])
    missing = sorted(set(expected) - set(now["checksums"]))
    if differ:
        shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
        problems.append(f"the checksums of {shown} differ from the ones saved with it")
    if missing:
        problems.append(f"arrays saved with it are missing: {', '.join(missing[:3])}")
    return problems
