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
Layer indices `i` are string keys "0", "1", ... in the parameter dict. With `scan_layers`, runs of
blocks that compute alike are stored stacked instead (`layers.{first}-{last}...`, a leading layer
axis; see `nvfp4_train.model.stacking`) and run under `jax.lax.scan`; `remat` recomputes each block's
activations in the backward pass according to a `jax.checkpoint` policy.
Its configuration (`ModelConfig`, `block_linear_names`, `linear_paths`, ...): `nvfp4_train.model.config`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import nvfp4_ops
from nvfp4_train.model.blocks.attention import document_positions
from nvfp4_train.model.blocks.block import Block
from nvfp4_train.model.blocks.linear import INPUT_AMAX, sow_input_amax
from nvfp4_train.model.blocks.norms import RMSNorm
from nvfp4_train.model.blocks.self_attention import Documents
from nvfp4_train.model.config import (
    BLOCK_KEYS,
    REMAT_POLICIES,
    ModelConfig,
    block_linear_names,
    block_params,
    linear_paths,
)
from nvfp4_train.model.layer_groups import runs_of
from nvfp4_train.model.stacking import LayerLayout


def layer_layout(
    cfg: ModelConfig, recipes: dict[str, nvfp4_ops.Recipe], no_decay: Sequence[str] = ()
) -> LayerLayout:
    """Which blocks are stacked: with `cfg.scans`, every run of >= 2 consecutive blocks whose
    four linears have the same recipes and whose parameters match the same `no_decay` patterns
    (the optimizer's weight-decay exclusions, searched in `layers.{i}.attn_norm.scale` etc.);
    dense and MoE blocks are never stacked together."""
    if not cfg.scans:
        return LayerLayout(cfg.num_layers)
    patterns = [re.compile(p) for p in no_decay]

    def signature(i: int) -> tuple:
        decays = tuple(
            any(p.search(f"layers.{i}.{leaf}") for p in patterns) for leaf in block_params(cfg, i)
        )
        names = block_linear_names(cfg, i)
        return names, tuple(recipes[f"layers.{i}.{name}"] for name in names), decays

    return LayerLayout(cfg.num_layers, runs_of([signature(i) for i in range(cfg.num_layers)]))


def _traced(rngs: nnx.Rngs) -> bool:
    """Whether `rngs` holds tracers: the model is being built inside `jax.jit` (or another
    transformation) rather than op by op."""
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(nnx.state(rngs)))


def _blocks_one_by_one(
    cfg: ModelConfig,
    recipes: dict[str, nvfp4_ops.Recipe],
    start: int,
    stop: int,
    rngs: nnx.Rngs,
    backend: str | tuple[str, ...],
) -> Block:
    """Blocks `start` .. `stop - 1` built one after another and stacked along a new leading axis:
    the eager (op-by-op) init, which rounds `init_std * normal` as the unstacked eager init does
    (a compiled scan fuses the product and may round it one ulp apart)."""
    blocks = [Block(cfg, recipes, i, rngs=rngs, backend=backend) for i in range(start, stop)]
    graphdef, _ = nnx.split(blocks[0])
    states = [nnx.split(block)[1] for block in blocks]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


def _scanned_blocks(
    cfg: ModelConfig,
    recipes: dict[str, nvfp4_ops.Recipe],
    start: int,
    stop: int,
    rngs: nnx.Rngs,
    backend: str | tuple[str, ...],
) -> Block:
    """Blocks `start` .. `stop - 1` (alike: one graph) as ONE Block whose variables have a
    leading layer axis, initialised by a `jax.lax.scan` over the layers, so that the init
    program holds one block whatever the depth. The scan carries the state of `rngs` (every
    stream's key and counter): each block draws the keys it would draw built on its own after
    the blocks before it, and `rngs` is left where building them one by one would leave it.
    Under `jax.jit` the values are bit for bit those of `_blocks_one_by_one` under `jax.jit`."""
    rngs_graphdef, rngs_state = nnx.split(rngs)
    graphdefs = []

    def build(state: Any, _: None) -> tuple[Any, Any]:
        layer_rngs = nnx.merge(rngs_graphdef, state)
        graphdef, block_state = nnx.split(
            Block(cfg, recipes, start, rngs=layer_rngs, backend=backend)
        )
        graphdefs.append(graphdef)
        return nnx.state(layer_rngs), block_state

    rngs_state, stacked = jax.lax.scan(build, rngs_state, length=stop - start)
    nnx.update(rngs, rngs_state)
    return nnx.merge(graphdefs[0], stacked)


def _resow(module: nnx.Module, sown: dict[str, Any]) -> None:
    """Sows the values of `sown` (a pure dict as a block's capture returns it) on the same
    submodules of `module` (with a leading layer axis for a stacked block): `INPUT_AMAX`
    max-reduced with what is there, every other statistic (an MoE block's) as it is."""
    for name, value in sown.items():
        if name == INPUT_AMAX:
            sow_input_amax(module, value)
        elif isinstance(value, dict):
            _resow(getattr(module, name), value)
        else:
            module.sow(nnx.Intermediate, name, value, reduce_fn=lambda _, new: new)


