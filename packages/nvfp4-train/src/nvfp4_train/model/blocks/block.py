"""The pre-norm decoder blocks.

A Llama-style block (`Block`): x + attn(norm(x)), then + mlp(norm(x)), the MLP dense SwiGLU or, in
an MoE block (`model.moe`, `moe.config.is_moe_layer`), the Mixture-of-Experts MLP. A hybrid block
(`MixerBlock`, `model.pattern`): x + mixer(norm(x)) with ONE mixer, Mamba-2, attention, the dense
MLP (SwiGLU or squared ReLU) or the MoE MLP, as Nemotron-H's `NemotronHBlock`. `make_block` builds
block `index` of a config.
"""

from __future__ import annotations

import jax
from flax import nnx

import nvfp4_ops
from nvfp4_train.model.blocks.mamba import Mamba2Mixer
from nvfp4_train.model.blocks.mlp import MLP, Relu2MLP
from nvfp4_train.model.blocks.norms import RMSNorm
from nvfp4_train.model.blocks.self_attention import Attention, Documents
from nvfp4_train.model.config import block_kinds, is_moe_block
from nvfp4_train.model.moe.layer import MoEMLP


class Block(nnx.Module):
    """One Llama-style block; its linears' SR keys are `keys[0:2]` (attention), then `keys[2:4]`
    (dense MLP) or `keys[2:]` (MoE: `structure.moe_linear_names` order)."""

    def __init__(self, cfg, recipes: dict[str, nvfp4_ops.Recipe], index: int, *, rngs: nnx.Rngs,
                 backend: str | tuple[str, ...] = "auto"):  # fmt: skip
        dtype = cfg.compute_dtype
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.rms_norm_eps, dtype=dtype)
        self.attn = Attention(cfg, recipes, f"layers.{index}.attn", rngs=rngs, backend=backend)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.rms_norm_eps, dtype=dtype)
        mlp = MoEMLP if is_moe_block(cfg, index) else MLP
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


MIXER_ATTRIBUTES = {"mamba": "mamba", "attention": "attn", "mlp": "mlp", "moe": "mlp"}
"""A hybrid block's kind -> the attribute (parameter path) of its mixer."""


class MixerBlock(nnx.Module):
    """One hybrid block, `x + mixer(norm(x))`: `norm` and one of `mamba` (Mamba-2), `attn`
    (attention), `mlp` (SwiGLU, squared-ReLU or MoE MLP); its linears' SR keys are `keys[0:]` in
    `structure.mixer_linear_names` order. `kind` and `path` (default: block `index`'s kind and
    `layers.{index}`) build it elsewhere, e.g. as an MTP layer."""

    def __init__(self, cfg, recipes: dict[str, nvfp4_ops.Recipe], index: int, *, rngs: nnx.Rngs,
                 backend: str | tuple[str, ...] = "auto", kind: str = "",
                 path: str = ""):  # fmt: skip
        kind = kind or block_kinds(cfg)[index]
        self.kind = kind
        self.norm = RMSNorm(cfg.d_model, eps=cfg.rms_norm_eps, dtype=cfg.compute_dtype)
        prefix = f"{path or f'layers.{index}'}.{MIXER_ATTRIBUTES[kind]}"
        if kind == "mamba":
            self.mamba = Mamba2Mixer(cfg, recipes, prefix, rngs=rngs, backend=backend)
        elif kind == "attention":
            self.attn = Attention(cfg, recipes, prefix, rngs=rngs, backend=backend)
        else:
            mlp = {"moe": MoEMLP, "relu2": Relu2MLP, "swiglu": MLP}[
                "moe" if kind == "moe" else cfg.mlp_activation
            ]
            self.mlp = mlp(cfg, recipes, prefix, rngs=rngs, backend=backend)

    def __call__(
        self,
        x_BxLxD: jax.Array,
        keys: tuple[jax.Array | None, ...],
        documents: Documents | None = None,
        constrain=None,
    ) -> jax.Array:
        """`documents` and `constrain`: as in `Block.__call__` (read by attention and Mamba)."""
        h_BxLxD = self.norm(x_BxLxD)
        if self.kind == "mamba":
            return x_BxLxD + self.mamba(h_BxLxD, keys, documents, constrain)
        if self.kind == "attention":
            return x_BxLxD + self.attn(h_BxLxD, keys[0:2], documents, constrain)
        return x_BxLxD + self.mlp(h_BxLxD, keys)


def make_block(cfg, recipes: dict[str, nvfp4_ops.Recipe], index: int, *, rngs: nnx.Rngs,
               backend: str | tuple[str, ...] = "auto") -> Block | MixerBlock:  # fmt: skip
    """Block `index` of `cfg`: a `MixerBlock` with a `model.pattern`, else a Llama-style `Block`."""
    cls = MixerBlock if cfg.pattern else Block
    return cls(cfg, recipes, index, rngs=rngs, backend=backend)
