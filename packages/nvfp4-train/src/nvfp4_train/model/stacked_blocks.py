"""The stacked blocks of a scanned decoder (`model.scan_layers`; the storage: `model.stacking`):
built with a leading axis of repetitions, run under `jax.lax.scan`, their statistics sown back.

A stored entry (`stacking.Segment`) of period 1 holding r blocks is ONE `Block` whose variables
carry a leading axis of r; one of period p > 1 is an `nnx.Dict` {"0": Block, ..., "p-1": Block}
(block j built as block `start + j`), each with a leading axis of the r repetitions of the group.
A block stored alone is a plain `Block`. Either way each block draws, at init, the keys it would
draw built on its own in model order, and gets, in the forward, the SR keys it would get on its
own (`layer_keys`), so a seed and a step key give the same numbers stacked or not.

Example:
    >>> from nvfp4_train.model.config import ModelConfig, linear_paths
    >>> from nvfp4_train.model.stacking import Segment
    >>> cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=4, num_heads=2, num_kv_heads=1,
    ...                   mlp_dim=64)
    >>> recipes = {p: nvfp4_ops.get_recipe("bf16") for p in linear_paths(cfg)}
    >>> group = build_segment(cfg, recipes, Segment("0-3/2", 0, 4, 2), nnx.Rngs(0), "auto")
    >>> sorted(group.keys()), group["1"].attn.qkv.kernel.shape
    (['0', '1'], (2, 32, 64))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import nvfp4_ops
from nvfp4_train.model.blocks.block import Block, MixerBlock, make_block
from nvfp4_train.model.blocks.linear import INPUT_AMAX, sow_input_amax
from nvfp4_train.model.config import BLOCK_KEYS, ModelConfig
from nvfp4_train.model.stacking import Segment


def layer_keys(key: jax.Array | None, layer: int) -> tuple[jax.Array | None, ...]:
    """The SR keys of block `layer`'s linears: `fold_in(fold_in(key, layer), j)`, j < BLOCK_KEYS
    (all None without a key)."""
    if key is None:
        return (None,) * BLOCK_KEYS
    layer_key = jax.random.fold_in(key, layer)
    return tuple(jax.random.fold_in(layer_key, j) for j in range(BLOCK_KEYS))


def _group(blocks: Sequence[Block | MixerBlock]) -> nnx.Module:
    """The module that stores one repetition of a group: the block itself for a group of one."""
    return blocks[0] if len(blocks) == 1 else nnx.Dict({str(j): b for j, b in enumerate(blocks)})


def members(stored: nnx.Module, period: int) -> tuple[Block | MixerBlock, ...]:
    """The blocks of a stored entry of period `period`, in the order they run."""
    return (stored,) if period == 1 else tuple(stored[str(j)] for j in range(period))


def _traced(rngs: nnx.Rngs) -> bool:
    """Whether `rngs` holds tracers: the model is being built inside `jax.jit` (or another
    transformation) rather than op by op."""
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(nnx.state(rngs)))


def build_segment(
    cfg: ModelConfig,
    recipes: dict[str, nvfp4_ops.Recipe],
    segment: Segment,
    rngs: nnx.Rngs,
    backend: str | tuple[str, ...],
) -> nnx.Module:
    """The module stored for `segment`: a Block for a block alone; for a run, under a trace
    (the run's jitted init) one scanned init whose program does not grow with depth, op by op
    the blocks built one after another (`_blocks_one_by_one`)."""
    if segment.stop - segment.start == 1:
        return make_block(cfg, recipes, segment.start, rngs=rngs, backend=backend)
    build = _scanned_blocks if _traced(rngs) else _blocks_one_by_one
    return build(cfg, recipes, segment, rngs, backend)


def _stack(graphdef: nnx.GraphDef, states: Sequence[Any]) -> nnx.Module:
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


def _blocks_one_by_one(
    cfg: ModelConfig,
    recipes: dict[str, nvfp4_ops.Recipe],
    segment: Segment,
    rngs: nnx.Rngs,
    backend: str | tuple[str, ...],
) -> nnx.Module:
    """The blocks of `segment` built one after another in model order, each repetition of its
    group stacked along a new leading axis: the eager (op-by-op) init, which rounds
    `init_std * normal` as the unstacked eager init does (a compiled scan fuses the product and
    may round it one ulp apart)."""
    start, stop, period = segment.start, segment.stop, segment.period
    blocks = [make_block(cfg, recipes, i, rngs=rngs, backend=backend) for i in range(start, stop)]
    groups = [_group(blocks[q : q + period]) for q in range(0, stop - start, period)]
    return _stack(nnx.split(groups[0])[0], [nnx.split(group)[1] for group in groups])


def _scanned_blocks(
    cfg: ModelConfig,
    recipes: dict[str, nvfp4_ops.Recipe],
    segment: Segment,
    rngs: nnx.Rngs,
    backend: str | tuple[str, ...],
) -> nnx.Module:
    """The blocks of `segment` (each repetition of its group alike: one graph) with a leading
    axis of repetitions, initialised by a `jax.lax.scan` over the repetitions whose body builds
    the group's blocks in order, so that the init program holds one group whatever the depth.
    The scan carries the state of `rngs` (every stream's key and counter): each block draws the
    keys it would draw built on its own after the blocks before it, and `rngs` is left where
    building them one by one would leave it. Under `jax.jit` the values are bit for bit those
    of `_blocks_one_by_one` under `jax.jit`."""
    rngs_graphdef, rngs_state = nnx.split(rngs)
    graphdefs = []

    def build(state: Any, _: None) -> tuple[Any, Any]:
        layer_rngs = nnx.merge(rngs_graphdef, state)
        blocks = [
            make_block(cfg, recipes, segment.start + j, rngs=layer_rngs, backend=backend)
            for j in range(segment.period)
        ]
        graphdef, group_state = nnx.split(_group(blocks))
        graphdefs.append(graphdef)
        return nnx.state(layer_rngs), group_state

    rngs_state, stacked = jax.lax.scan(build, rngs_state, length=segment.repeats)
    nnx.update(rngs, rngs_state)
    return nnx.merge(graphdefs[0], stacked)


def _resow(module: nnx.Module, sown: dict[str, Any]) -> None:
    """Sows the values of `sown` (a pure dict as a block's capture returns it) on the same
    submodules of `module` (with a leading axis of repetitions for a stacked block): `INPUT_AMAX`
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


def run_segment(
    stored: nnx.Module, segment: Segment, x_BxLxD: jax.Array, key, documents, policy, constrain
) -> jax.Array:
    """`x` after the blocks of `segment` (stored as `stored`), each under `jax.checkpoint` with
    the remat `policy` when one is given (per block, as unstacked); what they sow (input amax,
    MoE statistics) is sown back on `stored`'s blocks, with a leading axis of repetitions."""
    start, stop = segment.start, segment.stop
    if stop - start == 1 and policy is None:
        return stored(x_BxLxD, layer_keys(key, start), documents, constrain)
    blocks = members(stored, segment.period)
    graphdefs, params, rests = zip(*(nnx.split(b, nnx.Param, ...) for b in blocks), strict=True)
    applies = tuple(_block_fn(graphdef, policy, constrain) for graphdef in graphdefs)
    if stop - start == 1:
        x_BxLxD, sown = applies[0](params[0], rests[0], x_BxLxD, layer_keys(key, start), documents)
        sowns = (sown,)
    else:
        x_BxLxD, sowns = scan_segment(applies, params, rests, x_BxLxD, key, segment, documents)
    for block, sown in zip(blocks, sowns, strict=True):
        _resow(block, sown)
    return x_BxLxD


def scan_segment(applies, params, rests, x_BxLxD, key, segment: Segment, documents=None):
    """Runs the stacked blocks of `segment` over `x` with one `jax.lax.scan` over the
    repetitions of its group, whose body applies the group's blocks in order:
    `applies[j](params[j][q], rests[j], x, keys, documents) -> (x, sown)` (`_block_fn`) for
    block j of repetition q, with the keys block `start + q*period + j` gets unstacked
    (`layer_keys`). Returns (x, one sown tree per block of the group, each with a leading axis
    of repetitions).

    Example:
        >>> apply = lambda p, rest, x, keys, docs: (x + p, {"at": x})
        >>> x, (first, second) = scan_segment(
        ...     (apply, apply), (jnp.array([1.0, 4.0]), jnp.array([2.0, 8.0])), (None, None),
        ...     jnp.zeros(()), None, Segment("0-3/2", 0, 4, 2))
        >>> x.item(), first["at"].tolist(), second["at"].tolist()
        (15.0, [0.0, 3.0], [1.0, 7.0])
    """
    if key is None:
        keys = None
    else:  # one batched derivation (fold_in of a traced index is the same as of an int)
        layers = jnp.arange(segment.start, segment.stop)
        keys = jax.vmap(lambda i: jnp.stack(layer_keys(key, i)))(layers)
        keys = keys.reshape(segment.repeats, segment.period, *keys.shape[1:])

    def body(x_BxLxD, xs):
        group_params, group_keys = xs
        sowns = []
        for j, apply in enumerate(applies):
            keys_j = (None,) * BLOCK_KEYS if group_keys is None else tuple(group_keys[j])
            x_BxLxD, sown = apply(group_params[j], rests[j], x_BxLxD, keys_j, documents)
            sowns.append(sown)
        return x_BxLxD, tuple(sowns)

    return jax.lax.scan(body, x_BxLxD, (params, keys))