def _block_fn(graphdef: nnx.GraphDef, policy: Any, constrain=None):
    """`f(params, rest, x, keys, documents) -> (y, sown input amax)`: one block as a pure
    function, under `jax.checkpoint(policy=policy)` when a policy is given; `constrain` as in
    `Llama.__call__`."""

    def apply(params, rest, x_BxLxD, keys, documents):
        block = nnx.merge(graphdef, params, rest)
        y, sown = nnx.capture(block, nnx.Intermediate)(x_BxLxD, keys, documents, constrain)
        return y, nnx.to_pure_dict(sown)

    return apply if policy is None else jax.checkpoint(apply, policy=policy)


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
        if self.layout.num_layers != cfg.num_layers:
            raise ValueError(
                f"layout is of {self.layout.num_layers} blocks, the model has {cfg.num_layers}"
            )
        for start, stop in self.layout.runs:
            differ = [
                f"layers.{i}.{n}" for i in range(start + 1, stop)
                for n in block_linear_names(cfg, i)
                if recipes[f"layers.{i}.{n}"] != recipes.get(f"layers.{start}.{n}")
            ]  # fmt: skip
            if differ:
                raise ValueError(f"layout stacks blocks {start}..{stop - 1}, but {differ} differ")
        # built in model order in any layout, each block drawing the same keys, so that a seed
        # gives the same weights stacked or not; under a trace (the run's jitted init) a run of
        # stacked blocks is built by one scanned init, whose program does not grow with depth
        build_run = _scanned_blocks if _traced(rngs) else _blocks_one_by_one
        self.layers = nnx.Dict(
            {
                key: Block(cfg, recipes, start, rngs=rngs, backend=backend)
                if stop - start == 1
                else build_run(cfg, recipes, start, stop, rngs, backend)
                for key, start, stop in self.layout.entries
            }
        )
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.rms_norm_eps, dtype=dtype)
        if not cfg.tie_embeddings:
            self.lm_head = nnx.Linear(
                cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dtype, kernel_init=init,
                preferred_element_type=jnp.float32, rngs=rngs,
            )  # fmt: skip

    def __call__(
        self,
        inputs_BxL: jax.Array,
        *,
        key: jax.Array | None = None,
        segment_ids_BxL: jax.Array | None = None,
        positions_BxL: jax.Array | None = None,
        constrain=None,
    ) -> jax.Array:
        """Returns float32 logits [B, L, vocab].

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
        for name, start, stop in self.layout.entries:
            block = self.layers[name]
            if stop - start == 1 and policy is None:
                x_BxLxD = block(x_BxLxD, _layer_keys(key, start), documents, constrain)
                continue
            graphdef, params, rest = nnx.split(block, nnx.Param, ...)
            apply = _block_fn(graphdef, policy, constrain)
            if stop - start == 1:
                x_BxLxD, sown = apply(params, rest, x_BxLxD, _layer_keys(key, start), documents)
            else:
                x_BxLxD, sown = _scan(apply, params, rest, x_BxLxD, key, start, stop, documents)
            _resow(block, sown)
        x_BxLxD = self.final_norm(x_BxLxD)
        if self.cfg.tie_embeddings:
            emb_VxD = self.embed.embedding[...].astype(x_BxLxD.dtype)
            return jnp.einsum("bld,vd->blv", x_BxLxD, emb_VxD, preferred_element_type=jnp.float32)
        return self.lm_head(x_BxLxD).astype(jnp.float32)


def unstacked(model: Llama) -> Llama:
    """A copy of `model` with one Block per layer (its stacked blocks split, their parameters
    slices of the stacked ones) and no remat: the model as telemetry's capture mode sees it.
    An unstacked model is copied as it is."""
    copy = nnx.merge(*nnx.split(model))
    if not copy.layout.scanned and copy.cfg.remat == "none":
        return copy
    layers = {}
    for key, start, stop in copy.layout.entries:
        if stop - start == 1:
            layers[key] = copy.layers[key]
            continue
        graphdef, state = nnx.split(copy.layers[key])
        for j in range(stop - start):
            layers[str(start + j)] = nnx.merge(graphdef, jax.tree.map(lambda a, j=j: a[j], state))
    copy.layers = nnx.Dict(layers)
    copy.layout = LayerLayout(copy.cfg.num_layers)
    copy.cfg = dataclasses.replace(copy.cfg, scan_layers=False, remat="none")
    return copy


def linear_keys(cfg: ModelConfig, key: jax.Array | None) -> dict[str, jax.Array | None]:
    """The stochastic-rounding key each linear gets from `Llama.__call__(..., key=key)`, by path."""
    keys = {}
    for i in range(cfg.num_layers):
        for name, linear_key in zip(block_linear_names(cfg, i), _layer_keys(key, i), strict=False):
            keys[f"layers.{i}.{name}"] = linear_key
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


def _scan(apply, params, rest, x_BxLxD, key, start: int, stop: int, documents=None):
    """Runs the stacked blocks `start` .. `stop - 1` over `x` with `jax.lax.scan`; each gets the
    keys it would get unstacked. Returns (x, sown input amax with a leading layer axis)."""
    if key is None:
        keys = None
    else:  # one batched derivation (fold_in of a traced index is the same as of an int)
        keys = jax.vmap(lambda i: jnp.stack(_layer_keys(key, i)))(jnp.arange(start, stop))

    def body(x, xs):
        layer_params, layer_keys = xs
        layer_keys = (None,) * BLOCK_KEYS if layer_keys is None else tuple(layer_keys)
        return apply(layer_params, rest, x, layer_keys, documents)

    return jax.lax.scan(body, x_BxLxD, (params, keys))


def _layer_keys(key: jax.Array | None, layer: int) -> tuple[jax.Array | None, ...]:
    if key is None:
        return (None,) * BLOCK_KEYS
    layer_key = jax.random.fold_in(key, layer)
    return tuple(jax.random.fold_in(layer_key, j) for j in range(BLOCK_KEYS))
