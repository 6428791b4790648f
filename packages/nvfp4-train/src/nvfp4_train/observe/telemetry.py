"""Per-linear quantization telemetry: each linear's GEMM operands, and their NVFP4 statistics.

`capture_linear_operands` runs the model once in the capture mode of `QuantLinear` and
`GroupedLinear` (on a merged copy, inside the traced function) and returns, per linear, the
tensors its GEMMs quantize: the input x, the kernel w and the incoming gradient dy (and, for the
routed experts' grouped linears, the group sizes). `make_quant_probe` turns them into
`nvfp4_ops.gemm_operand_stats` per quantized linear and GEMM operand role, and
`nvfp4_ops.ragged_operand_stats` per expert (`expert_stats`). The train step is not touched: its
graph is the same whether or not a probe exists, and a probe changes no state.

Example:
    >>> probe = jax.jit(make_quant_probe(graphdef, cfg.model))  # doctest: +SKIP
    >>> stats = probe(state.params, batch, step_key(cfg.train.seed, state.step))  # doctest: +SKIP
    >>> stats["layers.1.mlp.down"]["wgrad_dy"]["rel_error"]  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import nvfp4_ops
from nvfp4_train.mesh.sharding import activation_constraint
from nvfp4_train.model.blocks.linear import (
    OPERAND_W,
    OPERAND_X,
    OUTPUT_GRAD,
    LinearOperand,
    QuantLinear,
)
from nvfp4_train.model.blocks.mamba import SSM_STATS
from nvfp4_train.model.config import ModelConfig
from nvfp4_train.model.decoder import linear_keys, unstacked
from nvfp4_train.model.moe.layer import OPERAND_GROUP_SIZES, GroupedLinear
from nvfp4_train.model.mtp.loss import mtp_loss
from nvfp4_train.model.structure import linear_order
from nvfp4_train.observe.health import ROLE_FAMILIES
from nvfp4_train.observe.quant_rows import EXPERT_TOKENS, expert_path
from nvfp4_train.tree_paths import flat_paths

Batch = dict[str, jax.Array]
Operands = tuple[jax.Array, ...]
"""(x, w, dy) of a linear; (x, w, dy, group_sizes) of a routed experts' grouped linear."""
QuantStats = dict[str, dict[str, dict[str, jax.Array]]]
"""{linear path: {role: {stat: float32 scalar}}}, roles and stats as `nvfp4_ops.gemm_operand_stats`;
an expert's path is `expert_path(path, e)` (see `expert_stats`)."""
SsmStats = dict[str, dict[str, jax.Array]]
"""{`layers.{i}`: {stat: float32 scalar}}: each Mamba block's `mamba.SSM_STATS`."""
_CAPTURING = (QuantLinear, GroupedLinear)


def _flat(tree: dict[str, Any], name: str) -> dict[str, jax.Array]:
    """The leaves named `name`, keyed by their parent's dotted path (`tree_paths.flat_paths`):
    {"layers": {"0": {"attn": {"qkv": {name: v}}}}} -> {"layers.0.attn.qkv": v}."""
    suffix = f".{name}"
    flat = flat_paths(tree)
    return {path.removesuffix(suffix): leaf for path, leaf in flat.items() if path.endswith(suffix)}


def _capturing_model(graphdef: nnx.GraphDef, params) -> nnx.Module:
    """A fresh merged model, one Block per layer (`model.unstacked`: the capture mode runs
    unscanned and without remat), whose `QuantLinear`s and `GroupedLinear`s are in capture mode
    (the graphdef is unchanged)."""
    model = unstacked(nnx.merge(graphdef, params))
    for _, module in nnx.iter_modules(model):
        if isinstance(module, _CAPTURING):
            module.capture_operands = True
    return model


def capture_linear_operands(
    graphdef: nnx.GraphDef,
    params,
    batch: Batch,
    key: jax.Array | None = None,
    *,
    constrain: Callable[[str, jax.Array], jax.Array] | None = None,
) -> dict[str, Operands]:
    """Each linear's GEMM operands on `batch`: {module path: (x, w, dy)}.

    Args:
        graphdef: The model's graphdef (from `init_state`).
        params: Its parameters (pure dict, as `TrainState.params`).
        batch: {"inputs": int [B, L], "targets": int [B, L]}.
        key: The stochastic-rounding key the model call gets (as `Llama.__call__`'s `key`); it
            changes dy only through the rounding of the gradients flowing into it.
        constrain: `sharding.activation_constraint(mesh)` to shard tokens and logits as the train
            step (None: no constraint).

    Returns:
        {path: (x, w, dy)} for every path of `model.linear_paths`, e.g. `layers.3.mlp.down`:
        x [B, L, in] the input as the GEMM receives it (compute dtype), w [in, out] the kernel in
        the compute dtype, dy [B, L, out] (compute dtype) the gradient of the mean token
        cross-entropy of `batch` (unscaled: no loss scale, no microbatch division) w.r.t. the
        linear's output. The routed experts' grouped linears (`layers.{i}.mlp.experts.*`) give
        (x, w, dy, group_sizes): x [A, in] their rows sorted by expert (A = B L k assignments;
        rows past sum(group_sizes) are dropped ones, not computed), w [E, in, out], dy [A, out],
        group_sizes int32 [E]. Unjitted the paths come in model order; a jitted call returns the
        dict key-sorted (as JAX returns every dict), so iterate over `linear_paths` for order.
    """
    return _capture(graphdef, params, batch, key, constrain)[0]


