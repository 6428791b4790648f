"""Building blocks of the Llama decoder: quantized linear, RMSNorm, RoPE, attention, SwiGLU MLP.

Parameters are float32 master weights; each block casts them to its compute dtype. Only the four
linears of a block (`attn.qkv`, `attn.o`, `mlp.gate_up`, `mlp.down`) go through
`nvfp4_ops.dot_general` with their own `Recipe`; norms, RoPE, attention BMMs and softmax stay in
BF16/FP32 and are never quantized.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

import nvfp4_ops
from nvfp4_train.model.attention import attention
from nvfp4_train.model.weight_gather import (
    check_tiles,
    gather_compute,
    gather_plan,
    gather_quantized,
    linear_product,
    mode_for,
    product_with_gathered,
)

INPUT_AMAX = "input_amax"
"""Name of the `nnx.Intermediate` each `QuantLinear` call sows: max |input| of that call."""
OPERAND_X, OPERAND_W = "x", "w"
"""Names of the `LinearOperand`s a `QuantLinear` in capture mode sows: its GEMM input and kernel."""
OUTPUT_GRAD = "output"
"""Name of the zero `nnx.Perturbation` a `QuantLinear` in capture mode adds to its output."""


class LinearOperand(nnx.Variable):
    """A GEMM operand (input or kernel, compute dtype) sown by a `QuantLinear` in capture mode."""


def _zero_f32() -> jax.Array:
    return jnp.zeros((), jnp.float32)


def sow_input_amax(module: nnx.Module, amax: jax.Array) -> None:
    """Sows `amax` on `module` as the `nnx.Intermediate` `INPUT_AMAX`, max-reduced with what is
    already sown (a float32 scalar, or one per layer for a stacked block)."""
    module.sow(nnx.Intermediate, INPUT_AMAX, amax, reduce_fn=jnp.maximum, init_fn=_zero_f32)


def _latest(previous, value):
    del previous
    return value


class QuantLinear(nnx.Module):
    """A linear `y = x @ W (+ b)` whose matmul is `nvfp4_ops.dot_general` with a fixed recipe.

    The kernel is stored [in, out] in float32 (like `nnx.Linear`); the optional bias (float32,
    init 0) is added to the float32 GEMM output and is never quantized. The recipe and the
    `nvfp4_ops` backend ("auto", a name, or an order of names) are static attributes, so they
    are part of the graphdef and not of the parameters.

    Capture mode (`capture_operands = True`, set only on a merged copy inside a telemetry probe,
    see `nvfp4_train.observe.telemetry`) additionally sows the GEMM input and the kernel as
    `LinearOperand`s named `OPERAND_X` / `OPERAND_W` and adds the `nnx.Perturbation` named
    `OUTPUT_GRAD` to the output, so the gradient w.r.t. it is dy. Off (the default) the call traces
    to exactly the same graph as without it.

    `gather` ("master", "compute" or "quantized", `precision.gather`) and `kernel_axes` (the mesh
    axes of the kernel, `mesh.sharding.kernel_axes`) are static attributes set on a built model
    (`training.step.ModelSpec.build`): under a context mesh whose `fsdp` splits the kernel, it is
    gathered as `nvfp4_train.model.weight_gather` says (same bits in every mode).

    Example:
        >>> lin = QuantLinear(64, 32, recipe=nvfp4_ops.get_recipe("bf16"), init_std=0.02,
        ...                   dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        >>> lin(jnp.ones((2, 64), jnp.bfloat16)).shape
        (2, 32)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        recipe: nvfp4_ops.Recipe,
        init_std: float,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        backend: str | tuple[str, ...] = "auto",
        use_bias: bool = False,
    ):
        init = jax.nn.initializers.normal(stddev=init_std)
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((out_features,), jnp.float32)) if use_bias else None
        self.recipe = recipe
        self.backend = backend
        self.dtype = dtype
        self.capture_operands = False
        self.gather = "master"
        self.kernel_axes = None

    def __call__(self, x_NxI: jax.Array, key: jax.Array | None = None) -> jax.Array:
        """Returns `x @ kernel` in the compute dtype; `key` feeds the recipe's stochastic rounding.

        Sows `max |x|` (float32 scalar, x after the cast to the compute dtype and before
        quantization) as the `nnx.Intermediate` named `INPUT_AMAX`; `pop_input_amax` collects it.
        """
        x = x_NxI.astype(self.dtype)
        amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
        sow_input_amax(self, amax)
        w = self.kernel[...].astype(self.dtype)
        y = self._product(x, w, key)
        if self.bias is not None:
            y = y + self.bias[...]
        y = y.astype(self.dtype)
        if self.capture_operands:
            self.sow(LinearOperand, OPERAND_X, x, reduce_fn=_latest)
            self.sow(LinearOperand, OPERAND_W, w, reduce_fn=_latest)
            y = self.perturb(OUTPUT_GRAD, y)
        return y

    def _product(self, x: jax.Array, w: jax.Array, key: jax.Array | None) -> jax.Array:
        """x @ w in float32 through the recipe, w gathered per `self.gather`."""
        mode = mode_for(self.gather, self.recipe)
        plan = None if mode == "master" else gather_plan(self.kernel_axes, w.shape)
        if plan is not None and mode == "quantized":
            check_tiles(plan, w.shape, "a QuantLinear's kernel")
            qw = gather_quantized(w, plan, self.recipe)
            return nvfp4_ops.prequantized_dot_general(
                x, w, qw, preferred_element_type=jnp.float32, recipe=self.recipe, key=key,
                backend=self.backend,
            )  # fmt: skip
        if plan is not None:
            gathered = gather_compute(w, plan)
            return product_with_gathered(x, w, gathered, key, self.recipe, self.backend)
        return linear_product(x, w, key, self.recipe, self.backend)


