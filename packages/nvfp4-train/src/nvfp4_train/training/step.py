"""Train state, the model a run builds, the pure train step (with gradient accumulation) and the
eval step.

Each builder takes what it reads, not the whole run config: the model (`ModelSpec`, made from a
run config by `model_spec`), the optimizer (`optim.make_optimizer` of the `optimizer` section),
and the seed and accumulation of the `train` section.

Example (`cfg` a run config with `cfg.model.vocab_size` set):
    optimizer = make_optimizer(cfg.optimizer, cfg.train.steps)
    graphdef, state = init_state(model_spec(cfg), optimizer, seed=cfg.train.seed)
    lr = make_schedule(cfg.optimizer, cfg.train.steps)
    train_step = jax.jit(
        make_train_step(graphdef, optimizer, lr, seed=cfg.train.seed), donate_argnums=0
    )
    state, metrics = train_step(state, {"inputs": x_BxL, "targets": y_BxL})
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

import nvfp4_ops
from nvfp4_train.errors import ConfigError
from nvfp4_train.mesh.sharding import activation_constraint, kernel_axes, trace_context
from nvfp4_train.model.blocks.linear import QuantLinear
from nvfp4_train.model.config import ModelConfig, input_amax_shape, linear_paths
from nvfp4_train.model.decoder import Llama
from nvfp4_train.model.moe.config import MoEConfig
from nvfp4_train.model.moe.stats import (
    auxiliary_objective,
    load_metrics,
    split_sown,
    update_router_bias,
)
from nvfp4_train.model.stacking import LayerLayout, global_norm
from nvfp4_train.optim.loss_scaling import current_loss_scale, last_step_skipped, skipped_steps
from nvfp4_train.precision.policy import backend_spec, layer_recipes, run_layout
from nvfp4_train.tree_paths import flat_paths

Batch = dict[str, jax.Array]


class TrainState(NamedTuple):
    """Everything a step changes.

    Attributes:
        step: int32 scalar, number of completed steps.
        params: Pure nested dict of float32 arrays (`nnx.State.to_pure_dict()` of `Llama`), in
            the model's layout (`run_layout`: stacked blocks under `layers.{first}-{last}`).
        opt_state: The optimizer's state (its moments in the same layout).
        activation_amax: Running max over applied steps of |x| at each linear's input (x after
            the compute-dtype cast), float32 scalars in a tree like the linears' params:
            `activation_amax["layers"]["0"]["attn"]["qkv"]` (see `flat_amax`), always per layer.
    """

    step: jax.Array
    params: dict[str, Any]
    opt_state: optax.OptState
    activation_amax: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """How a run builds its `Llama`: every argument but the parameters' seed.

    Attributes:
        config: the `model` section (`vocab_size` filled: `with_vocab_size`).
        recipes: module path -> `nvfp4_ops.Recipe` of the base model (`policy.layer_recipes`).
        backend: `nvfp4_ops.dot_general`'s backend (`policy.backend_spec` of `precision.backend`).
        layout: which blocks are stored stacked (`policy.run_layout`).
        gather: what FSDP gathers of each linear's kernel (`precision.gather`,
            `model.weight_gather`).
    """

    config: ModelConfig
    recipes: Mapping[str, nvfp4_ops.Recipe]
    backend: str | tuple[str, ...]
    layout: LayerLayout
    gather: str = "master"

    def build(self, rngs: nnx.Rngs, recipes: Mapping[str, nvfp4_ops.Recipe] | None = None) -> Llama:
        """The model, with `recipes` instead of the base ones when given."""
        recipes = dict(self.recipes if recipes is None else recipes)
        model = Llama(self.config, recipes, rngs=rngs, backend=self.backend, layout=self.layout)
        return with_weight_gather(model, self.gather)


def with_weight_gather(model: nnx.Module, gather: str) -> nnx.Module:
    """`model` with every `QuantLinear` set to gather its kernel per `gather` (`precision.gather`),
    its kernel's mesh axes taken from the sharding rules by the linear's name (in place)."""
    if gather == "master":
        return model
    for path, module in nnx.iter_graph(model):
        if isinstance(module, QuantLinear) and path:
            module.gather = gather
            module.kernel_axes = kernel_axes(str(path[-1]))
    return model


def model_spec(cfg) -> ModelSpec:
    """The `ModelSpec` of a run config (reads `model`, `precision`, `train.steps` and
    `optimizer.no_decay`: the layout stacks only blocks alike in every precision phase and in
    weight decay)."""
    return ModelSpec(
        cfg.model,
        layer_recipes(cfg.model, cfg.precision),
        backend_spec(cfg.precision.backend),
        run_layout(cfg),
        cfg.precision.gather,
    )


def init_state(
    spec: ModelSpec, optimizer: optax.GradientTransformation, *, seed: int
) -> tuple[nnx.GraphDef, TrainState]:
    """Builds the model of `spec` with parameter seed `seed` and its step-0 state.

    Returns:
        (graphdef, state): the model's static structure (recipes included) and step-0 state.
    """
    model = spec.build(nnx.Rngs(params=seed))
    graphdef, model_state = nnx.split(model)
    params = nnx.to_pure_dict(model_state)
    return graphdef, state_from_params(spec.config, params, optimizer)


def state_from_params(
    model: ModelConfig, params: dict[str, Any], optimizer: optax.GradientTransformation
) -> TrainState:
    """The step-0 state of a run whose parameters are `params` (a fresh init, or weights
    imported with `model.init_from`): fresh optimizer state, no activation statistics yet."""
    amax = _amax_tree(
        {p: jnp.zeros(input_amax_shape(model, p), jnp.float32) for p in linear_paths(model)}
    )
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), amax)


def model_graphdef(
    spec: ModelSpec, recipes: Mapping[str, nvfp4_ops.Recipe] | None = None
) -> nnx.GraphDef:
    """The model's static structure (recipes included) without materialising parameters.

    `recipes` (module path -> `nvfp4_ops.Recipe`, e.g. a `PrecisionPhase.recipes` of
    `policy.precision_phases`) default to the spec's. The params tree is the one of
    `init_state(spec, ...)` (`run_layout` stacks only blocks alike in every phase), so the same
    `TrainState` runs through any of them.
    """
    abstract = nnx.eval_shape(lambda: spec.build(nnx.Rngs(params=0), recipes))
    return nnx.graphdef(abstract)


def _amax_tree(flat: dict[str, jax.Array]) -> dict[str, Any]:
    """{"layers.0.attn.qkv": a} -> {"layers": {"0": {"attn": {"qkv": a}}}}."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def flat_amax(activation_amax: dict[str, Any]) -> dict[str, Any]:
    """`TrainState.activation_amax` as {module path with dots: value}, e.g. `layers.0.attn.qkv`."""
    return flat_paths(activation_amax)


