"""The model's forward for training and evaluation: logits, token losses and the statistics a
step keeps (the linears' input amax, the MoE blocks' routing). `nvfp4_train.training.step`
re-exports the public names.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax
from flax import nnx

from nvfp4_train.model.moe.stats import split_sown
from nvfp4_train.model.mtp.loss import MTPLoss, mtp_loss

Batch = dict[str, jax.Array]


class ForwardStats(NamedTuple):
    """What a forward reports besides its logits.

    Attributes:
        amax: max |input| of each linear in this call (an expert linear: one per expert), tree
            as in `TrainState.activation_amax` (per layer).
        moe: each MoE block's statistics (`model.moe.MOE_STATS`) at its `mlp` path, in the
            params' layout (stacked blocks with a leading layer axis); empty for a dense model.
        moe_per_layer: `moe` with its stacked blocks split per layer.
        mtp: the multi-token prediction loss (`model.mtp.loss.MTPLoss`, float32) when the
            forward was given the targets and the model has MTP layers, else None.
    """

    amax: dict[str, Any]
    moe: dict[str, Any]
    moe_per_layer: dict[str, Any]
    mtp: MTPLoss | None = None


def forward_with_stats(
    graphdef: nnx.GraphDef, params, inputs_BxL: jax.Array, key=None, documents=None,
    constrain=None, targets_BxL: jax.Array | None = None,
) -> tuple[jax.Array, ForwardStats]:  # fmt: skip
    """(float32 logits [B, L, vocab], `ForwardStats`). `documents`: None, or (segment ids,
    positions) [B, L] of packed documents; `constrain`: the run's activation constraint
    (`Llama.__call__`); `targets_BxL`: given, a model with MTP layers also runs them and reports
    their loss (`ForwardStats.mtp`)."""
    model = nnx.merge(graphdef, params)
    segment_ids, positions = (None, None) if documents is None else documents
    mtp = targets_BxL is not None and model.cfg.mtp.num_layers > 0
    output, intermediates = nnx.capture(model, nnx.Intermediate)(
        inputs_BxL, key=key, segment_ids_BxL=segment_ids, positions_BxL=positions,
        constrain=constrain, mtp=mtp,
    )  # fmt: skip
    logits_BxLxV, depths = output if mtp else (output, ())
    amax, moe = split_sown(nnx.to_pure_dict(intermediates))
    layout = model.layout
    mtp_stats = (
        mtp_loss(depths, targets_BxL, segment_ids, model.cfg.mtp.loss_scaling_factor)
        if mtp
        else None
    )
    return logits_BxLxV, ForwardStats(
        layout.to_canonical(amax), moe, layout.to_canonical(moe), mtp_stats
    )


def forward_with_amax(
    graphdef: nnx.GraphDef, params, inputs_BxL: jax.Array, key=None, documents=None
) -> tuple[jax.Array, dict[str, Any]]:
    """(float32 logits [B, L, vocab], max |input| of each linear in this call, tree as in
    `TrainState.activation_amax`); see `forward_with_stats`."""
    logits_BxLxV, stats = forward_with_stats(graphdef, params, inputs_BxL, key, documents)
    return logits_BxLxV, stats.amax


def forward(
    graphdef: nnx.GraphDef, params, inputs_BxL: jax.Array, key=None, documents=None
) -> jax.Array:
    """float32 logits [B, L, vocab] of the model `graphdef` with `params` (`documents` as in
    `forward_with_amax`)."""
    return forward_with_amax(graphdef, params, inputs_BxL, key, documents)[0]


def _no_constraint(kind: str, x: jax.Array) -> jax.Array:
    del kind
    return x


def batch_documents(batch: Batch, constrain=None) -> tuple[jax.Array, jax.Array] | None:
    """(segment ids, positions) of a batch that carries them (packed documents), else None."""
    if "segment_ids" not in batch:
        return None
    constrain = constrain or _no_constraint
    return constrain("tokens", batch["segment_ids"]), constrain("tokens", batch["positions"])


def token_losses(
    graphdef, params, batch: Batch, key, constrain=_no_constraint, *, mtp: bool = False
) -> tuple[jax.Array, jax.Array, ForwardStats]:
    """float32 [B, L] token cross-entropies (the training loss per target), the logits and the
    forward's statistics (the linears' input amax, the MoE blocks' routing; with `mtp`, the
    multi-token prediction loss of a model with MTP layers)."""
    inputs_BxL = constrain("tokens", batch["inputs"])
    documents = batch_documents(batch, constrain)
    targets_BxL = batch["targets"] if mtp else None
    logits_BxLxV, stats = forward_with_stats(
        graphdef, params, inputs_BxL, key, documents, constrain, targets_BxL
    )
    logits_BxLxV = constrain("logits", logits_BxLxV)
    losses_BxL = optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, batch["targets"])
    return losses_BxL, logits_BxLxV, stats


def token_loss_sum(
    graphdef, params, batch: Batch, key, constrain=_no_constraint, *, mtp: bool = False
) -> tuple[jax.Array, int, ForwardStats]:
    """float32 sum of token cross-entropies, the number of tokens, and the forward's
    statistics (the linears' input amax, the MoE blocks' routing, with `mtp` the MTP loss)."""
    losses_BxL, _, stats = token_losses(graphdef, params, batch, key, constrain, mtp=mtp)
    return losses_BxL.sum(), losses_BxL.size, stats