class RMSNorm(nnx.Module):
    """Root-mean-square norm computed in float32, with a float32 learnable scale (init 1)."""

    def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * inv_rms * self.scale[...]).astype(self.dtype)


def rotate_half(x: jax.Array) -> jax.Array:
    """HF `rotate_half`: split the last axis in halves (x1, x2) and return concat(-x2, x1)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def rope_inv_freq(head_dim: int, theta: float, scaling=None) -> jax.Array:
    """float32 [head_dim / 2] RoPE frequencies, scaled as HF's `rope_type` says
    (`model.RopeScaling`; None or "default": unscaled) with HF's formulas."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    kind = "default" if scaling is None else scaling.rope_type
    if kind == "linear":
        return inv_freq / scaling.factor
    if kind != "llama3":
        return inv_freq
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope_cos_sin(
    positions_L: jax.Array, head_dim: int, theta: float, scaling=None
) -> tuple[jax.Array, jax.Array]:
    """Rotary tables in the HF layout: float32 [..., L, head_dim] for positions [..., L] ([L], or
    [B, L] per-document positions), frequencies repeated over both halves."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    freqs_LxHalf = positions_L.astype(jnp.float32)[..., None] * inv_freq
    emb_LxD = jnp.concatenate([freqs_LxHalf, freqs_LxHalf], axis=-1)
    return jnp.cos(emb_LxD), jnp.sin(emb_LxD)


def apply_rope(x_BxLxHxD: jax.Array, cos_LxD: jax.Array, sin_LxD: jax.Array) -> jax.Array:
    """Applies rotary embeddings (HF convention) in float32; returns x's dtype. The tables are
    [L, D] (shared by every row) or [B, L, D] (per-row positions)."""
    x32 = x_BxLxHxD.astype(jnp.float32)
    if cos_LxD.ndim == 2:
        cos, sin = cos_LxD[None, :, None, :], sin_LxD[None, :, None, :]
    else:
        cos, sin = cos_LxD[:, :, None, :], sin_LxD[:, :, None, :]
    return (x32 * cos + rotate_half(x32) * sin).astype(x_BxLxHxD.dtype)


Documents = tuple[jax.Array, jax.Array]
"""(segment ids, positions within the document), both int [B, L]."""


class Attention(nnx.Module):
    """Causal grouped-query attention with one fused q/k/v projection.

    `qkv.kernel` is [d_model, (num_heads + 2 * num_kv_heads) * head_dim]: columns hold all q heads,
    then all k heads, then all v heads, each head's `head_dim` columns contiguous (`qkv.bias`
    likewise). With `qk_norm`, q and k are RMS-normalised per head (`q_norm`, `k_norm`, Qwen 3)
    before RoPE. QK^T, softmax and SV are not quantized (inputs in the compute dtype, float32
    accumulation and softmax); `cfg.attention` picks how they are computed
    (`nvfp4_train.model.attention`).
    """

    def __init__(self, cfg, recipes: dict[str, nvfp4_ops.Recipe], prefix: str, *, rngs: nnx.Rngs,
                 backend: str | tuple[str, ...] = "auto"):  # fmt: skip
        hd, nh, nkv = cfg.resolved_head_dim, cfg.num_heads, cfg.num_kv_heads
        dtype = cfg.compute_dtype
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.qkv = QuantLinear(
            cfg.d_model, (nh + 2 * nkv) * hd, recipe=recipes[f"{prefix}.qkv"],
            init_std=cfg.init_std, dtype=dtype, rngs=rngs, backend=backend, use_bias=cfg.qkv_bias,
        )  # fmt: skip
        self.o = QuantLinear(
            nh * hd, cfg.d_model, recipe=recipes[f"{prefix}.o"],
            init_std=out_std, dtype=dtype, rngs=rngs, backend=backend, use_bias=cfg.o_bias,
        )  # fmt: skip
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, dtype=dtype)
        self.qk_norm = cfg.qk_norm
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd
        self.rope_theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling
        self.implementation, self.block = cfg.attention, cfg.attention_block
        self.max_documents = cfg.attention_max_documents

    def __call__(
        self,
        x_BxLxD: jax.Array,
        keys: tuple[jax.Array | None, jax.Array | None],
        documents: Documents | None = None,
        constrain=None,
    ):
        """`documents`: (segment ids, positions) [B, L] int: attention stays within a document
        and RoPE restarts at each one; None: each row is one document. `constrain`: the run's
        `constrain(kind, x)`, passed to `attention` (None: no constraint)."""
        b, l, _ = x_BxLxD.shape
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x_BxLxD, keys[0])
        q, k, v = jnp.split(qkv, [nh * hd, (nh + nkv) * hd], axis=-1)
        q_BxLxHxK = q.reshape(b, l, nh, hd)
        k_BxLxGxK = k.reshape(b, l, nkv, hd)
        v_BxLxGxK = v.reshape(b, l, nkv, hd)
        if self.qk_norm:
            q_BxLxHxK, k_BxLxGxK = self.q_norm(q_BxLxHxK), self.k_norm(k_BxLxGxK)
        segment_ids_BxL, positions = (None, jnp.arange(l)) if documents is None else documents
        cos, sin = rope_cos_sin(positions, hd, self.rope_theta, self.rope_scaling)
        q_BxLxHxK = apply_rope(q_BxLxHxK, cos, sin)
        k_BxLxGxK = apply_rope(k_BxLxGxK, cos, sin)
        out_BxLxHxK = attention(
            q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL,
            implementation=self.implementation, block=self.block,
            max_documents=self.max_documents, constrain=constrain,
        )  # fmt: skip
        return self.o(out_BxLxHxK.reshape(b, l, nh * hd), keys[1])


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
