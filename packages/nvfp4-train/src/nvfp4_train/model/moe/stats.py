"""What the MoE blocks of one forward report, and what a train step does with it: the
auxiliary losses it adds to the objective, the per-layer load metrics, and the update of the
auxiliary-loss-free router bias.

A forward's sown intermediates (`nnx.capture`) hold each quantized linear's input amax
(`layers.INPUT_AMAX`) and, on each MoE block's `mlp`, the statistics `moe.MOE_STATS`;
`split_sown` separates the two trees. Both keep the model's layout (stacked blocks carry a
leading layer axis) until `LayerLayout.to_canonical` splits them.

Example:
    >>> sown = {"layers": {"0": {"mlp": {"expert_tokens": jnp.array([3.0, 1.0]),
    ...                                  "aux_loss": jnp.array(1.0)}}}}
    >>> split_sown(sown)[1]["layers"]["0"]["mlp"]["aux_loss"].item()
    1.0
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from nvfp4_train.model.blocks.linear import INPUT_AMAX
from nvfp4_train.model.moe.config import MoEConfig
from nvfp4_train.model.moe.layer import MOE_STATS, ROUTER_BIAS
from nvfp4_train.tree_paths import flat_paths


def split_sown(sown: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(input-amax tree: each linear's `INPUT_AMAX` value at the linear's path, MoE tree: each
    MoE block's `{stat: value}` at its `mlp` path) of a pure dict of sown intermediates."""

    def split(node: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        if INPUT_AMAX in node:
            return node[INPUT_AMAX], {}
        amax, moe = {}, {k: v for k, v in node.items() if k in MOE_STATS}
        for name, child in node.items():
            if isinstance(child, dict):
                child_amax, child_moe = split(child)
                if child_amax is not None:
                    amax[name] = child_amax
                if child_moe:
                    moe[name] = child_moe
        return amax or None, moe

    amax, moe = split(sown)
    return amax or {}, moe


def moe_layer_stats(moe_canonical: dict[str, Any]) -> dict[str, dict[str, jax.Array]]:
    """{`layers.{i}`: {stat: value}} of every MoE block (per-layer tree)."""
    layers: dict[str, dict[str, jax.Array]] = {}
    for path, value in flat_paths(moe_canonical).items():
        block, stat = path.rsplit(".mlp.", 1)
        layers.setdefault(block, {})[stat] = value
    return layers


def auxiliary_objective(moe: MoEConfig, moe_canonical: dict[str, Any]) -> jax.Array:
    """`aux_loss_coef * mean aux_loss + z_loss_coef * mean z_loss` over the MoE blocks (float32
    0 without MoE blocks or coefficients)."""
    layers = moe_layer_stats(moe_canonical)
    total = jnp.zeros((), jnp.float32)
    for coef, stat in ((moe.aux_loss_coef, "aux_loss"), (moe.z_loss_coef, "z_loss")):
        if coef and layers:
            total = total + coef * sum(s[stat] for s in layers.values()) / len(layers)
    return total


def load_metrics(moe_canonical: dict[str, Any]) -> dict[str, Any]:
    """The step metrics of the MoE blocks: per layer `load` (each expert's share of the
    assignments, float32 [E]), `max_load` (max over mean of the experts' assignments),
    `dropped` (the fraction of assignments dropped by the capacity), `entropy`, `aux_loss`,
    `z_loss`; and over the blocks the mean `aux_loss`, `z_loss` and the largest `max_load`.
    Empty without MoE blocks."""
    layers = moe_layer_stats(moe_canonical)
    if not layers:
        return {}
    per_layer = {}
    for block, s in layers.items():
        tokens = s["expert_tokens"]
        total = jnp.maximum(tokens.sum(), 1.0)
        per_layer[block] = {
            "load": tokens / total,
            "max_load": jnp.max(tokens) / jnp.maximum(jnp.mean(tokens), 1e-30),
            "dropped": s["dropped_tokens"] / total,
            "entropy": s["router_entropy"],
            "aux_loss": s["aux_loss"],
            "z_loss": s["z_loss"],
        }
    n = len(per_layer)
    return {
        "moe": per_layer,
        "aux_loss": sum(m["aux_loss"] for m in per_layer.values()) / n,
        "z_loss": sum(m["z_loss"] for m in per_layer.values()) / n,
        "max_load": jnp.max(jnp.stack([m["max_load"] for m in per_layer.values()])),
    }


def update_router_bias(params: dict[str, Any], moe_stats: dict[str, Any], rate: Any) -> Any:
    """`params` with every router's `score_bias` moved by `rate` (a float or a float32 scalar)
    towards balance: `+rate` for an expert that took fewer assignments than the mean in
    `moe_stats` (the step's `expert_tokens`, in the params' layout), `-rate` for one that took
    more (DeepSeek-V3)."""

    def update(node: Any, stats: Any) -> Any:
        if not isinstance(node, dict) or not isinstance(stats, dict):
            return node
        if "router" in node and "expert_tokens" in stats:
            tokens = stats["expert_tokens"]
            error = jnp.mean(tokens, axis=-1, keepdims=True) - tokens
            bias = node["router"][ROUTER_BIAS] + rate * jnp.sign(error)
            node = {**node, "router": {**node["router"], ROUTER_BIAS: bias}}
        return {k: update(v, stats.get(k)) if k in stats else v for k, v in node.items()}

    return update(params, moe_stats)
