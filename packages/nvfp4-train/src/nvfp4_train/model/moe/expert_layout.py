"""Which device computes which routed expert under expert parallelism, and its buffer's rows.

On a mesh whose `expert` axis splits the E experts, the shard of `expert` index h holds experts
[h E_l, (h + 1) E_l), E_l = E / |expert|. The devices of one shard in the (data, fsdp) groups are
its replicas; replica r computes `count` = ceil(E_l / replicas) consecutive experts of the shard
from `start` = min(r count, E_l - count) (clamped into the shard), of which it owns those in
[r count, (r + 1) count): each expert is computed on exactly one device, and a replica past the
shard's experts owns none. A device's index over the token axes (data, fsdp, expert), the order
the batch's rows are split in, is d = r |expert| + h.

Example (4 experts, data=2 x expert=2: one expert per device):
    >>> layout = ExpertLayout(num_experts=4, local=2, count=1, rows=8, k=2, capacity=16,
    ...                       token_axes=("data", "expert"), replica_axes=("data",),
    ...                       devices=4, shards=2)
    >>> experts, owned = expert_table(layout)
    >>> experts.ravel().tolist(), owned.ravel().tolist()
    ([0, 2, 1, 3], [True, True, True, True])
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class ExpertLayout(NamedTuple):
    """The static layout of one expert-parallel call, the same on every device."""

    num_experts: int  # E
    local: int  # the experts of one `expert` shard, E / |expert|
    count: int  # the experts one device computes, ceil(local / replicas)
    rows: int  # its grouped-GEMM buffer rows (`local_rows`)
    k: int  # experts per token
    capacity: int  # `moe_config.expert_capacity` of the whole batch's tokens
    token_axes: tuple[str, ...]  # the token axes of size > 1, in mesh order
    replica_axes: tuple[str, ...]  # those of them besides `expert`
    devices: int  # devices over the token axes (|data fsdp expert|)
    shards: int  # |expert|


class ExpertSlice(NamedTuple):
    """The experts one device computes: `count` experts of its shard from `start` (`mine`
    masks the ones another replica owns); `offset`: the global index of the first."""

    start: jax.Array
    count: int
    mine: jax.Array
    offset: jax.Array


def local_rows(tokens: int, k: int, local_experts: int, capacity: int) -> int:
    """Rows of one device's grouped-GEMM buffer: the most assignments its `local_experts` can
    take from `tokens` tokens (a token picks k distinct experts; each expert at most
    `capacity`).

    Example:
        >>> local_rows(64, k=2, local_experts=1, capacity=128)
        64
    """
    return min(tokens * min(k, local_experts), local_experts * capacity)


def expert_table(layout: ExpertLayout) -> tuple[np.ndarray, np.ndarray]:
    """(the global expert of each device's slots, int32 [devices, count]; whether the device
    owns it, bool [devices, count]), devices in token-axes order (module doc)."""
    device = np.arange(layout.devices)
    first = device // layout.shards * layout.count
    start = np.minimum(first, layout.local - layout.count)
    relative = start[:, None] + np.arange(layout.count)
    experts = (device % layout.shards * layout.local)[:, None] + relative
    owned = (relative >= first[:, None]) & (relative < first[:, None] + layout.count)
    return experts.astype(np.int32), owned


def device_slice(layout: ExpertLayout) -> ExpertSlice:
    """This device's `ExpertSlice` (inside the expert-parallel `shard_map`)."""
    experts, owned = expert_table(layout)
    start = experts[:, 0] - np.arange(layout.devices) % layout.shards * layout.local
    me = jax.lax.axis_index(layout.token_axes)
    start, owned, offset = (jnp.asarray(table)[me] for table in (start, owned, experts[:, 0]))
    return ExpertSlice(start, layout.count, owned, offset)
