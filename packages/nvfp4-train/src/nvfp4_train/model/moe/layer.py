"""The Mixture-of-Experts MLP of an MoE block: router, routed experts, shared experts.

Parameters of an MoE block's `mlp` (float32 masters; `E = moe.num_experts`, `F =
moe.expert_mlp_dim`, `S = moe.shared_mlp_dim`):
    router.kernel           [d_model, E]        never quantized (float32 logits and softmax)
    router.score_bias       [E]                 auxiliary-loss-free balancing bias; not trained
                                                 by the optimizer (zero gradient, no decay)
    experts.gate_up.kernel  [E, d_model, 2F]    per expert: gate | up, as a dense `mlp.gate_up`
    experts.down.kernel     [E, F, d_model]
    shared.gate_up.kernel   [d_model, 2S]       (shared_experts > 0)
    shared.down.kernel      [S, d_model]
    shared_gate.kernel      [d_model, 1]        (shared_expert_gate; never quantized)

The routed experts run as two grouped GEMMs (`nvfp4_ops.ragged_dot`: the recipe's three GEMMs
per expert, with per-expert tensor scales), dispatched and combined by `model.dispatch`; the
shared experts are a `layers.MLP`. Every quantized linear follows the precision policy like a
dense one (paths `layers.{i}.mlp.experts.gate_up`, `...experts.down`, `...shared.gate_up`,
`...shared.down`). Traced under a mesh whose `expert` axis splits the experts, the routed experts
run expert-parallel (`model.expert_parallel`) with the numerics of one device.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

import nvfp4_ops
from nvfp4_train.model.blocks.linear import (
    OPERAND_W,
    OPERAND_X,
    OUTPUT_GRAD,
    LinearOperand,
    sow_input_amax,
)
from nvfp4_train.model.blocks.mlp import MLP, swiglu
from nvfp4_train.model.moe.config import expert_capacity
from nvfp4_train.model.moe.dispatch import combine, dispatch, gather_rows
from nvfp4_train.model.moe.expert_parallel import expert_mesh, sharded_routed_experts
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
    """Float32 router logits `x @ kernel` and softmax top-k routing (`model.routing.route`)."""

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
        return route(logits, k=moe.experts_per_token, norm_topk_prob=moe.norm_topk_prob,
                     score_bias_E=bias if moe.bias_update_rate else None)  # fmt: skip


def group_amax(x_AxK: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
    """float32 [E]: max |x| over each group's rows (0 for an empty group; rows past the groups
    are not counted)."""
    num_groups, rows = group_sizes_E.shape[0], x_AxK.shape[0]
    ends = jnp.cumsum(group_sizes_E)
    group_A = jnp.searchsorted(ends, jnp.arange(rows), side="right")
    row_amax = jnp.max(jnp.abs(x_AxK), axis=-1).astype(jnp.float32)
    return jax.ops.segment_max(row_amax, group_A, num_segments=num_groups + 1)[:num_groups].clip(0)


OPERAND_GROUP_SIZES = "group_sizes"
"""Name of the third `LinearOperand` a `GroupedLinear` in capture mode sows: its group sizes."""


class GroupedLinear(nnx.Module):
    """`y_g = x_g @ W_e` for each expert's rows: `nvfp4_ops.ragged_dot` with a fixed recipe.

    The kernel is stored [E, in, out] in float32. Sows the max |x| of each expert's rows
    (float32 [E], after the compute-dtype cast) as `layers.INPUT_AMAX`.

    Capture mode (`capture_operands = True`, set only inside a telemetry probe, as on
    `layers.QuantLinear`) also sows x [A, in] and the kernel [E, in, out] (compute dtype) and
    the group sizes (int32 [E]) as `LinearOperand`s named `OPERAND_X`, `OPERAND_W`,
    `OPERAND_GROUP_SIZES`, and adds the perturbation `OUTPUT_GRAD` to the output (dy [A, out]).
    Off (the default) the call traces to the same graph as without it.
    """

    def __init__(self, experts: int, in_features: int, out_features: int, *,
                 recipe: nvfp4_ops.Recipe, init_std: float, dtype: jnp.dtype, rngs: nnx.Rngs,
                 backend: str | tuple[str, ...] = "auto"):  # fmt: skip
        init = jax.nn.initializers.normal(stddev=init_std)
        shape = (experts, in_features, out_features)
        self.kernel = nnx.Param(init(rngs.params(), shape, jnp.float32))
        self.recipe, self.backend, self.dtype = recipe, backend, dtype
        self.capture_operands = False

    def __call__(self, x_AxI: jax.Array, group_sizes_E: jax.Array, key=None) -> jax.Array:
        x = x_AxI.astype(self.dtype)
        sow_input_amax(self, group_amax(x, group_sizes_E))
        w = self.kernel[...].astype(self.dtype)
        y = nvfp4_ops.ragged_dot(
            x, w, group_sizes_E, recipe=self.recipe, key=key,
            backend=self.backend, preferred_element_type=jnp.float32,
        )  # fmt: skip
        y = y.astype(self.dtype)
        if self.capture_operands:
            operands = {OPERAND_X: x, OPERAND_W: w, OPERAND_GROUP_SIZES: group_sizes_E}
            for name, value in operands.items():
                self.sow(LinearOperand, name, value, reduce_fn=_latest)
            y = self.perturb(OUTPUT_GRAD, y)
        return y


class Experts(nnx.Module):
    """The routed experts of an MoE block: SwiGLU MLPs as two grouped linears."""

    def __init__(self, cfg, recipes: dict[str, nvfp4_ops.Recipe], prefix: str, *,
                 rngs: nnx.Rngs, backend: str | tuple[str, ...] = "auto"):  # fmt: skip
        moe, dtype = cfg.moe, cfg.compute_dtype
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.gate_up = GroupedLinear(
            moe.num_experts, cfg.d_model, 2 * moe.expert_mlp_dim,
            recipe=recipes[f"{prefix}.gate_up"], init_std=cfg.init_std, dtype=dtype, rngs=rngs,
            backend=backend,
        )  # fmt: skip
        self.down = GroupedLinear(
            moe.num_experts, moe.expert_mlp_dim, cfg.d_model, recipe=recipes[f"{prefix}.down"],
            init_std=out_std, dtype=dtype, rngs=rngs, backend=backend,
        )  # fmt: skip

    def __call__(self, x_AxD: jax.Array, group_sizes_E: jax.Array, keys) -> jax.Array:
        hidden = swiglu(self.gate_up(x_AxD, group_sizes_E, keys[0]))
        return self.down(hidden, group_sizes_E, keys[1])


class MoEMLP(nnx.Module):
    """Router + routed experts (+ shared experts) of one MoE block (see the module docstring).

    Called on [B, L, d_model] (all B * L tokens routed together) with the keys of its four
    quantized linears (experts.gate_up, experts.down, shared.gate_up, shared.down).
    """

    def __init__(self, cfg, recipes: dict[str, nvfp4_ops.Recipe], prefix: str, *,
                 rngs: nnx.Rngs, backend: str | tuple[str, ...] = "auto"):  # fmt: skip
        moe = self.moe = cfg.moe
        self.dtype = cfg.compute_dtype
        self.router = Router(cfg, rngs=rngs)
        self.experts = Experts(cfg, recipes, f"{prefix}.experts", rngs=rngs, backend=backend)
        if moe.shared_experts:
            self.shared = MLP(cfg, recipes, f"{prefix}.shared", rngs=rngs, backend=backend,
                              hidden=moe.shared_mlp_dim)  # fmt: skip
        if moe.shared_expert_gate:
            self.shared_gate = nnx.Linear(
                cfg.d_model, 1, use_bias=False, dtype=jnp.float32,
                kernel_init=jax.nn.initializers.normal(stddev=cfg.init_std),
                precision=jax.lax.Precision.HIGHEST, rngs=rngs,
            )  # fmt: skip

    def __call__(self, x_BxLxD: jax.Array, keys: tuple[jax.Array | None, ...]) -> jax.Array:
        moe = self.moe
        b, l, d = x_BxLxD.shape
        x_TxD = x_BxLxD.reshape(b * l, d)
        routing = self.router(x_TxD)
        capacity = expert_capacity(moe, b * l)
        out_TxD = self._routed(x_TxD, routing, capacity, keys[0:2])
        if moe.shared_experts:
            shared = self.shared(x_TxD, keys[2:4])
            if moe.shared_expert_gate:
                gate_logit = self.shared_gate(x_TxD.astype(jnp.float32))
                shared = (jax.nn.sigmoid(gate_logit) * shared.astype(jnp.float32)).astype(
                    self.dtype
                )
            out_TxD = out_TxD + shared
        self._sow_stats(routing, capacity)
        return out_TxD.reshape(b, l, d)

    def _routed(self, x_TxD: jax.Array, routing: Routing, capacity: int, keys) -> jax.Array:
        """[T, D] in the compute dtype: each token's routed experts' outputs, weighted and
        summed; expert-parallel on a context mesh with an `expert` axis, else on all experts."""
        x_TxD, mesh = x_TxD.astype(self.dtype), expert_mesh()
        if mesh is not None:
            linears = (self.experts.gate_up, self.experts.down)
            kernels = ((linears[0].kernel[...], 1), (linears[1].kernel[...], 2))  # d_model dims
            done = sharded_routed_experts(mesh, x_TxD, routing, kernels, keys,
                                          _shard_experts(*linears), capacity=capacity,
                                          dtype=self.dtype, exchange=self.moe.dispatch)  # fmt: skip
            if done is not None:
                out_TxD, amax = done
                for linear, value in zip(linears, amax, strict=True):
                    sow_input_amax(linear, value)
                return out_TxD.astype(self.dtype)
        d_ = dispatch(routing.experts_TxK, num_experts=self.moe.num_experts, capacity=capacity)
        x_AxD = gather_rows(x_TxD, d_, self.moe.experts_per_token)
        y_AxD = self.experts(x_AxD, d_.group_sizes, keys)
        return combine(y_AxD, routing.weights_TxK, d_, self.dtype)

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


def _shard_experts(gate_up: GroupedLinear, down: GroupedLinear):
    """The routed experts' SwiGLU on one device's shard of them, as `GroupedLinear` computes it
    (recipe, backend, dtype), on explicit kernels [El, ...] (`expert_parallel.ExpertsFn`)."""

    def linear(module, x, kernel, sizes, key, offset):
        x = x.astype(module.dtype)
        y = nvfp4_ops.ragged_dot(
            x, kernel.astype(module.dtype), sizes, recipe=module.recipe, key=key,
            backend=module.backend, preferred_element_type=jnp.float32, group_offset=offset,
        )  # fmt: skip
        return y.astype(module.dtype), group_amax(x, sizes)

    def run(x_RxD, sizes, kernels, keys, offset):
        hidden, amax_in = linear(gate_up, x_RxD, kernels[0], sizes, keys[0], offset)
        y, amax_hidden = linear(down, swiglu(hidden), kernels[1], sizes, keys[1], offset)
        return y, (amax_in, amax_hidden)

    return run


def _latest(previous, value):
    del previous
    return value


def _zero_like(value):
    return lambda: jnp.zeros_like(value)
