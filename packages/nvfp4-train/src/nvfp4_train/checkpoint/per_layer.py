"""Checkpoints are per layer: a train state whose blocks are stacked (`model.scan_layers`) is
split into its layers on save (one transient copy of the stacked items) and stacked again on
restore, so a checkpoint does not depend on the layout that wrote it."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from nvfp4_train.checkpoint.items import LAYOUT_ITEMS
from nvfp4_train.model.stacking import LayerLayout


def _take_layer(stacked: jax.Array, j: jax.Array) -> jax.Array:
    """Block `j` of a stacked array (its leading layer axis dropped)."""
    return jax.lax.dynamic_index_in_dim(stacked, j, axis=0, keepdims=False)


class PerLayer:
    """The conversions between a layout with stacked blocks and the per-layer one on disk."""

    def __init__(self, layout: LayerLayout) -> None:
        self.layout = layout
        self._take = jax.jit(_take_layer)

    def split(self, items: dict[str, Any]) -> dict[str, Any]:
        """`items` (trees of the stacked layout, or their abstract targets) per layer."""
        return {k: self.layout.to_canonical(v) for k, v in items.items()}

    def to_disk(self, state: NamedTuple) -> NamedTuple:
        """`state` with its `LAYOUT_ITEMS` split per layer: each block of a stacked array is a
        copy taken by one jitted program per shape and dtype (the layer index is an argument),
        so saving compiles the same programs at any depth."""
        items = {k: getattr(state, k) for k in LAYOUT_ITEMS}
        return state._replace(
            **{k: self.layout.to_canonical(v, take=self._take) for k, v in items.items()}
        )

    def from_disk(self, state: NamedTuple, in_layout: dict[str, Any]) -> NamedTuple:
        """`state` read per layer with its `LAYOUT_ITEMS` stacked again, placed as the
        restore targets `in_layout` (of the stacked layout) say."""
        shardings = jax.tree.map(lambda t: t.sharding, {k: in_layout[k] for k in LAYOUT_ITEMS})
        stack = jax.jit(
            lambda items: {k: self.layout.from_canonical(v) for k, v in items.items()},
            out_shardings=shardings,
        )
        return state._replace(**stack({k: getattr(state, k) for k in LAYOUT_ITEMS}))
