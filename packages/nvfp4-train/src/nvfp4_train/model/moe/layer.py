"""The Mixture-of-Experts MLP of an MoE block: router, routed experts, shared experts, and
LatentMoE's projections.

Parameters of an MoE block's `mlp` (float32 masters; `E = moe.num_experts`, `F =
moe.expert_mlp_dim`, `S = moe.shared_mlp_dim`, `W` the experts' width: d_model, or
`moe.latent_dim` with LatentMoE; with `expert_activation: relu2` the first linears are `up`
[.., W, F] / [d_model, S] instead of `gate_up` [.., W, 2F] / [d_model, 2S]):
    router.kernel           [d_model, E]        never quantized (float32 logits and scores)
    router.score_bias       [E]                 auxiliary-loss-free balancing bias (Nemotron 3's
                                                 `e_score_correction_bias`); not trained by the
                                                 optimizer (zero gradient, no decay)
    experts.gate_up.kernel  [E, W, 2F]          per expert: gate | up, as a dense `mlp.gate_up`
    experts.down.kernel     [E, F, W]
    shared.gate_up.kernel   [d_model, 2S]       (shared_experts > 0)
    shared.down.kernel      [S, d_model]
    shared_gate.kernel      [d_model, 1]        (shared_expert_gate; never quantized)
    fc1_latent_proj.kernel  [d_model, W]        (latent_dim > 0) before the routed experts
    fc2_latent_proj.kernel  [W, d_model]        (latent_dim > 0) after their combine

The routed experts run as two grouped GEMMs (`nvfp4_ops.ragged_dot`: the recipe's three GEMMs
per expert, with per-expert tensor scales; `model.moe.experts`), dispatched and combined by
`model.dispatch`; the shared experts are a `layers.MLP` (or `Relu2MLP`). As transformers'
`NemotronHMoE`, the router and the shared experts read the block's input x, the routed experts
`fc1_latent_proj(x)`. Every quantized linear follows the precision policy like a dense one (paths
`layers.{i}.mlp.experts.gate_up`, `...experts.down`, `...shared.gate_up`, `...shared.down`,
`...fc1_latent_proj`, `...fc2_latent_proj`). Traced under a mesh whose `expert` axis splits the
experts, the routed experts run expert-parallel (`model.expert_parallel`) with the numerics of
one device.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

import nvfp4_ops
from nvfp4_train.model.blocks.linear import QuantLinear, sow_input_amax
from nvfp4_train.model.blocks.mlp import MLP, Relu2MLP
from nvfp4_train.model.moe.config import expert_capacity
from nvfp4_train.model.moe.dispatch import combine, dispatch, gather_rows
from nvfp4_train.model.moe.expert_parallel import expert_mesh, sharded_routed_experts
from nvfp4_train.model.moe.experts import (  # re-exported: the grouped linear's home was here
    OPERAND_GROUP_SIZES as OPERAND_GROUP_SIZES,
)
from nvfp4_train.model.moe.experts import (
    Experts,
    shard_experts,
)
from nvfp4_train.model.moe.experts import (
    GroupedLinear as GroupedLinear,
)
from nvfp4_train.model.moe.experts import (
    group_amax as group_amax,
)
from nvfp4_train.model.moe.routing import (
    Routing,
    expert_counts,
    load_balancing_loss,
    route,
    router_entropy,
    z_loss,
)

MOE_STATS = ("expert_tokens", "dropped_tokens", "aux_loss", "z_loss", "router_entropy")
"""The `nnx.Intermediate`s an `MoEMLP` call sows on itself: float32 [E] assignments per expert
(before the capacity), and float32 scalars: assignments dropped by the capacity, the
load-balancing loss, the router z-loss and the mean router entropy of the call."""


ROUTER_BIAS = "score_bias"
"""The name of the router's auxiliary-loss-free balancing bias: a parameter (saved, restored and
sharded like one) that the forward reads through `stop_gradient` and the train step moves
(`training.step`), never the optimizer."""


class Router(nnx.Module):
    """Float32 router logits `x @ kernel` and top-k routing (`model.routing.route`: softmax or
    sigmoid scores, grouped top-k, the balancing bias for the choice only)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        moe, init = cfg.moe, jax.nn.initializers.normal(stddev=cfg.init_std)
        self.kernel = nnx.Param(init(rngs.params(), (cfg.d_model, moe.num_experts), jnp.float32))
        setattr(self, ROUTER_BIAS, nnx.Param(jnp.zeros((moe.num_experts,), jnp.float32)))
        self.moe = moe

    def __call__(self, x_TxD: jax.Array) -> Routing:
        moe = self.moe
        logits = jnp.dot(x_TxD.astype(jnp.float32), self.kernel[...],
                         precision=jax.lax.Precision.HIGHEST)  # fmt: skip
        bias = jax.lax.stop_gradient(getattr(self, ROUTER_BIAS)[...])
        biased = moe.bias_update_rate or moe.router == "sigmoid"
        return route(logits, k=moe.experts_per_token, norm_topk_prob=moe.norm_topk_prob,
                     score_bias_E=bias if biased else None, router=moe.router,
                     n_group=moe.n_group, topk_group=moe.topk_group,
                     routed_scaling_factor=moe.routed_scaling_factor)  # fmt: skip


def key_slots(moe) -> dict[str, tuple[int, int]]:
    """Where an `MoEMLP`'s keys are for each of its pairs of quantized linears ("routed",
    "shared", "latent": fc1, fc2), in `structure.MOE_LINEAR_NAMES` order without the absent
    ones."""
    slots, nxt = {"routed": (0, 1)}, 2
    for name, present in (("shared", moe.shared_experts), ("latent", moe.latent_dim)):
        if present:
            slots[name], nxt = (nxt, nxt + 1), nxt + 2
    return slots


