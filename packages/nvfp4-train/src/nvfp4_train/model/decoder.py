"""Llama-family decoder in Flax NNX whose block linears run through `nvfp4_ops.dot_general`.

Parameter tree (float32 master weights; kernels [in, out]):
    embed.embedding                 [vocab, d_model]
    layers.{i}.attn_norm.scale      [d_model]
    layers.{i}.attn.qkv.kernel      [d_model, (num_heads + 2 * num_kv_heads) * head_dim]  q|k|v
    layers.{i}.attn.qkv.bias        [(num_heads + 2 * num_kv_heads) * head_dim]    (qkv_bias only)
    layers.{i}.attn.q_norm.scale    [head_dim]                                     (qk_norm only)
    layers.{i}.attn.k_norm.scale    [head_dim]                                     (qk_norm only)
    layers.{i}.attn.o.kernel        [num_heads * head_dim, d_model]
    layers.{i}.attn.o.bias          [d_model]                                      (o_bias only)
    layers.{i}.mlp_norm.scale       [d_model]
    layers.{i}.mlp.gate_up.kernel   [d_model, 2 * mlp_dim]                                gate|up
    layers.{i}.mlp.down.kernel      [mlp_dim, d_model]
    (an MoE block's `mlp` holds its router and experts instead: `nvfp4_train.model.moe.layer`)
    final_norm.scale                [d_model]
    lm_head.kernel                  [d_model, vocab]   (absent when tie_embeddings)
    mtp.layers.{j}...               multi-token prediction layers (`model.mtp`, `model.mtp.layers`)
Layer indices `i` are string keys "0", "1", ... in the parameter dict. With `scan_layers`, runs of
blocks that compute alike, and runs of repeating groups of blocks, are stored stacked instead
(`layers.{first}-{last}...`, `layers.{first}-{last}/{period}.{j}...`, a leading axis of
repetitions; see `nvfp4_train.model.stacking`) and run under `jax.lax.scan`
(`nvfp4_train.model.stacked_blocks`); `remat` recomputes each block's activations in the backward
pass according to a `jax.checkpoint` policy.
Its configuration (`ModelConfig`, `block_linear_names`, `linear_paths`, ...): `nvfp4_train.model.config`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

import nvfp4_ops
from nvfp4_train.model.blocks.attention import document_positions
from nvfp4_train.model.blocks.norms import RMSNorm
from nvfp4_train.model.blocks.self_attention import Documents
from nvfp4_train.model.config import (
    REMAT_POLICIES,
    ModelConfig,
    block_linear_names,
    block_params,
    linear_paths,
)
from nvfp4_train.model.layer_groups import MAX_GROUP_PERIOD, groups_of
from nvfp4_train.model.mtp.layers import MultiTokenPrediction
from nvfp4_train.model.stacked_blocks import build_segment, layer_keys, members, run_segment
from nvfp4_train.model.stacking import LayerLayout
from nvfp4_train.model.structure import mtp_linear_names


def layer_layout(
    cfg: ModelConfig, recipes: dict[str, nvfp4_ops.Recipe], no_decay: Sequence[str] = ()
) -> LayerLayout:
    """Which blocks are stacked: with `cfg.scans`, the runs `layer_groups.groups_of` picks from
    the blocks' signatures (a block's linear names, their recipes, and which of its parameters
    match the `no_decay` patterns, the optimizer's weight-decay exclusions, searched in
    `layers.{i}.attn_norm.scale` etc.): runs of >= 2 alike blocks, and runs of >= 2 repetitions
    of a group of up to `MAX_GROUP_PERIOD` blocks (dense and MoE blocks alternating: a group of
    2); blocks of different signatures never share a stacked block."""
    if not cfg.scans:
        return LayerLayout(cfg.num_layers)
    patterns = [re.compile(p) for p in no_decay]

    def signature(i: int) -> tuple:
        decays = tuple(
            any(p.search(f"layers.{i}.{leaf}") for p in patterns) for leaf in block_params(cfg, i)
        )
        names = block_linear_names(cfg, i)
        return names, tuple(recipes[f"layers.{i}.{name}"] for name in names), decays

    signatures = [signature(i) for i in range(cfg.num_layers)]
    return LayerLayout(cfg.num_layers, groups_of(signatures, MAX_GROUP_PERIOD))


def _check_runs(cfg: ModelConfig, recipes: dict[str, nvfp4_ops.Recipe], layout: LayerLayout):
    """ValueError unless every block of every run of `layout` has the linears and recipes of
    the block it repeats (block `start + (i - start) % period` of its run's first group)."""
    if layout.num_layers != cfg.num_layers:
        raise ValueError(f"layout is of {layout.num_layers} blocks, the model has {cfg.num_layers}")
    for start, stop, period in layout.runs:
        differ = []
        for i in range(start + period, stop):
            first = start + (i - start) % period
            names, first_names = block_linear_names(cfg, i), block_linear_names(cfg, first)
            differ += [f"layers.{i}.{n}" for n in names if n not in first_names or
                       recipes[f"layers.{i}.{n}"] != recipes[f"layers.{first}.{n}"]]  # fmt: skip
            differ += [f"layers.{first}.{n}" for n in first_names if n not in names]
        if differ:
            group = f" in groups of {period}" if period > 1 else ""
            raise ValueError(
                f"layout stacks blocks {start}..{stop - 1}{group}, but {differ} differ from the "
                "blocks they repeat"
            )


class Llama(nnx.Module):
    """The decoder. `recipes` maps every path of `linear_paths(cfg)` to an `nvfp4_ops.Recipe`;
    every quantized linear runs on `backend` (`nvfp4_ops.dot_general`'s argument). `layout` says
    which blocks are stacked (default `layer_layout(cfg, recipes)`); it must fit the recipes.

    Example:
        >>> cfg = ModelConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4,
        ...                   num_kv_heads=2, mlp_dim=128)
        >>> bf16 = nvfp4_ops.get_recipe("bf16")
        >>> model = Llama(cfg, {p: bf16 for p in linear_paths(cfg)}, rngs=nnx.Rngs(0))
        >>> model(jnp.zeros((2, 8), jnp.int32)).shape
        (2, 8, 256)
    """

    def __init__(
        self,
        cfg: ModelConfig,
        recipes: dict[str, nvfp4_ops.Recipe],
        *,
        rngs: nnx.Rngs,
        backend: str | tuple[str, ...] = "auto",
        layout: LayerLayout | None = None,
    ):
        if cfg.vocab_size <= 0:
            raise ValueError(
                "model.vocab_size must be > 0 to build the model, got 0; fill it from the data "
                "with nvfp4_train.with_vocab_size(cfg, datasets.vocab_size)"
            )
        expected = set(linear_paths(cfg))
        missing, extra = sorted(expected - set(recipes)), sorted(set(recipes) - expected)
        if missing or extra:
            raise ValueError(
                f"recipes must cover exactly the linears; missing {missing}, extra {extra}"
            )
        dtype, init = cfg.compute_dtype, jax.nn.initializers.normal(stddev=cfg.init_std)
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab_size, cfg.d_model, dtype=dtype, embedding_init=init, rngs=rngs
        )
        self.layout = layer_layout(cfg, recipes) if layout is None else layout
        _check_runs(cfg, recipes, self.layout)
        # built in model order in any layout, each block drawing the same keys, so that a seed
        # gives the same weights stacked or not (`stacked_blocks.build_segment`)
        self.layers = nnx.Dict(
            {s.key: build_segment(cfg, recipes, s, rngs, backend) for s in self.layout.segments}
        )
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.rms_norm_eps, dtype=dtype)
        if not cfg.tie_embeddings:
            self.lm_head = nnx.Linear(
                cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dtype, kernel_init=init,
                preferred_element_type=jnp.float32, rngs=rngs,
            )  # fmt: skip
        if cfg.mtp.num_layers:  # built last: the other parameters draw the keys they did without
            self.mtp = MultiTokenPrediction(cfg, recipes, rngs=rngs, backend=backend)

    def __call__(
        self,
        inputs_BxL: jax.Array,
        *,
        key: jax.Array | None = None,
        segment_ids_BxL: jax.Array | None = None,
        positions_BxL: jax.Array | None = None,
        constrain=None,
        mtp: bool = False,
    ) -> jax.Array | tuple[jax.Array, tuple[jax.Array, ...]]:
        """Returns float32 logits [B, L, vocab]; with `mtp` (a model with `model.mtp` layers),
        (those logits, each MTP depth's float32 logits [B, L, vocab]: `model.mtp.layers`).

        Args:
            inputs_BxL: int token ids.
            key: The step's stochastic-rounding key; linear j of layer i gets
                `fold_in(fold_in(key, i), j)` (j in `block_linear_names` order). None passes no key
                (fine for recipes without stochastic rounding, and for the forward-only BF16 path).
            segment_ids_BxL: int document ids of packed rows: a token attends only to earlier
                tokens of its own document. None: each row is one document.
            positions_BxL: int RoPE positions (restarting at 0 in each document); None with
                segment ids: derived from them (`attention.document_positions`).
            constrain: the run's `constrain(kind, x)` (`mesh.sharding.activation_constraint`),
                which lays out the fused attention kernels' operands on its mesh; None: none.
        """
        if inputs_BxL.ndim != 2 or inputs_BxL.shape[1] > self.cfg.max_seq_len:
            raise ValueError(
                f"inputs must be [batch, length] with length <= model.max_seq_len="
                f"{self.cfg.max_seq_len}, got shape {inputs_BxL.shape}"
            )
        documents = _documents(inputs_BxL, segment_ids_BxL, positions_BxL)
        x_BxLxD = self.embed(inputs_BxL)
        policy = REMAT_POLICIES[self.cfg.remat]
        for segment in self.layout.segments:
            block = self.layers[segment.key]
            x_BxLxD = run_segment(block, segment, x_BxLxD, key, documents, policy, constrain)
        x_BxLxD = self.final_norm(x_BxLxD)
        logits_BxLxV = self._head(x_BxLxD)
        if not (mtp and self.cfg.mtp.num_layers):
            return logits_BxLxV
        depths = self.mtp(x_BxLxD, inputs_BxL, self.embed, self._head, key, documents, constrain)
        return logits_BxLxV, depths

    def _head(self, x_BxLxD: jax.Array) -> jax.Array:
        """float32 logits [B, L, vocab] of final-normed hidden states (the output head, or the
        tied embedding)."""
        if self.cfg.tie_embeddings:
            emb_VxD = self.embed.embedding[...].astype(x_BxLxD.dtype)
            return jnp.einsum("bld,vd->blv", x_BxLxD, emb_VxD, preferred_element_type=jnp.float32)
        return self.lm_head(x_BxLxD).astype(jnp.float32)