def _capture(
    graphdef: nnx.GraphDef, params, batch: Batch, key: jax.Array | None, constrain
) -> tuple[dict[str, Operands], SsmStats]:
    """(`capture_linear_operands`, `SsmStats` of the same forward)."""
    missing = sorted({"inputs", "targets"} - set(batch))
    if missing:
        raise ValueError(
            f"batch must hold 'inputs' and 'targets', got keys {sorted(batch)}; missing {missing}"
        )
    constrain = activation_constraint(None) if constrain is None else constrain
    operands, grads, sown = _operands_and_gradients(graphdef, params, batch, key, constrain)
    xs, ws, dys = _flat(operands, OPERAND_X), _flat(operands, OPERAND_W), _flat(grads, OUTPUT_GRAD)
    groups = _flat(operands, OPERAND_GROUP_SIZES)
    captured = {
        path: (xs[path], ws[path], dys[path], *([groups[path]] if path in groups else []))
        for path in sorted(xs, key=linear_order)
    }
    return captured, ssm_layer_stats(sown)


def _operands_and_gradients(
    graphdef: nnx.GraphDef,
    params,
    batch: Batch,
    key: jax.Array | None,
    constrain: Callable[[str, jax.Array], jax.Array],
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(the captured operands, the gradients of the mean token cross-entropy (plus the MTP loss of
    a model with MTP layers) w.r.t. the zero perturbations at the linears' outputs, the sown
    intermediates), as pure dicts in the model's module tree."""
    documents = {
        "segment_ids_BxL": batch.get("segment_ids"),
        "positions_BxL": batch.get("positions"),
    }

    def loss(perturbations):
        model = _capturing_model(graphdef, params)
        forward = nnx.capture(
            model, LinearOperand, nnx.Perturbation, nnx.Intermediate, init=perturbations
        )
        inputs_BxL = constrain("tokens", batch["inputs"])
        output, operands, _, sown = forward(
            inputs_BxL, key=key, constrain=constrain, mtp=True, **documents
        )
        logits_BxLxV, depths = output if isinstance(output, tuple) else (output, ())
        logits_BxLxV = constrain("logits", logits_BxLxV)
        losses_BxL = optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, batch["targets"])
        objective = losses_BxL.mean()
        if depths:  # the MTP layers' dy: the gradient of the train step's objective
            factor = model.cfg.mtp.loss_scaling_factor
            objective += mtp_loss(depths, batch["targets"], documents["segment_ids_BxL"],
                                  factor).objective  # fmt: skip
        return objective, (operands, sown)

    def zero_perturbations():
        model = _capturing_model(graphdef, params)
        forward = nnx.capture(model, nnx.Perturbation)
        return forward(batch["inputs"], key=key, mtp=True, **documents)[1]

    shapes = jax.eval_shape(zero_perturbations)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    grads, (operands, sown) = jax.grad(loss, has_aux=True)(zeros)
    return nnx.to_pure_dict(operands), nnx.to_pure_dict(grads), nnx.to_pure_dict(sown)


def ssm_layer_stats(sown: dict[str, Any]) -> SsmStats:
    """{`layers.{i}`: {stat: value}} of every Mamba block's `SSM_STATS` in a per-layer pure dict
    of sown intermediates (`{"layers": {"0": {"mamba": {"dt_min": v, ...}}}}`).

    Example:
        >>> sown = {"layers": {"2": {"mamba": {"dt_max": 0.5, "in_proj": {"amax": 1.0}}}}}
        >>> ssm_layer_stats(sown)
        {'layers.2': {'dt_max': 0.5}}
    """
    layers: SsmStats = {}
    for stat in SSM_STATS:
        for path, value in _flat(sown, stat).items():
            if path.endswith(".mamba"):
                layers.setdefault(path.removesuffix(".mamba"), {})[stat] = value
    return dict(sorted(layers.items(), key=lambda kv: int(kv[0].split(".")[1])))


def linear_recipes(graphdef: nnx.GraphDef, params) -> dict[str, nvfp4_ops.Recipe]:
    """{path: recipe} of the model's quantized linears (recipe not "bf16"), the routed experts'
    grouped linears included, in model order."""
    model = unstacked(nnx.merge(graphdef, params))
    recipes = {
        ".".join(str(p) for p in path): module.recipe
        for path, module in nnx.iter_modules(model)
        if isinstance(module, _CAPTURING) and module.recipe.quantized
    }
    return {path: recipes[path] for path in sorted(recipes, key=linear_order)}


