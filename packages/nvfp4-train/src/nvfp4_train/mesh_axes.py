"""The named axes of the device mesh, and which of them split a batch's tokens.

Floor 0: the names both the sharding rules (`mesh.sharding`) and the expert-parallel dispatch of
the MoE blocks (`model.expert_parallel`) use, so neither imports the other for them.

Example:
    >>> AXES, TOKEN_AXES
    (('data', 'fsdp', 'expert', 'tensor'), ('data', 'fsdp', 'expert'))
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

EXPERT_AXIS = "expert"
"""Splits the routed experts of every MoE block (and the batch, as data parallelism)."""
FSDP_AXIS = "fsdp"
"""Splits the batch, and the parameters and optimizer state (gathered where they are used)."""
TENSOR_AXIS = "tensor"
"""Splits the features inside the linears (tensor parallelism)."""
AXES = ("data", FSDP_AXIS, EXPERT_AXIS, TENSOR_AXIS)
"""The mesh's axes in device order: `tensor` varies fastest, then `expert` (on GPUs the two that
communicate most share a node's NVLink when their product fits in one node)."""
TOKEN_AXES = ("data", FSDP_AXIS, EXPERT_AXIS)
"""The axes the rows of a batch are split over, in order: `expert` is data parallelism outside
the MoE blocks (as in MaxText and Megatron-LM)."""


def fit_axes(
    axes: Sequence[str | tuple | None], shape: Sequence[int], mesh_shape: Mapping[str, int]
) -> tuple[str | tuple[str, ...] | None, ...]:
    """A PartitionSpec's entries for an array of `shape`: each dimension's `axes` with the axes
    of size 1 dropped, and all of them dropped (the dimension replicated) when their product does
    not divide the dimension.

    Example:
        >>> fit_axes((FSDP_AXIS, TENSOR_AXIS), (64, 6), {FSDP_AXIS: 4, TENSOR_AXIS: 4})
        ('fsdp', None)
    """
    fitted = []
    for names, dim in zip(axes, shape, strict=True):
        names = (names,) if isinstance(names, str) else tuple(names or ())
        names = tuple(a for a in names if mesh_shape.get(a, 1) > 1)
        size = math.prod(mesh_shape[a] for a in names)
        kept = names if names and dim % size == 0 else ()
        fitted.append((kept[0] if len(kept) == 1 else kept) if kept else None)
    return tuple(fitted)
