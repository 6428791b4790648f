"""The named axes of the device mesh, and which of them split a batch's tokens.

Floor 0: the names both the sharding rules (`mesh.sharding`) and the expert-parallel dispatch of
the MoE blocks (`model.expert_parallel`) use, so neither imports the other for them.

Example:
    >>> AXES, TOKEN_AXES
    (('data', 'fsdp', 'expert', 'tensor'), ('data', 'fsdp', 'expert'))
"""

from __future__ import annotations

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
