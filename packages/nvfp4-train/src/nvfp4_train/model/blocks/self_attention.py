"""The attention mixer: causal grouped-query attention with one fused q/k/v projection."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

import nvfp4_ops
from nvfp4_train.model.blocks.attention import attention
from nvfp4_train.model.blocks.linear import QuantLinear
from nvfp4_train.model.blocks.norms import RMSNorm
from nvfp4_train.model.blocks.rope import apply_rope, rope_cos_sin

Documents = tuple[jax.Array, jax.Array]
"""(segment ids, positions within the document), both int [B, L]."""


class Attention(nnx.Module):
    """Causal grouped-query attention with one fused q/k/v projection.

    `qkv.kernel` is [d_model, (num_heads + 2 * num_kv_heads) * head_dim]: columns hold all q heads,
    then all k heads, then all v heads, each head's `head_dim` columns contiguous (`qkv.bias`
    likewise). With `qk_norm`, q and k are RMS-normalised per head (`q_norm`, `k_norm`, Qwen 3)
    before RoPE (none with `rope: false`, Nemotron-H: positions come from the Mamba blocks).
    QK^T, softmax and SV are not quantized (inputs in the compute dtype, float32
    accumulation and softmax); `cfg.attention` picks how they are computed
    (`nvfp4_train.model.blocks.attention`).
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
        self.rope, self.rope_theta, self.rope_scaling = cfg.rope, cfg.rope_theta, cfg.rope_scaling
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
        if self.rope:
            cos, sin = rope_cos_sin(positions, hd, self.rope_theta, self.rope_scaling)
            q_BxLxHxK = apply_rope(q_BxLxHxK, cos, sin)
            k_BxLxGxK = apply_rope(k_BxLxGxK, cos, sin)
        out_BxLxHxK = attention(
            q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL,
            implementation=self.implementation, block=self.block,
            max_documents=self.max_documents, constrain=constrain,
        )  # fmt: skip
        return self.o(out_BxLxHxK.reshape(b, l, nh * hd), keys[1])