class ForwardStats(NamedTuple):
    """What a forward reports besides its logits.

    Attributes:
        amax: max |input| of each linear in this call (an expert linear: one per expert), tree
            as in `TrainState.activation_amax` (per layer).
        moe: each MoE block's statistics (`model.moe.MOE_STATS`) at its `mlp` path, in the
            params' layout (stacked blocks with a leading layer axis); empty for a dense model.
        moe_per_layer: `moe` with its stacked blocks split per layer.
    """

    amax: dict[str, Any]
    moe: dict[str, Any]
    moe_per_layer: dict[str, Any]


def forward_with_stats(
    graphdef: nnx.GraphDef, params, inputs_BxL: jax.Array, key=None, documents=None,
    constrain=None,
) -> tuple[jax.Array, ForwardStats]:  # fmt: skip
    """(float32 logits [B, L, vocab], `ForwardStats`). `documents`: None, or (segment ids,
    positions) [B, L] of packed documents; `constrain`: the run's activation constraint
    (`Llama.__call__`)."""
    model = nnx.merge(graphdef, params)
    segment_ids, positions = (None, None) if documents is None else documents
    logits_BxLxV, intermediates = nnx.capture(model, nnx.Intermediate)(
        inputs_BxL, key=key, segment_ids_BxL=segment_ids, positions_BxL=positions,
        constrain=constrain,
    )  # fmt: skip
    amax, moe = split_sown(nnx.to_pure_dict(intermediates))
    layout = model.layout
    return logits_BxLxV, ForwardStats(layout.to_canonical(amax), moe, layout.to_canonical(moe))


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


def _token_losses(
    graphdef, params, batch: Batch, key, constrain=_no_constraint
) -> tuple[jax.Array, jax.Array, ForwardStats]:
    """float32 [B, L] token cross-entropies (the training loss per target), the logits and the
    forward's statistics (the linears' input amax, the MoE blocks' routing)."""
    inputs_BxL = constrain("tokens", batch["inputs"])
    documents = batch_documents(batch, constrain)
    logits_BxLxV, stats = forward_with_stats(
        graphdef, params, inputs_BxL, key, documents, constrain
    )
    logits_BxLxV = constrain("logits", logits_BxLxV)
    losses_BxL = optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, batch["targets"])
    return losses_BxL, logits_BxLxV, stats


