"""The Mamba-2 mixer (SSD) of a hybrid model's `M` blocks, as Nemotron-H and transformers'
`NemotronHMamba2Mixer` define it.

    z | xBC | dt = in_proj(x)                     [d_inner | conv_dim | num_heads]
    xBC = silu(conv1d(xBC))                        depthwise causal conv, kernel `conv_kernel`
    x | B | C = xBC                                [d_inner | n_groups * N | n_groups * N]
    dt = clip(softplus(dt + dt_bias), time_step_limit);  A = -exp(A_log)   (no clip: [])
    y = ssd_scan(x, dt, A, B, C) + D * x           h_t = exp(dt A) h_{t-1} + dt x_t B_t, y = h_t C_t
    out = out_proj(norm(y * silu(z)))              RMS norm per group of d_inner / n_groups

`in_proj` and `out_proj` are the recipe's quantized linears (`QuantLinear`); the conv, the scan,
A_log, D, dt_bias and the gated norm are never quantized and run in float32. Parameters:

    in_proj.kernel   [d_model, 2 * d_inner + 2 * n_groups * N + num_heads]   z | x, B, C | dt
    conv1d.kernel    [conv_kernel, conv_dim]   (torch's conv1d.weight[c, 0, k] = kernel[k, c])
    conv1d.bias      [conv_dim]                (mamba.conv_bias)
    dt_bias, A_log, D  [num_heads]
    norm.scale       [d_inner]
    out_proj.kernel  [d_inner, d_model]
With packed documents (segment ids), the conv window and the state restart at each document.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

import nvfp4_ops
from nvfp4_train.model.blocks.causal_conv import causal_conv1d
from nvfp4_train.model.blocks.linear import QuantLinear
from nvfp4_train.model.blocks.norms import GatedRMSNorm
from nvfp4_train.model.blocks.ssd import ssd_scan

SSM_STATS = ("dt_min", "dt_max", "dt_mean", "state_norm")
"""The SSM health statistics a Mamba mixer sows (`nnx.Intermediate`, float32 scalars): the range
and mean of dt after softplus and clipping over the batch, and the RMS over the batch of the
L2 norm of each row's final SSM state, averaged over heads."""


class CausalConv(nnx.Module):
    """A depthwise causal conv1d: `kernel` [K, channels] and `bias` [channels] (float32), with
    PyTorch's default init (uniform in +-1/sqrt(K))."""

    def __init__(self, channels: int, width: int, *, use_bias: bool, rngs: nnx.Rngs):
        bound = 1.0 / math.sqrt(width)
        init = jax.nn.initializers.uniform(2 * bound)
        self.kernel = nnx.Param(init(rngs.params(), (width, channels), jnp.float32) - bound)
        self.bias = (
            nnx.Param(init(rngs.params(), (channels,), jnp.float32) - bound) if use_bias else None
        )

    def __call__(self, x_BxLxC: jax.Array, segment_ids_BxL: jax.Array | None) -> jax.Array:
        bias = None if self.bias is None else self.bias[...]
        return causal_conv1d(x_BxLxC, self.kernel[...], bias, segment_ids_BxL=segment_ids_BxL)


def _dt_bias_init(key: jax.Array, m) -> jax.Array:
    """softplus^-1 of dt drawn log-uniformly in [time_step_min, time_step_max], floored."""
    lo, hi = math.log(m.time_step_min), math.log(m.time_step_max)
    dt = jnp.exp(jax.random.uniform(key, (m.num_heads,), jnp.float32) * (hi - lo) + lo)
    dt = jnp.maximum(dt, m.time_step_floor)
    return dt + jnp.log(-jnp.expm1(-dt))


