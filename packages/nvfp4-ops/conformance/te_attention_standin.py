"""A CPU stand-in for the cuDNN kernel behind TransformerEngine's fused attention.

TE's JAX fused attention (`transformer_engine.jax.attention.fused_attn`) is pure JAX down to two
primitives, `te_fused_attn_forward_ffi` and `te_fused_attn_backward_ffi`, whose "inner" forms are
lowered to cuDNN custom calls for CUDA only. Everything above them runs on CPU over the stand-in
extension of `te_standin.py`: the `SequenceDescriptor`, the custom VJP and its checkpoint names,
the choice of primitive (context parallel or not), `custom_partitioning` with TE's sharding rule
and partition functions, and TE's conversion of documents into cuDNN's ragged (THD) sequence
lengths and token offsets. `install_kernel()` registers a CPU lowering for the two inner
primitives that computes what cuDNN is asked to compute, from exactly the operands TE hands
cuDNN (after partitioning: each device's shard):

- q, k, v as [B, T, heads, head_dim] token arrays, flattened to B*T tokens;
- `cu_seqlens` [S + 1] (cumulative lengths of the S = B * max_segments slots) and `seq_offsets`
  (each slot's first token in the flattened array);
- query head h attends with kv head h // (heads / kv_heads) of the SAME shard (cuDNN's GQA);
- a token attends to the tokens of its own slot up to itself (top-left causal, TE's
  PADDING_CAUSAL_MASK); a token in no slot gets output 0 and gradient 0.

This is our model of the kernel's contract, not the kernel: it shows whether TE's JAX layers
hand cuDNN the right operands (sharding, heads, sequence slots), never how cuDNN computes.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
from jax.interpreters import mlir


def _slots(cu_seqlens, offsets, tokens: int):
    """(slot of each token or -1, position in its slot) for `tokens` flattened tokens."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = offsets.reshape(-1)[: lengths.size]
    index = jnp.arange(tokens)[:, None]
    inside = (index >= starts[None]) & (index < (starts + lengths)[None]) & (lengths[None] > 0)
    slot = jnp.where(inside.any(1), jnp.argmax(inside, axis=1), -1)
    return slot, index[:, 0] - jnp.where(slot >= 0, starts[jnp.maximum(slot, 0)], 0)


def reference(q, k, v, q_cu, kv_cu, q_offsets, kv_offsets, scale: float):
    """(output like q, float32 log-sum-exp [B, T, heads, 1]) of causal attention within slots."""
    b, t, h, d = q.shape
    g = k.shape[2]
    q_slot, q_pos = _slots(q_cu, q_offsets, b * t)
    k_slot, k_pos = _slots(kv_cu, kv_offsets, b * t)
    allowed = (q_slot[:, None] == k_slot[None]) & (q_slot[:, None] >= 0)
    allowed &= k_pos[None] <= q_pos[:, None]
    qf = q.reshape(b * t, g, h // g, d).astype(jnp.float32)
    kf, vf = (x.reshape(b * t, g, d).astype(jnp.float32) for x in (k, v))
    scores = jnp.einsum("qgrd,kgd->grqk", qf, kf) * scale
    scores = jnp.where(allowed, scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)
    probs = jnp.where(allowed, jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0)[..., None]), 0)
    out = jnp.einsum("grqk,kgd->qgrd", probs, vf).reshape(b, t, h, d)
    lse = jnp.moveaxis(lse.reshape(h, b * t), 0, 1).reshape(b, t, h, 1)
    return out.astype(q.dtype), jnp.where(jnp.isfinite(lse), lse, 0.0)


def _check(config) -> None:
    attention = importlib.import_module("transformer_engine.jax.attention")
    if config.attn_mask_type != attention.AttnMaskType.PADDING_CAUSAL_MASK:
        raise NotImplementedError(f"stand-in kernel: only PADDING_CAUSAL_MASK, got {config}")
    if not config.qkv_layout.is_thd() or not config.qkv_layout.is_separate():
        raise NotImplementedError(f"stand-in kernel: only THD_THD_THD, got {config.qkv_layout}")


def _forward_lowering(ctx, *operands, config):
    _check(config)
    avals = ctx.avals_out  # output, softmax_aux, max_tensor, rng_state, workspace

    def forward(q, k, v, _bias, _offset, _seed, q_cu, kv_cu, q_off, kv_off, *_segments):
        out, lse = reference(q, k, v, q_cu, kv_cu, q_off, kv_off, float(config.scaling_factor))
        rest = [jnp.zeros(a.shape, a.dtype) for a in avals[2:]]
        return [out, lse.reshape(avals[1].shape).astype(avals[1].dtype), *rest]

    return mlir.lower_fun(forward, multiple_results=True)(ctx, *operands)


def _backward_lowering(ctx, *operands, config):
    _check(config)
    avals = ctx.avals_out  # dq, dk, dv, dbias, dsoftmax_offset, workspace

    def backward(q, k, v, _bias, _offset, _aux, _rng, _out, dout, q_cu, kv_cu, q_off, kv_off,
                 *_segments):  # fmt: skip
        def attend(q, k, v):
            scale = float(config.scaling_factor)
            return reference(q, k, v, q_cu, kv_cu, q_off, kv_off, scale)[0]

        _, vjp = jax.vjp(attend, q, k, v)
        return [*vjp(dout), *(jnp.zeros(a.shape, a.dtype) for a in avals[3:])]

    return mlir.lower_fun(backward, multiple_results=True)(ctx, *operands)


def install_kernel() -> None:
    """Registers the stand-in as the CPU lowering of TE's fused-attention inner primitives
    (after `te_standin.import_te_jax`)."""
    cpp = importlib.import_module("transformer_engine.jax.cpp_extensions.attention")
    mlir.register_lowering(cpp.FusedAttnFwdPrimitive.inner_primitive, _forward_lowering, "cpu")
    mlir.register_lowering(cpp.FusedAttnBwdPrimitive.inner_primitive, _backward_lowering, "cpu")
