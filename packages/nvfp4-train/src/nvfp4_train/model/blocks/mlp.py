"""The dense MLP mixers: SwiGLU with one fused gate/up projection (`MLP`), and Nemotron-H's
non-gated squared-ReLU MLP (`Relu2MLP`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

import nvfp4_ops
from nvfp4_train.model.blocks.linear import QuantLinear


class MLP(nnx.Module):
    """SwiGLU MLP with one fused gate/up projection.

    `gate_up.kernel` is [d_model, 2 * mlp_dim]: the first `mlp_dim` columns are the gate, the last
    `mlp_dim` the up projection. `down.kernel` is [mlp_dim, d_model].
    """

    def __init__(self, cfg, recipes: dict[str, nvfp4_ops.Recipe], prefix: str, *, rngs: nnx.Rngs,
                 backend: str | tuple[str, ...] = "auto", hidden: int = 0):  # fmt: skip
        """`hidden`: the hidden width (0: `cfg.mlp_dim`; MoE shared experts set their own)."""
        dtype, hidden = cfg.compute_dtype, hidden or cfg.mlp_dim
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.gate_up = QuantLinear(
            cfg.d_model, 2 * hidden, recipe=recipes[f"{prefix}.gate_up"],
            init_std=cfg.init_std, dtype=dtype, rngs=rngs, backend=backend,
        )  # fmt: skip
        self.down = QuantLinear(
            hidden, cfg.d_model, recipe=recipes[f"{prefix}.down"],
            init_std=out_std, dtype=dtype, rngs=rngs, backend=backend,
        )  # fmt: skip

    def __call__(self, x_BxLxD: jax.Array, keys: tuple[jax.Array | None, jax.Array | None]):
        gate_up = self.gate_up(x_BxLxD, keys[0])
        return self.down(swiglu(gate_up), keys[1])


def swiglu(gate_up: jax.Array) -> jax.Array:
    """silu(gate) * up of a fused [..., 2 * hidden] projection (gate first), computed in float32
    and returned in the input's dtype."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)


class Relu2MLP(nnx.Module):
    """Nemotron-H's MLP, `down(relu(up x)^2)`: `up.kernel` [d_model, mlp_dim], `down.kernel`
    [mlp_dim, d_model]; the activation in float32. Nemotron 3's shared experts are one."""

    def __init__(self, cfg, recipes: dict[str, nvfp4_ops.Recipe], prefix: str, *, rngs: nnx.Rngs,
                 backend: str | tuple[str, ...] = "auto", hidden: int = 0):  # fmt: skip
        """`hidden`: the hidden width (0: `cfg.mlp_dim`; MoE shared experts set their own)."""
        dtype, out_std = cfg.compute_dtype, cfg.init_std / math.sqrt(2 * cfg.num_layers)
        hidden = hidden or cfg.mlp_dim
        self.up = QuantLinear(
            cfg.d_model, hidden, recipe=recipes[f"{prefix}.up"], init_std=cfg.init_std,
            dtype=dtype, rngs=rngs, backend=backend,
        )  # fmt: skip
        self.down = QuantLinear(
            hidden, cfg.d_model, recipe=recipes[f"{prefix}.down"], init_std=out_std,
            dtype=dtype, rngs=rngs, backend=backend,
        )  # fmt: skip

    def __call__(self, x_BxLxD: jax.Array, keys: tuple[jax.Array | None, jax.Array | None]):
        up = self.up(x_BxLxD, keys[0])
        return self.down(relu2(up), keys[1])


def relu2(x: jax.Array) -> jax.Array:
    """relu(x)^2 in float32, returned in x's dtype."""
    r = jax.nn.relu(x.astype(jnp.float32))
    return (r * r).astype(x.dtype)