class Mamba2Mixer(nnx.Module):
    """The Mamba-2 mixer of `cfg.mamba` (see the module docstring); its quantized linears are
    `{prefix}.in_proj` and `{prefix}.out_proj`."""

    def __init__(self, cfg, recipes: dict[str, nvfp4_ops.Recipe], prefix: str, *, rngs: nnx.Rngs,
                 backend: str | tuple[str, ...] = "auto"):  # fmt: skip
        m, dtype = cfg.mamba, cfg.compute_dtype
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.in_proj = QuantLinear(
            cfg.d_model, m.in_proj_width, recipe=recipes[f"{prefix}.in_proj"],
            init_std=cfg.init_std, dtype=dtype, rngs=rngs, backend=backend, use_bias=m.proj_bias,
        )  # fmt: skip
        self.conv1d = CausalConv(m.conv_dim, m.conv_kernel, use_bias=m.conv_bias, rngs=rngs)
        self.dt_bias = nnx.Param(_dt_bias_init(rngs.params(), m))
        self.A_log = nnx.Param(jnp.log(jnp.arange(1, m.num_heads + 1, dtype=jnp.float32)))
        self.D = nnx.Param(jnp.ones((m.num_heads,), jnp.float32))
        self.norm = GatedRMSNorm(
            m.inner, group_size=m.inner // m.n_groups, eps=cfg.rms_norm_eps, dtype=dtype
        )
        self.out_proj = QuantLinear(
            m.inner, cfg.d_model, recipe=recipes[f"{prefix}.out_proj"], init_std=out_std,
            dtype=dtype, rngs=rngs, backend=backend, use_bias=m.proj_bias,
        )  # fmt: skip
        self.heads, self.head_dim, self.groups = m.num_heads, m.head_dim, m.n_groups
        self.state_dim, self.chunk_size = m.state_dim, m.chunk_size
        self.time_step_limit = tuple(m.time_step_limit)

    def __call__(self, x_BxLxD: jax.Array, keys, documents=None, constrain=None) -> jax.Array:
        """`documents`: (segment ids, positions) [B, L] int, or None (each row one document);
        `constrain` is unused (no mesh layout of its own)."""
        del constrain
        b, l, _ = x_BxLxD.shape
        h, p, g, n = self.heads, self.head_dim, self.groups, self.state_dim
        segment_ids_BxL = None if documents is None else documents[0]
        zxbcdt = self.in_proj(x_BxLxD, keys[0])
        z, xbc, dt_BxLxH = jnp.split(zxbcdt, [h * p, zxbcdt.shape[-1] - h], axis=-1)
        xbc = jax.nn.silu(self.conv1d(xbc.astype(jnp.float32), segment_ids_BxL))
        x, b_, c_ = jnp.split(xbc, [h * p, h * p + g * n], axis=-1)
        dt_BxLxH = jax.nn.softplus(dt_BxLxH.astype(jnp.float32) + self.dt_bias[...])
        if self.time_step_limit:
            dt_BxLxH = jnp.clip(dt_BxLxH, *self.time_step_limit)
        x_BxLxHxP = x.reshape(b, l, h, p)
        y_BxLxHxP, state_BxHxPxN = ssd_scan(
            x_BxLxHxP, dt_BxLxH, -jnp.exp(self.A_log[...]), b_.reshape(b, l, g, n),
            c_.reshape(b, l, g, n), chunk_size=self.chunk_size, segment_ids_BxL=segment_ids_BxL,
            return_final_state=True,
        )  # fmt: skip
        y_BxLxHxP = y_BxLxHxP + self.D[...][:, None] * x_BxLxHxP
        self._sow_stats(dt_BxLxH, state_BxHxPxN)
        y = self.norm(y_BxLxHxP.reshape(b, l, h * p), z)
        return self.out_proj(y, keys[1])

    def _sow_stats(self, dt_BxLxH: jax.Array, state_BxHxPxN: jax.Array) -> None:
        """Sows `SSM_STATS` (gradient-free: statistics only)."""
        dt, state = jax.lax.stop_gradient(dt_BxLxH), jax.lax.stop_gradient(state_BxHxPxN)
        norms_BxH = jnp.sqrt(jnp.sum(state * state, axis=(2, 3)))
        values = (jnp.min(dt), jnp.max(dt), jnp.mean(dt), jnp.mean(norms_BxH))
        for name, value in zip(SSM_STATS, values, strict=True):
            self.sow(nnx.Intermediate, name, value, reduce_fn=lambda _, new: new)