def unstacked(model: Llama) -> Llama:
    """A copy of `model` with one Block per layer (its stacked blocks and groups split, their
    parameters slices of the stacked ones) and no remat: the model as telemetry's capture mode
    sees it. An unstacked model is copied as it is."""
    copy = nnx.merge(*nnx.split(model))
    if not copy.layout.scanned and copy.cfg.remat == "none":
        return copy
    layers = {}
    for key, start, stop, period in copy.layout.segments:
        if stop - start == 1:
            layers[key] = copy.layers[key]
            continue
        for j, block in enumerate(members(copy.layers[key], period)):
            graphdef, state = nnx.split(block)
            for q, i in enumerate(range(start + j, stop, period)):
                layers[str(i)] = nnx.merge(graphdef, jax.tree.map(lambda a, q=q: a[q], state))
    copy.layers = nnx.Dict({key: layers[key] for key in sorted(layers, key=int)})
    copy.layout = LayerLayout(copy.cfg.num_layers)
    copy.cfg = dataclasses.replace(copy.cfg, scan_layers=False, remat="none")
    return copy


def linear_keys(cfg: ModelConfig, key: jax.Array | None) -> dict[str, jax.Array | None]:
    """The stochastic-rounding key each linear gets from `Llama.__call__(..., key=key)`, by path
    (an MTP layer's: those of the last depth it runs at, `model.mtp.layers`)."""
    keys = {}
    for i in range(cfg.num_layers):
        for name, linear_key in zip(block_linear_names(cfg, i), layer_keys(key, i), strict=False):
            keys[f"layers.{i}.{name}"] = linear_key
    mtp, size = cfg.mtp, len(cfg.mtp.pattern)
    for t in range(mtp.resolved_depths if mtp.num_layers else 0):
        for p in range(size):
            j = mtp.module_of_depth(t) * size + p
            depth_keys = layer_keys(key, cfg.num_layers + t * size + p)
            for name, linear_key in zip(mtp_linear_names(cfg, j), depth_keys, strict=False):
                keys[f"mtp.layers.{j}.{name}"] = linear_key
    return keys


def _documents(
    inputs_BxL: jax.Array, segment_ids_BxL: jax.Array | None, positions_BxL: jax.Array | None
) -> Documents | None:
    """(segment ids, positions) for the blocks, or None (one document per row)."""
    if segment_ids_BxL is None:
        if positions_BxL is not None:
            raise ValueError("positions_BxL needs segment_ids_BxL (the documents they count in)")
        return None
    if segment_ids_BxL.shape != inputs_BxL.shape:
        raise ValueError(
            f"segment_ids_BxL must have the inputs' shape {inputs_BxL.shape}, got "
            f"{segment_ids_BxL.shape}"
        )
    if positions_BxL is None:
        positions_BxL = document_positions(segment_ids_BxL)
    return segment_ids_BxL, positions_BxL