def _loss_sum(
    graphdef, params, batch: Batch, key, constrain=_no_constraint
) -> tuple[jax.Array, int, ForwardStats]:
    """float32 sum of token cross-entropies, the number of tokens, and the forward's
    statistics (the linears' input amax, the MoE blocks' routing)."""
    losses_BxL, _, stats = _token_losses(graphdef, params, batch, key, constrain)
    return losses_BxL.sum(), losses_BxL.size, stats


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
    """Mean loss, the gradients of `(mean loss + MoE auxiliary losses) * loss_scale` summed over
    microbatches, the linears' input amax max-reduced over microbatches (starting from the tree
    `amax0`), and the MoE statistics (params' layout) and metrics averaged over microbatches."""

    def scaled_loss(p, micro: Batch, micro_key):
        loss_sum, count, stats = _loss_sum(graphdef, p, micro, micro_key, constrain)
        loss = loss_sum / count
        objective = loss + auxiliary_objective(moe_cfg, stats.moe_per_layer)
        moe = (stats.moe, load_metrics(stats.moe_per_layer))
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
    if moe_cfg.num_experts:  # the MoE statistics' tree, traced once more (shapes only)
        first = jax.tree.map(lambda x: x[0], micro_batches)
        shapes = jax.eval_shape(lambda: scaled_loss(params, first, key)[1][2])
        moe0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params), amax0, moe0)
    xs = (jnp.arange(accum), micro_batches)
    (loss, grads, amax, moe), _ = jax.lax.scan(body, zeros, xs)
    return loss, grads, amax, moe


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
    averaged over the microbatches).
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
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        skipped = last_step_skipped(opt_state)
        if moe.bias_update_rate:  # not moved by a skipped step (a rate of 0 adds +-0)
            rate = jnp.where(skipped, 0.0, moe.bias_update_rate)
            params = update_router_bias(params, moe_stats, rate)
        amax = _updated_amax(state.activation_amax, step_amax, skipped)
        metrics = moe_metrics | {
            "loss": loss,
            "grad_norm": global_norm(grads) / loss_scale,
            "lr": lr_schedule(state.step),
            "skipped": skipped.astype(jnp.int32),
            "skipped_total": skipped_steps(opt_state),
            "loss_scale": loss_scale,
        }
        return TrainState(state.step + 1, params, opt_state, amax), metrics

    return train_step


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
            loss_sum, count, _ = _loss_sum(graphdef, params, batch, jax.random.key(seed), constrain)
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
            losses_BxL, logits_BxLxV, _ = _token_losses(
                graphdef, params, batch, jax.random.key(seed), constrain
            )
        greedy_BxL = jnp.argmax(logits_BxLxV, axis=-1) == targets_BxL
        return -losses_BxL, greedy_BxL

    return score_step


def count_params(params) -> int:
    """Total number of parameter elements in a params pytree."""
    return int(sum(leaf.size for leaf in jax.tree.leaves(params)))


def with_vocab_size(cfg, vocab_size: int):
    """The run config with `model.vocab_size` filled from the data's `vocab_size`.

    The one place that fills it (`run` and `evaluate_run` come here): `model.vocab_size=0` takes the data's size; an explicit size must be >= the data's (a
    larger one pads the embedding, e.g. to a multiple of 128) and is kept.

    Raises:
        ConfigError: an explicit `model.vocab_size` smaller than the data's vocabulary.
        ValueError: `vocab_size` is not > 0.

    Example:
        >>> from nvfp4_train.config.run_config import config_from_dict
        >>> with_vocab_size(config_from_dict({}), 300).model.vocab_size
        300
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size (the data's) must be > 0, got {vocab_size}")
    model = cfg.model
    if model.vocab_size == 0:
        return dataclasses.replace(cfg, model=dataclasses.replace(model, vocab_size=vocab_size))
    if model.vocab_size < vocab_size:
        raise ConfigError(
            f"model.vocab_size must be 0 (take from data) or >= the data's vocabulary "
            f"size {vocab_size}, got {model.vocab_size}"
        )
    return cfg
