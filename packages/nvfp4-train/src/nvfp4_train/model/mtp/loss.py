"""The multi-token prediction loss, in float32: what each depth predicts where, and the objective.

Depth d (1..D) at position i embeds token i + d (`shift_left(inputs, d)`) and predicts token
i + d + 1, which is `targets[i + d]` (targets are the inputs shifted by one). Position i counts
for depth d when i + d < L (the row holds that target) and, in a packed row, token i + d is in
position i's document (`segment_ids[i + d] == segment_ids[i]`: the token read at depth d comes
from the document the position attends to; its target may be the next document's first token,
as the main loss's target after a separator is). Per depth the loss is the mean token
cross-entropy over the positions that count (Megatron's `process_mtp_loss`), and the objective
`loss_scaling_factor / D * sum_d loss_d`. Every reduction runs in float32 on float32 logits, so
the gradient flowing back into each depth's logits is float32 (Nemotron 3 Ultra's divergence
came from reducing this gradient in BF16).

Example:
    >>> shift_left(jnp.array([[1, 2, 3, 4]]), 1).tolist()
    [[2, 3, 4, 0]]
    >>> targets, counts = depth_targets(jnp.array([[2, 3, 4, 5]]), None, 2)
    >>> targets.tolist(), counts.tolist()
    ([[4, 5, 0, 0]], [[True, True, False, False]])
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def shift_left(x_BxL: jax.Array, d: int, fill: int = 0) -> jax.Array:
    """`x` with each row moved left by `d` positions, the last `d` set to `fill`."""
    length = x_BxL.shape[1]
    if d >= length:
        return jnp.full_like(x_BxL, fill)
    return jnp.concatenate([x_BxL[:, d:], jnp.full_like(x_BxL[:, :d], fill)], axis=1)


def depth_targets(
    targets_BxL: jax.Array, segment_ids_BxL: jax.Array | None, d: int
) -> tuple[jax.Array, jax.Array]:
    """(the token position i predicts at depth d, int [B, L]; whether it counts, bool [B, L]):
    `targets[i + d]`, counted when i + d < L and token i + d is in position i's document."""
    length = targets_BxL.shape[1]
    counts_BxL = jnp.broadcast_to(jnp.arange(length) + d < length, targets_BxL.shape)
    if segment_ids_BxL is not None:
        same = shift_left(segment_ids_BxL, d, fill=-1) == segment_ids_BxL
        counts_BxL = counts_BxL & same
    return shift_left(targets_BxL, d), counts_BxL


class MTPLoss(NamedTuple):
    """The MTP part of one batch's objective.

    Attributes:
        objective: float32 scalar, `loss_scaling_factor / D * sum_d loss_d` (what joins the
            training objective).
        depth_losses: float32 [D], each depth's mean token cross-entropy (unscaled).
    """

    objective: jax.Array
    depth_losses: jax.Array


def mtp_loss(
    mtp_logits: tuple[jax.Array, ...],
    targets_BxL: jax.Array,
    segment_ids_BxL: jax.Array | None,
    loss_scaling_factor: float,
) -> MTPLoss:
    """The MTP loss of a batch from each depth's logits [B, L, vocab] (cast to float32 first)."""
    losses = []
    for d, logits_BxLxV in enumerate(mtp_logits, start=1):
        target_BxL, counts_BxL = depth_targets(targets_BxL, segment_ids_BxL, d)
        logp = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
        ce_BxL = -jnp.take_along_axis(logp, target_BxL[..., None], axis=-1)[..., 0]
        weight_BxL = counts_BxL.astype(jnp.float32)
        count = jnp.maximum(jnp.sum(weight_BxL), 1.0)
        losses.append(jnp.sum(ce_BxL * weight_BxL, dtype=jnp.float32) / count)
    depth_losses = jnp.stack(losses).astype(jnp.float32)
    objective = jnp.float32(loss_scaling_factor / len(losses)) * jnp.sum(depth_losses)
    return MTPLoss(objective, depth_losses)
