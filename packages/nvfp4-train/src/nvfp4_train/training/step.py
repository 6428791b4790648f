"""The pure train step (with gradient accumulation), the eval step and the score step.

Each builder takes what it reads, not the whole run config: the model's graphdef, the optimizer
(`optim.make_optimizer` of the `optimizer` section), and the seed and accumulation of the `train`
section. The train state and the model a run builds live in `training.train_state`, the forward
and its losses in `training.forward`; both are re-exported here.

Example (`cfg` a run config with `cfg.model.vocab_size` set):
    optimizer = make_optimizer(cfg.optimizer, cfg.train.steps)
    graphdef, state = init_state(model_spec(cfg), optimizer, seed=cfg.train.seed)
    lr = make_schedule(cfg.optimizer, cfg.train.steps)
    train_step = jax.jit(
        make_train_step(graphdef, optimizer, lr, seed=cfg.train.seed), donate_argnums=0
    )
    state, metrics = train_step(state, {"inputs": x_BxL, "targets": y_BxL})"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from nvfp4_train.mesh.sharding import activation_constraint, trace_context
from nvfp4_train.model.moe.config import MoEConfig
from nvfp4_train.model.moe.stats import auxiliary_objective, load_metrics, update_router_bias
from nvfp4_train.model.stacking import global_norm
from nvfp4_train.optim.loss_scaling import current_loss_scale, last_step_skipped, skipped_steps
from nvfp4_train.training.forward import (
    Batch,
    ForwardStats,
    batch_documents,
    forward,
    forward_with_amax,
    forward_with_stats,
    token_loss_sum,
    token_losses,
)
from nvfp4_train.training.train_state import (
    ModelSpec,
    TrainState,
    count_params,
    flat_amax,
    init_state,
    model_graphdef,
    model_spec,
    state_from_params,
    with_vocab_size,
    with_weight_gather,
)

__all__ = [  # the state's and the forward's names are re-exported from `train_state`, `forward`
    "Batch",
    "ForwardStats",
    "ModelSpec",
    "TrainState",
    "batch_documents",
    "count_params",
    "flat_amax",
    "forward",
    "forward_with_amax",
    "forward_with_stats",
    "init_state",
    "make_eval_step",
    "make_score_step",
    "make_train_step",
    "model_graphdef",
    "model_spec",
    "state_from_params",
    "step_key",
    "with_vocab_size",
    "with_weight_gather",
]


def _split_microbatches(batch: Batch, accum: int) -> Batch:
    b = batch["inputs"].shape[0]
    if b % accum != 0:
        raise ValueError(
            f"batch size must be a multiple of train.grad_accum_steps={accum}, got batch size {b}"
        )
    return jax.tree.map(lambda x: x.reshape(accum, b // accum, *x.shape[1:]), batch)


def _accumulated_grads(
    graphdef, params, batch: Batch, key, loss_scale, accum: int, amax0, constrain, moe_cfg
):
    """Mean loss, the gradients of `(mean loss + MoE auxiliary losses + MTP loss) * loss_scale`
    summed over microbatches, the linears' input amax max-reduced over microbatches (starting
    from the tree `amax0`), and the MoE statistics (params' layout) and the MoE and MTP metrics
    averaged over microbatches. Every term of the objective is float32."""

    def scaled_loss(p, micro: Batch, micro_key):
        loss_sum, count, stats = token_loss_sum(graphdef, p, micro, micro_key, constrain, mtp=True)
        loss = loss_sum / count
        objective = loss + auxiliary_objective(moe_cfg, stats.moe_per_layer)
        metrics = load_metrics(stats.moe_per_layer)
        if stats.mtp is not None:  # float32: the MTP loss and the gradient it sends back
            objective = objective + stats.mtp.objective
            metrics["mtp_loss"] = jnp.mean(stats.mtp.depth_losses)
        moe = (stats.moe, metrics)
        return objective * loss_scale / accum, (loss / accum, stats.amax, moe)

    def body(carry, xs):
        index, micro = xs
        grad_fn = jax.value_and_grad(scaled_loss, has_aux=True)
        (_, (loss, amax, moe)), grads = grad_fn(params, micro, jax.random.fold_in(key, index))
        moe = jax.tree.map(lambda x: x / accum, moe)
        loss_sum, grad_sum, moe_sum = jax.tree.map(jnp.add, (carry[0], carry[1], carry[3]),
                                                   (loss, grads, moe))  # fmt: skip
        return (loss_sum, grad_sum, jax.tree.map(jnp.maximum, carry[2], amax), moe_sum), None

    micro_batches = _split_microbatches(batch, accum)
    moe0 = ({}, {})
    if moe_cfg.num_experts or _has_mtp(graphdef, params):  # the metrics' tree (shapes only)
        first = jax.tree.map(lambda x: x[0], micro_batches)
        shapes = jax.eval_shape(lambda: scaled_loss(params, first, key)[1][2])
        moe0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params), amax0, moe0)
    xs = (jnp.arange(accum), micro_batches)
    (loss, grads, amax, moe), _ = jax.lax.scan(body, zeros, xs)
    return loss, grads, amax, moe


def _has_mtp(graphdef: nnx.GraphDef, params) -> bool:
    """Whether the model of `graphdef` has multi-token prediction layers (`model.mtp`)."""
    return nnx.merge(graphdef, params).cfg.mtp.num_layers > 0


def _updated_amax(running, step_amax, skipped: jax.Array):
    """The running max, unchanged by a skipped step or a non-finite step amax."""

    def update(old, new):
        return jnp.where(skipped | ~jnp.isfinite(new), old, jnp.maximum(old, new))

    return jax.tree.map(update, running, step_amax)


def step_key(seed: int, step: int | jax.Array) -> jax.Array:
    """The stochastic-rounding key of the train step at `step` (completed steps before it):
    `fold_in(key(seed), step)`; the step folds the microbatch index into it."""
    return jax.random.fold_in(jax.random.key(seed), step)


def make_train_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    lr_schedule: optax.Schedule,
    *,
    seed: int,
    grad_accum_steps: int = 1,
    mesh: Mesh | None = None,
    moe: MoEConfig | None = None,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """Returns the pure `train_step(state, batch) -> (state, metrics)`; jit it once, donating state.

    Args:
        graphdef: the model (`init_state`, `model_graphdef`).
        optimizer: `optim.make_optimizer` of the `optimizer` section.
        lr_schedule: the optimizer's learning rate (`optim.make_schedule`), reported as `lr`.
        seed: `train.seed`: the stochastic-rounding key is `step_key(seed, step)`, folded again
            with the microbatch index, so a rerun is bit-identical.
        grad_accum_steps: microbatches per step (`train.grad_accum_steps`).
        mesh: constrain the tokens and logits to its batch / vocab sharding
            (`activation_constraint`), and trace under it (`trace_context`: the MoE blocks run
            expert-parallel over its `expert` axis); None: no constraint.
        moe: the model's `model.moe` section (its auxiliary losses join the objective, its
            router bias moves after every applied step); required for a model with MoE blocks.

    Metrics (scalars): `loss` (mean FP32 token cross-entropy of the batch), `grad_norm` (global
    norm of the unscaled, unclipped gradients), `lr`, `skipped` (1 if this update was skipped as
    non-finite), `skipped_total`, `loss_scale` (1.0 without dynamic loss scaling); with MoE
    blocks also `aux_loss`, `z_loss`, `max_load` and per block `moe` (`moe_stats.load_metrics`,
    averaged over the microbatches); with MTP layers (`model.mtp`) `mtp_loss`, the mean over
    the depths of each depth's token cross-entropy (unscaled; the objective adds it times
    `loss_scaling_factor`), float32.
    """
    accum = grad_accum_steps
    if accum < 1:
        raise ValueError(f"train.grad_accum_steps must be >= 1, got {accum}")
    constrain = activation_constraint(mesh)
    moe = MoEConfig() if moe is None else moe

    def train_step(state: TrainState, batch: Batch):
        key = step_key(seed, state.step)
        loss_scale = current_loss_scale(state.opt_state)
        amax0 = jax.tree.map(jnp.zeros_like, state.activation_amax)
        with trace_context(mesh):  # the MoE blocks' expert axis
            loss, grads, step_amax, (moe_stats, moe_metrics) = _accumulated_grads(
                graphdef, state.params, batch, key, loss_scale, accum, amax0, constrain, moe
            )
        if moe_stats and not moe.num_experts:
            raise ValueError("the model has MoE blocks: pass its model.moe to make_train_step")
        new_state, skipped = _apply_gradients(state, grads, step_amax, moe_stats, optimizer, moe)
        metrics = _step_metrics(
            loss, grads, loss_scale, lr_schedule, state.step, skipped, new_state
        )
        return new_state, moe_metrics | metrics

    return train_step


def _apply_gradients(
    state: TrainState,
    grads,
    step_amax,
    moe_stats,
    optimizer: optax.GradientTransformation,
    moe: MoEConfig,
) -> tuple[TrainState, jax.Array]:
    """(the state after the optimizer applies `grads`, whether it skipped them as non-finite): the
    router bias moves and the running input amax grows only on an applied step."""
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    skipped = last_step_skipped(opt_state)
    if moe.bias_update_rate:  # not moved by a skipped step (a rate of 0 adds +-0)
        rate = jnp.where(skipped, 0.0, moe.bias_update_rate)
        params = update_router_bias(params, moe_stats, rate)
    amax = _updated_amax(state.activation_amax, step_amax, skipped)
    return TrainState(state.step + 1, params, opt_state, amax), skipped


def _step_metrics(
    loss: jax.Array,
    grads,
    loss_scale: jax.Array,
    lr_schedule: optax.Schedule,
    step: jax.Array,
    skipped: jax.Array,
    new_state: TrainState,
) -> dict[str, jax.Array]:
    """The train step's scalar metrics but the MoE ones (`make_train_step`'s "Metrics")."""
    return {
        "loss": loss,
        "grad_norm": global_norm(grads) / loss_scale,
        "lr": lr_schedule(step),
        "skipped": skipped.astype(jnp.int32),
        "skipped_total": skipped_steps(new_state.opt_state),
        "loss_scale": loss_scale,
    }


def make_eval_step(
    graphdef: nnx.GraphDef, *, seed: int, mesh: Mesh | None = None
) -> Callable[[Any, Batch], tuple[jax.Array, ...]]:
    """Returns `eval_step(params, batch) -> (loss_sum float32, token_count int32)`.

    Forward only: the fixed key `key(seed)` (`train.seed`) is passed for recipes that require
    one (stochastic rounding only touches gradients, so it does not change the result).
    """
    constrain = activation_constraint(mesh)

    def eval_step(params, batch: Batch):
        with trace_context(mesh):
            loss_sum, count, _ = token_loss_sum(
                graphdef, params, batch, jax.random.key(seed), constrain
            )
        return loss_sum, jnp.asarray(count, jnp.int32)

    return eval_step


def make_score_step(
    graphdef: nnx.GraphDef, *, seed: int, mesh: Mesh | None = None
) -> Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
    """Returns `score_step(params, inputs_BxL, targets_BxL) -> (logp_BxL, greedy_BxL)`: each
    target's log-probability (float32, minus the training loss's token cross-entropy: the same
    forward, key and loss as `make_eval_step`) and whether it is the argmax of its logits."""
    constrain = activation_constraint(mesh)

    def score_step(params, inputs_BxL: jax.Array, targets_BxL: jax.Array):
        batch = {"inputs": inputs_BxL, "targets": targets_BxL}
        with trace_context(mesh):
            losses_BxL, logits_BxLxV, _ = token_losses(
                graphdef, params, batch, jax.random.key(seed), constrain
            )
        greedy_BxL = jnp.argmax(logits_BxLxV, axis=-1) == targets_BxL
        return -losses_BxL, greedy_BxL

    return score_step