class MoEMLP(nnx.Module):
    """Router + routed experts (+ shared experts, + latent projections) of one MoE block (see the
    module docstring).

    Called on [B, L, d_model] (all B * L tokens routed together) with the keys of its quantized
    linears (`key_slots`: experts' first linear and down, shared ones, fc1 and fc2 latent).
    """

    def __init__(self, cfg, recipes: dict[str, nvfp4_ops.Recipe], prefix: str, *,
                 rngs: nnx.Rngs, backend: str | tuple[str, ...] = "auto"):  # fmt: skip
        moe = self.moe = cfg.moe
        self.dtype = cfg.compute_dtype
        self.router = Router(cfg, rngs=rngs)
        self.experts = Experts(cfg, recipes, f"{prefix}.experts", rngs=rngs, backend=backend,
                               width=moe.latent_dim)  # fmt: skip
        if moe.shared_experts:
            shared = Relu2MLP if moe.expert_activation == "relu2" else MLP
            self.shared = shared(cfg, recipes, f"{prefix}.shared", rngs=rngs, backend=backend,
                                 hidden=moe.shared_mlp_dim)  # fmt: skip
        if moe.shared_expert_gate:
            self.shared_gate = nnx.Linear(
                cfg.d_model, 1, use_bias=False, dtype=jnp.float32,
                kernel_init=jax.nn.initializers.normal(stddev=cfg.init_std),
                precision=jax.lax.Precision.HIGHEST, rngs=rngs,
            )  # fmt: skip
        if moe.latent_dim:
            out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
            for name, (n_in, n_out), std in (
                ("fc1_latent_proj", (cfg.d_model, moe.latent_dim), cfg.init_std),
                ("fc2_latent_proj", (moe.latent_dim, cfg.d_model), out_std),
            ):
                setattr(self, name, QuantLinear(n_in, n_out, recipe=recipes[f"{prefix}.{name}"],
                                                init_std=std, dtype=self.dtype, rngs=rngs,
                                                backend=backend))  # fmt: skip

    def __call__(self, x_BxLxD: jax.Array, keys: tuple[jax.Array | None, ...]) -> jax.Array:
        moe, slots = self.moe, key_slots(self.moe)
        b, l, d = x_BxLxD.shape
        x_TxD = x_BxLxD.reshape(b * l, d)
        routing = self.router(x_TxD)
        capacity = expert_capacity(moe, b * l)
        routed_in = x_TxD
        if moe.latent_dim:
            routed_in = self.fc1_latent_proj(x_TxD, keys[slots["latent"][0]])
        routed_keys = tuple(keys[i] for i in slots["routed"])
        out_TxD = self._routed(routed_in, routing, capacity, routed_keys)
        if moe.latent_dim:
            out_TxD = self.fc2_latent_proj(out_TxD, keys[slots["latent"][1]])
        if moe.shared_experts:
            shared = self.shared(x_TxD, tuple(keys[i] for i in slots["shared"]))
            if moe.shared_expert_gate:
                gate_logit = self.shared_gate(x_TxD.astype(jnp.float32))
                shared = (jax.nn.sigmoid(gate_logit) * shared.astype(jnp.float32)).astype(
                    self.dtype
                )
            out_TxD = out_TxD + shared
        self._sow_stats(routing, capacity)
        return out_TxD.reshape(b, l, d)

    def _routed(self, x_TxW: jax.Array, routing: Routing, capacity: int, keys) -> jax.Array:
        """[T, W] in the compute dtype: each token's routed experts' outputs, weighted and
        summed; expert-parallel on a context mesh with an `expert` axis, else on all experts."""
        x_TxW, mesh = x_TxW.astype(self.dtype), expert_mesh()
        if mesh is not None:
            linears = self.experts.linears
            kernels = ((linears[0].kernel[...], 1), (linears[1].kernel[...], 2))  # width dims
            done = sharded_routed_experts(mesh, x_TxW, routing, kernels, keys,
                                          shard_experts(self.experts), capacity=capacity,
                                          dtype=self.dtype, exchange=self.moe.dispatch)  # fmt: skip
            if done is not None:
                out_TxW, amax = done
                for linear, value in zip(linears, amax, strict=True):
                    sow_input_amax(linear, value)
                return out_TxW.astype(self.dtype)
        d_ = dispatch(routing.experts_TxK, num_experts=self.moe.num_experts, capacity=capacity)
        x_AxW = gather_rows(x_TxW, d_, self.moe.experts_per_token)
        y_AxW = self.experts(x_AxW, d_.group_sizes, keys)
        return combine(y_AxW, routing.weights_TxK, d_, self.dtype)

    def _sow_stats(self, routing, capacity: int) -> None:
        counts_E = expert_counts(routing.experts_TxK, self.moe.num_experts)
        kept = jnp.minimum(counts_E, float(capacity)).sum()  # the dispatch's group sizes
        stats = {
            "expert_tokens": counts_E,
            "dropped_tokens": counts_E.sum() - kept,
            "aux_loss": load_balancing_loss(routing, counts_E),
            "z_loss": z_loss(routing),
            "router_entropy": router_entropy(routing),
        }
        for name, value in stats.items():
            self.sow(nnx.Intermediate, name, value, reduce_fn=_latest, init_fn=_zero_like(value))


def _latest(previous, value):
    del previous
    return value


def _zero_like(value):
    return lambda: jnp.zeros_like(value)
