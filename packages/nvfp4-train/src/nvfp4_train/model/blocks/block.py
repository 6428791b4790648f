"""The pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(x)), the MLP dense SwiGLU or,
in an MoE block (`model.moe`, `moe_config.is_moe_layer`), the Mixture-of-Experts MLP."""

from __future__ import annotations

import jax
from flax import nnx

import nvfp4_ops
from nvfp4_train.model.blocks.mlp import MLP
from nvfp4_train.model.blocks.norms import RMSNorm
from nvfp4_train.model.blocks.self_attention import Attention, Documents
from nvfp4_train.model.moe.config import is_moe_layer
from nvfp4_train.model.moe.layer import MoEMLP


class Block(nnx.Module):
    """One decoder block; its linears' SR keys are `keys[0:2]` (attention), then `keys[2:4]`
    (dense MLP) or `keys[2:6]` (MoE: experts' gate_up and down, shared gate_up and down)."""

    def __init__(self, cfg, recipes: dict[str, nvfp4_ops.Recipe], index: int, *, rngs: nnx.Rngs,
                 backend: str | tuple[str, ...] = "auto"):  # fmt: skip
        dtype = cfg.compute_dtype
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.rms_norm_eps, dtype=dtype)
        self.attn = Attention(cfg, recipes, f"layers.{index}.attn", rngs=rngs, backend=backend)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.rms_norm_eps, dtype=dtype)
        mlp = MoEMLP if is_moe_layer(cfg.moe, index) else MLP
        self.mlp = mlp(cfg, recipes, f"layers.{index}.mlp", rngs=rngs, backend=backend)

    def __call__(
        self,
        x_BxLxD: jax.Array,
        keys: tuple[jax.Array | None, ...],
        documents: Documents | None = None,
        constrain=None,
    ) -> jax.Array:
        """`constrain`: as in `Llama.__call__` (attention's operands on the run's mesh)."""
        x_BxLxD = x_BxLxD + self.attn(self.attn_norm(x_BxLxD), keys[0:2], documents, constrain)
        return x_BxLxD + self.mlp(self.mlp_norm(x_BxLxD), keys[2:])