def _first_microbatch(batch: Batch, accum: int) -> Batch:
    """Rows [0, B / accum) of every array: the train step's microbatch 0."""
    rows = batch["inputs"].shape[0]
    if rows % accum:
        raise ValueError(
            f"batch size must be a multiple of train.grad_accum_steps={accum}, got {rows}"
        )
    return {name: x[: rows // accum] for name, x in batch.items()}


def make_quant_probe(
    graphdef: nnx.GraphDef, model: ModelConfig, *, grad_accum_steps: int = 1, mesh=None
) -> Callable[[Any, Batch, jax.Array], QuantStats]:
    """Returns the pure `probe(params, batch, key) -> {path: {role: {stat: scalar}}}`; jit it.

    The probe sees exactly what the train step's first microbatch quantizes: the same graphdef
    (so the same recipes, `bf16_forward` included), rows [0, batch_size / grad_accum_steps) of
    `batch`, and the key `fold_in(key, 0)` split per linear as `Llama.__call__` splits it, so the
    stochastic-rounding draws are the train step's. dy is the gradient of that microbatch's mean
    loss (no loss scale, no 1/grad_accum_steps): amax of the dy roles differs from the train
    step's by that factor; the other statistics are scale-free. Linears whose recipe is "bf16"
    are left out. A routed experts' grouped linear gives one entry per expert (`expert_stats`).

    Args:
        graphdef: The graphdef the train step runs.
        model: The `model` section it was built from (for the per-linear keys).
        grad_accum_steps: The train step's microbatches per step (`train.grad_accum_steps`).
        mesh: The train step's mesh, to shard tokens and logits the same way (None: no mesh).

    Returns:
        `probe(params, batch, key)`, with `key` the train step's `step.step_key(seed, step)`
        (step = completed steps, i.e. `state.step` of the state whose `params` are passed).
    """
    telemetry = make_telemetry_probe(graphdef, model, grad_accum_steps=grad_accum_steps, mesh=mesh)
    return lambda params, batch, key: telemetry(params, batch, key)["quant"]


def make_telemetry_probe(
    graphdef: nnx.GraphDef, model: ModelConfig, *, grad_accum_steps: int = 1, mesh=None
) -> Callable[[Any, Batch, jax.Array], dict[str, Any]]:
    """`make_quant_probe`'s probe returning `{"quant": QuantStats, "ssm": SsmStats}`: with the
    quantization statistics, each Mamba block's SSM health (`mamba.SSM_STATS`, per layer also
    when the run stacks its blocks: the probe runs them unstacked) from the same forward. The
    train step's program does not change: the statistics are only read here."""
    accum, constrain = grad_accum_steps, activation_constraint(mesh)

    def probe(params, batch: Batch, key: jax.Array) -> dict[str, Any]:
        micro_key = jax.random.fold_in(key, 0)
        operands, ssm = _capture(
            graphdef, params, _first_microbatch(batch, accum), micro_key, constrain
        )
        keys = linear_keys(model, micro_key)
        stats: QuantStats = {}
        for path, recipe in linear_recipes(graphdef, params).items():
            x, w, dy, *groups = operands[path]
            if not groups:
                stats[path] = nvfp4_ops.gemm_operand_stats(x, w, dy, recipe, keys[path])
                continue
            per_expert = nvfp4_ops.ragged_operand_stats(x, w, dy, groups[0], recipe, keys[path])
            stats.update(expert_stats(path, per_expert, groups[0]))
        return {"quant": stats, "ssm": ssm}

    return probe


def expert_stats(
    path: str, stats: dict[str, dict[str, jax.Array]], group_sizes_E: jax.Array
) -> QuantStats:
    """One row per expert of a grouped linear's statistics (`nvfp4_ops.ragged_operand_stats`,
    {role: {stat: [E]}}): {`expert_path(path, e)`: {role: {stat: scalar}}}, every role of an x
    or dy operand also carrying `EXPERT_TOKENS`, the expert's rows (its assignments in the
    probed microbatch). `metrics.quant_row` leaves out those roles of an expert without rows.

    Example:
        >>> stats = {"fprop_x": {"amax": jnp.array([1.0, 0.0])},
        ...          "fprop_w": {"amax": jnp.array([0.5, 0.25])}}
        >>> rows = expert_stats("layers.1.mlp.experts.down", stats, jnp.array([3, 0]))
        >>> sorted(rows), int(rows["layers.1.mlp.experts.down[1]"]["fprop_x"]["tokens"])
        (['layers.1.mlp.experts.down[0]', 'layers.1.mlp.experts.down[1]'], 0)
    """
    out: QuantStats = {}
    for e in range(group_sizes_E.shape[0]):
        out[expert_path(path, e)] = {
            role: {stat: v[e] for stat, v in values.items()}
            | ({} if ROLE_FAMILIES[role] == "weight" else {EXPERT_TOKENS: group_sizes_E[e]})
            for role, values in stats.items()
        }
    return out
