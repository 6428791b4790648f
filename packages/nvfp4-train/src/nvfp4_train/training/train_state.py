"""The train state and the model a run builds: `TrainState`, `ModelSpec` and the step-0 state.

Each builder takes what it reads, not the whole run config: the model (`ModelSpec`, made from a
run config by `model_spec`) and the optimizer (`optim.make_optimizer`). `nvfp4_train.training.step`
re-exports these names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import nvfp4_ops
from nvfp4_train.errors import ConfigError
from nvfp4_train.mesh.sharding import kernel_axes
from nvfp4_train.model.blocks.linear import QuantLinear
from nvfp4_train.model.config import ModelConfig, input_amax_shape, linear_paths
from nvfp4_train.model.decoder import Llama
from nvfp4_train.model.stacking import LayerLayout
from nvfp4_train.precision.policy import backend_spec, layer_recipes, run_layout
from nvfp4_train.tree_paths import flat_paths


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
