"""Per-linear quantization telemetry: each linear's GEMM operands, and their NVFP4 statistics.

`capture_linear_operands` runs the model once in the capture mode of `QuantLinear` (on a merged
copy, inside the traced function) and returns, per linear, the three tensors its GEMMs quantize:
the input x, the kernel w and the incoming gradient dy. The train step is not touched: its graph is
the same whether or not a probe exists.

Example:
    >>> operands = capture_linear_operands(graphdef, state.params, batch)  # doctest: +SKIP
    >>> x, w, dy = operands["layers.0.mlp.down"]  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from nvfp4_train.layers import OPERAND_W, OPERAND_X, OUTPUT_GRAD, LinearOperand, QuantLinear
from nvfp4_train.model import LINEAR_NAMES

Batch = dict[str, jax.Array]
Operands = tuple[jax.Array, jax.Array, jax.Array]


def _no_constraint(kind: str, x: jax.Array) -> jax.Array:
    del kind
    return x


def _flat(tree: dict[str, Any], name: str) -> dict[str, jax.Array]:
    """{"layers": {"0": {"attn": {"qkv": {name: v}}}}} -> {"layers.0.attn.qkv": v}."""
    flat: dict[str, jax.Array] = {}

    def walk(node: dict[str, Any], path: tuple[str, ...]) -> None:
        for key, child in node.items():
            if key == name and not isinstance(child, dict):
                flat[".".join(path)] = child
            elif isinstance(child, dict):
                walk(child, (*path, str(key)))

    walk(tree, ())
    return flat


def _capturing_model(graphdef: nnx.GraphDef, params) -> nnx.Module:
    """A fresh merged model whose `QuantLinear`s are in capture mode (the graphdef is unchanged)."""
    model = nnx.merge(graphdef, params)
    for _, module in nnx.iter_modules(model):
        if isinstance(module, QuantLinear):
            module.capture_operands = True
    return model


def capture_linear_operands(
    graphdef: nnx.GraphDef,
    params,
    batch: Batch,
    key: jax.Array | None = None,
    *,
    constrain: Callable[[str, jax.Array], jax.Array] = _no_constraint,
) -> dict[str, Operands]:
    """Each linear's GEMM operands on `batch`: {module path: (x, w, dy)}.

    Args:
        graphdef: The model's graphdef (from `init_state`).
        params: Its parameters (pure dict, as `TrainState.params`).
        batch: {"inputs": int [B, L], "targets": int [B, L]}.
        key: The stochastic-rounding key the model call gets (as `Llama.__call__`'s `key`); it
            changes dy only through the rounding of the gradients flowing into it.
        constrain: `step.activation_constraint(mesh)` to shard tokens and logits as the train step.

    Returns:
        {path: (x, w, dy)} for every path of `model.linear_paths`, e.g. `layers.3.mlp.down`:
        x [B, L, in] the input as the GEMM receives it (compute dtype), w [in, out] the kernel in
        the compute dtype, dy [B, L, out] (compute dtype) the gradient of the mean token
        cross-entropy of `batch` (unscaled: no loss scale, no microbatch division) w.r.t. the
        linear's output. Unjitted the paths come in model order; a jitted call returns the
        dict key-sorted (as JAX returns every dict), so iterate over `linear_paths` for order.
    """
    missing = sorted({"inputs", "targets"} - set(batch))
    if missing:
        raise ValueError(
            f"batch must hold 'inputs' and 'targets', got keys {sorted(batch)}; missing {missing}"
        )

    def loss(perturbations):
        model = _capturing_model(graphdef, params)
        forward = nnx.capture(model, LinearOperand, nnx.Perturbation, init=perturbations)
        logits_BxLxV, operands, _ = forward(constrain("tokens", batch["inputs"]), key=key)
        logits_BxLxV = constrain("logits", logits_BxLxV)
        losses_BxL = optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, batch["targets"])
        return losses_BxL.mean(), operands

    def zero_perturbations():
        model = _capturing_model(graphdef, params)
        forward = nnx.capture(model, nnx.Perturbation)
        return forward(batch["inputs"], key=key)[1]

    shapes = jax.eval_shape(zero_perturbations)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    grads, operands = jax.grad(loss, has_aux=True)(zeros)
    operands, grads = nnx.to_pure_dict(operands), nnx.to_pure_dict(grads)
    xs, ws, dys = _flat(operands, OPERAND_X), _flat(operands, OPERAND_W), _flat(grads, OUTPUT_GRAD)
    return {path: (xs[path], ws[path], dys[path]) for path in sorted(xs, key=_model_order)}


def _model_order(path: str) -> tuple[int, int]:
    """Sort key of `layers.{i}.{name}`: layer index, then the name's place in `LINEAR_NAMES`."""
    _, index, name = path.split(".", 2)
    return int(index), LINEAR_NAMES.index(name)
