"""Parameter paths: the one way nvfp4-train names the leaves of a pytree.

A leaf's path is the tuple of its keys' names (dict keys, attribute names, sequence indices as
strings), `("layers", "3", "attn", "qkv", "kernel")`; the dotted form joins them with ".",
`layers.3.attn.qkv.kernel`, as checkpoints, rules, statistics and errors spell them.

Example:
    >>> flat_paths({"layers": {"0": {"scale": 1}}, "embed": {"embedding": 2}})
    {'embed.embedding': 2, 'layers.0.scale': 1}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax


def key_names(key_path: Sequence[Any]) -> tuple[str, ...]:
    """The names of a `jax.tree_util` key path's entries (`DictKey.key`, `GetAttrKey.name`,
    `SequenceKey.idx`, `FlattenedIndexKey.key`) as strings."""
    names = []
    for k in key_path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                names.append(str(getattr(k, attr)))
                break
        else:
            names.append(str(k))
    return tuple(names)


def flat_paths(tree: Any) -> dict[str, Any]:
    """{dotted path: leaf} of every leaf of `tree`, in `jax.tree_util` order (dict keys sorted)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(key_names(path)): leaf for path, leaf in flat}
