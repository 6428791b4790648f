"""The routed experts of an MoE block: the grouped quantized linear (`GroupedLinear`), the experts'
MLP on all experts (`Experts`) and on one device's shard of them (`shard_experts`, for
`model.moe.expert_parallel`).

An expert is SwiGLU (`gate_up` [E, in, 2F], then `down` [E, F, out]; Mixtral, Qwen, DeepSeek)
or non-gated squared ReLU (`up` [E, in, F], then `down`; Nemotron 3's `NemotronHExperts`), as
`model.moe.expert_activation` says; `in` and `out` are d_model, or `model.moe.latent_dim` in a
LatentMoE block.
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
from nvfp4_train.model.blocks.mlp import relu2, swiglu

ACTIVATIONS = {"swiglu": swiglu, "relu2": relu2}
"""`model.moe.expert_activation` -> the function between the experts' two grouped GEMMs."""
FIRST_LINEAR = {"swiglu": "gate_up", "relu2": "up"}
"""`model.moe.expert_activation` -> the name of the experts' (and shared experts') first linear."""


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
    """The routed experts of an MoE block as two grouped linears: `gate_up` (SwiGLU) or `up`
    (squared ReLU), then `down`; `width` is their input and output width (d_model, or the
    latent of a LatentMoE block)."""

    def __init__(self, cfg, recipes: dict[str, nvfp4_ops.Recipe], prefix: str, *,
                 rngs: nnx.Rngs, backend: str | tuple[str, ...] = "auto",
                 width: int = 0):  # fmt: skip
        moe, dtype, width = cfg.moe, cfg.compute_dtype, width or cfg.d_model
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.activation = moe.expert_activation
        first = FIRST_LINEAR[self.activation]
        hidden = moe.expert_mlp_dim * (2 if self.activation == "swiglu" else 1)
        setattr(self, first, GroupedLinear(
            moe.num_experts, width, hidden, recipe=recipes[f"{prefix}.{first}"],
            init_std=cfg.init_std, dtype=dtype, rngs=rngs, backend=backend,
        ))  # fmt: skip
        self.down = GroupedLinear(
            moe.num_experts, moe.expert_mlp_dim, width, recipe=recipes[f"{prefix}.down"],
            init_std=out_std, dtype=dtype, rngs=rngs, backend=backend,
        )  # fmt: skip

    @property
    def linears(self) -> tuple[GroupedLinear, GroupedLinear]:
        """(the first grouped linear, `down`), in the order they run."""
        return getattr(self, FIRST_LINEAR[self.activation]), self.down

    def __call__(self, x_AxD: jax.Array, group_sizes_E: jax.Array, keys) -> jax.Array:
        first, down = self.linears
        hidden = ACTIVATIONS[self.activation](first(x_AxD, group_sizes_E, keys[0]))
        return down(hidden, group_sizes_E, keys[1])


def shard_experts(experts: Experts):
    """The routed experts on one device's shard of them, as `GroupedLinear` computes them (recipe,
    backend, dtype, activation), on explicit kernels [El, ...] (`expert_parallel.ExpertsFn`)."""
    (first, down), activation = experts.linears, ACTIVATIONS[experts.activation]

    def linear(module, x, kernel, sizes, key, offset):
        x = x.astype(module.dtype)
        y = nvfp4_ops.ragged_dot(
            x, kernel.astype(module.dtype), sizes, recipe=module.recipe, key=key,
            backend=module.backend, preferred_element_type=jnp.float32, group_offset=offset,
        )  # fmt: skip
        return y.astype(module.dtype), group_amax(x, sizes)

    def run(x_RxD, sizes, kernels, keys, offset):
        hidden, amax_in = linear(first, x_RxD, kernels[0], sizes, keys[0], offset)
        y, amax_hidden = linear(down, activation(hidden), kernels[1], sizes, keys[1], offset)
        return y, (amax_in, amax_hidden)

    return run


def _latest(previous, value):
    del previous
    return value
