"""The multi-token prediction layers (`model.mtp`, see `mtp.config` for the math): `MTPLayer`, a
hybrid block with the MTP module's input projection or final norm, and `MultiTokenPrediction`,
the `mtp.layers` of a model and the forward of every depth.

Parameters (`mtp.layers.{j}`, j = module * len(pattern) + block, Hugging Face's flat order):
    norm.scale, attn.* / mlp.*       the block (as a hybrid block of its kind)
    enorm.scale, hnorm.scale         [d_model]               first block of a module
    eh_proj.kernel                   [2 d_model, d_model]    first block: [embedding ; hidden]
    final_layernorm.scale            [d_model]               last block of a module

`eh_proj` and the blocks' linears are quantized linears named `mtp.layers.{j}.eh_proj`,
`mtp.layers.{j}.attn.qkv`, ... in the precision policy (BF16 unless an override says otherwise:
`precision.policy`). The SR keys of the block at depth t (0-based), position p, are
`stacked_blocks.layer_keys(key, num_layers + t * len(pattern) + p)`: the mixer's in
`structure.mixer_linear_names` order, then `eh_proj`'s.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

import nvfp4_ops
from nvfp4_train.model.blocks.block import MixerBlock
from nvfp4_train.model.blocks.linear import QuantLinear
from nvfp4_train.model.blocks.norms import RMSNorm
from nvfp4_train.model.mtp.loss import shift_left
from nvfp4_train.model.stacked_blocks import layer_keys
from nvfp4_train.model.structure import mixer_linear_names, mtp_layer_count, mtp_layer_kind


class MTPLayer(MixerBlock):
    """MTP layer `j`: a hybrid block of its kind (`x + mixer(norm(x))`), with `enorm`, `hnorm`
    and `eh_proj` when it starts its module and `final_layernorm` when it ends it."""

    def __init__(self, cfg, recipes: dict[str, nvfp4_ops.Recipe], j: int, *, rngs: nnx.Rngs,
                 backend: str | tuple[str, ...] = "auto"):  # fmt: skip
        path, size = f"mtp.layers.{j}", len(cfg.mtp.pattern)
        kind = mtp_layer_kind(cfg, j)
        super().__init__(cfg, recipes, 0, rngs=rngs, backend=backend, kind=kind, path=path)
        d, dtype, eps = cfg.d_model, cfg.compute_dtype, cfg.rms_norm_eps
        self.eh_key = len(mixer_linear_names(cfg, kind))
        if j % size == 0:
            self.enorm = RMSNorm(d, eps=eps, dtype=dtype)
            self.hnorm = RMSNorm(d, eps=eps, dtype=dtype)
            self.eh_proj = QuantLinear(2 * d, d, recipe=recipes[f"{path}.eh_proj"],
                                       init_std=cfg.init_std, dtype=dtype, rngs=rngs,
                                       backend=backend)  # fmt: skip
        if j % size == size - 1:
            self.final_layernorm = RMSNorm(d, eps=eps, dtype=dtype)

    def project(self, embedded_BxLxD: jax.Array, h_BxLxD: jax.Array, keys) -> jax.Array:
        """eh_proj([enorm(embedding) ; hnorm(hidden)]), the module's input."""
        both = jnp.concatenate([self.enorm(embedded_BxLxD), self.hnorm(h_BxLxD)], axis=-1)
        return self.eh_proj(both, keys[self.eh_key])


class MultiTokenPrediction(nnx.Module):
    """The MTP layers of a model (`mtp.layers.{j}`) and their forward at every depth."""

    def __init__(self, cfg, recipes: dict[str, nvfp4_ops.Recipe], *, rngs: nnx.Rngs,
                 backend: str | tuple[str, ...] = "auto"):  # fmt: skip
        self.cfg = cfg
        self.layers = nnx.Dict({
            str(j): MTPLayer(cfg, recipes, j, rngs=rngs, backend=backend)
            for j in range(mtp_layer_count(cfg))
        })  # fmt: skip

    def __call__(
        self,
        h_BxLxD: jax.Array,
        inputs_BxL: jax.Array,
        embed: Callable[[jax.Array], jax.Array],
        head: Callable[[jax.Array], jax.Array],
        key: jax.Array | None = None,
        documents=None,
        constrain=None,
    ) -> tuple[jax.Array, ...]:
        """The float32 logits [B, L, vocab] of each depth d = 1..D: position i's prediction of
        token i + d + 1 (`mtp.loss` masks the positions without one).

        Args:
            h_BxLxD: the main model's last hidden state, after its final norm.
            inputs_BxL: the main model's input tokens (depth d embeds them shifted left by d).
            embed, head: the model's embedding and output head (shared).
            key, documents, constrain: as `Llama.__call__`'s (a block at depth t, position p
                gets `layer_keys(key, num_layers + t * len(pattern) + p)`).
        """
        cfg, mtp = self.cfg, self.cfg.mtp
        size, logits = len(mtp.pattern), []
        for t in range(mtp.resolved_depths):
            tokens_BxL = shift_left(inputs_BxL, t + 1)
            for p in range(size):
                layer = self.layers[str(mtp.module_of_depth(t) * size + p)]
                keys = layer_keys(key, cfg.num_layers + t * size + p)
                if p == 0:
                    x_BxLxD = layer.project(embed(tokens_BxL), h_BxLxD, keys)
                x_BxLxD = layer(x_BxLxD, keys, documents, constrain)
            h_BxLxD = layer.final_layernorm(x_BxLxD)
            logits.append(head(h_BxLxD))
        return tuple(logits)
