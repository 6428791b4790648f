"""A NumPy Llama forward pass that mirrors the training model's numerics (for verify and calibration).

Mirrors `nvfp4_train`'s model in float32 with rounding to the compute dtype at the same points:
embedding lookup, RMSNorm output, each linear's output, RoPE output, attention probabilities and
output, SwiGLU product and each residual sum. Quantized linears use the exported (dequantized)
weights; their input is either left as is (weight-only, what a W4A16 server computes), quantized
per call with its own amax (what training computes: "dynamic"), or quantized with a fixed amax
(the exported input scale: "static"). Logits are float32 [B, L, V]. A hybrid (`nemotron_h`)
model's blocks are `x + mixer(norm(x))`: attention without RoPE, the squared-ReLU MLP or the
Mamba-2 mixer (`mamba_forward`).
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from nvfp4_export.formats import FORMATS
from nvfp4_export.mamba_forward import mamba_mixer
from nvfp4_export.model_spec import LlamaSpec

ACTIVATION_MODES = ("none", "dynamic", "static")
_ROUND = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


@dataclasses.dataclass(frozen=True)
class ForwardLinear:
    """One training linear (fused q|k|v and gate|up as one matrix).

    Attributes:
        w_OxI: float32 [out, in] weight values the model multiplies with.
        act_fmt: a `formats.FORMATS` name ("nvfp4", "mxfp4": the recipe quantizes the input) or
            "none".
        act_amax: the fixed input amax for "static" activations (formats with
            `calibrated_input`, NVFP4), or None.
        served_act_fmt: the input format a server applies with the static scale when it is
            not the trained one (an FP8 stand-in of an MXFP8 linear: "fp8"), or None.
    """

    w_OxI: np.ndarray
    act_fmt: str = "none"
    act_amax: float | None = None
    served_act_fmt: str | None = None


@dataclasses.dataclass(frozen=True)
class ForwardWeights:
    """All weights of the decoder, float32, HF orientation ([out, in]; embeddings [V, D]).

    `layers[i]` maps "attn_norm", "mlp_norm" to [D] scales and "qkv", "o", "gate_up", "down" to
    `ForwardLinear`s; per the spec also "qkv_bias" [(H + 2G) * K], "o_bias" [D] and "q_norm",
    "k_norm" [K]. A hybrid block has "norm" [D] and its mixer's: "qkv", "o"; "up", "down"; or
    "in_proj", "out_proj" and the Mamba tensors (`mamba_forward`). An MoE block has instead of "gate_up" / "down": "router" [E, D],
    "experts_gate_up" and "experts_down" (a `ForwardLinear` per expert), and with a shared expert
    "shared_gate_up", "shared_down" and optionally "shared_gate" [1, D].
    """

    spec: LlamaSpec
    embed_VxD: np.ndarray
    final_norm: np.ndarray
    lm_head_VxD: np.ndarray
    layers: tuple[dict, ...]


def _rounder(dtype: str):
    if dtype not in _ROUND:
        return lambda x: np.asarray(x, np.float32)
    target = _ROUND[dtype]
    return lambda x: np.asarray(x, np.float32).astype(target).astype(np.float32)


def _rms_norm(x, scale, eps, rnd):
    inv = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32) + np.float32(eps))
    return rnd(x * inv.astype(np.float32) * scale)


def _quantize_input(x_NxK: np.ndarray, lin: ForwardLinear, mode: str) -> np.ndarray:
    if mode == "none" or lin.act_fmt == "none":
        return x_NxK
    f = FORMATS[lin.served_act_fmt if mode == "static" and lin.served_act_fmt else lin.act_fmt]
    amax = None
    if mode == "static" and f.calibrated_input:
        if lin.act_amax is None:
            raise ValueError(
                f"activations='static' needs act_amax on every {f.label} linear, got None"
            )
        amax = np.float32(lin.act_amax)
    return f.quantize_input(x_NxK, amax)


def _linear(x_BxLxI, lin: ForwardLinear, mode: str, rnd, amax_out: dict | None, key: str,
            bias=None):  # fmt: skip
    b, l, k = x_BxLxI.shape
    x = x_BxLxI.reshape(b * l, k)
    if amax_out is not None:
        amax_out[key] = max(amax_out.get(key, 0.0), float(np.max(np.abs(x))) if x.size else 0.0)
    x = _quantize_input(x, lin, mode)
    y = x @ lin.w_OxI.T
    if bias is not None:
        y = y + np.asarray(bias, np.float32)
    return rnd(y.reshape(b, l, -1))


def _rope_tables(length: int, spec: LlamaSpec):
    inv_freq = spec.rope_inv_freq()
    freqs = np.arange(length, dtype=np.float32)[:, None] * inv_freq[None, :].astype(np.float32)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def _rope(x_BxLxHxD, cos, sin, rnd):
    half = x_BxLxHxD.shape[-1] // 2
    rotated = np.concatenate([-x_BxLxHxD[..., half:], x_BxLxHxD[..., :half]], axis=-1)
    return rnd(x_BxLxHxD * cos[None, :, None, :] + rotated * sin[None, :, None, :])


def _attention(q_BxLxHxD, k_BxLxGxD, v_BxLxGxD, rnd):
    b, l, h, d = q_BxLxHxD.shape
    g = k_BxLxGxD.shape[2]
    q = q_BxLxHxD.reshape(b, l, g, h // g, d)
    scores = np.einsum("blgrk,bsgk->bgrls", q, k_BxLxGxD) / np.sqrt(np.float32(d))
    causal = np.tril(np.ones((l, l), dtype=bool))
    scores = np.where(causal, scores, np.finfo(np.float32).min).astype(np.float32)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = rnd(scores / scores.sum(axis=-1, keepdims=True))
    out = np.einsum("bgrls,bsgk->blgrk", probs, v_BxLxGxD).astype(np.float32)
    return rnd(out.reshape(b, l, h, d))


def _self_attention(h, layer: dict, i: int, s: LlamaSpec, mode, rnd, amax_out, tables):
    """The attention mixer of block `i` on normed `h`; `tables` (cos, sin) or None: no RoPE."""
    nh, nkv, hd = s.num_heads, s.num_kv_heads, s.head_dim
    b, l, _ = h.shape
    qkv = _linear(h, layer["qkv"], mode, rnd, amax_out, f"layers.{i}.attn.qkv",
                  layer.get("qkv_bias"))  # fmt: skip
    q, k, v = np.split(qkv, [nh * hd, (nh + nkv) * hd], axis=-1)
    q, k = q.reshape(b, l, nh, hd), k.reshape(b, l, nkv, hd)
    if s.qk_norm:
        q = _rms_norm(q, layer["q_norm"], s.rms_norm_eps, rnd)
        k = _rms_norm(k, layer["k_norm"], s.rms_norm_eps, rnd)
    if tables is not None:
        cos, sin = tables
        q, k = _rope(q, cos[:l], sin[:l], rnd), _rope(k, cos[:l], sin[:l], rnd)
    att = _attention(q, k, v.reshape(b, l, nkv, hd), rnd).reshape(b, l, nh * hd)
    return _linear(att, layer["o"], mode, rnd, amax_out, f"layers.{i}.attn.o", layer.get("o_bias"))


def _hybrid_block(x, layer: dict, i: int, w: ForwardWeights, mode, rnd, amax_out, tables):
    """x + mixer(norm(x)) of hybrid block `i` (training's `MixerBlock`)."""
    s = w.spec
    h = _rms_norm(x, layer["norm"], s.rms_norm_eps, rnd)
    kind = s.hybrid.kind(i)
    if kind == "attention":
        return rnd(x + _self_attention(h, layer, i, s, mode, rnd, amax_out, None))
    prefix = f"layers.{i}.{'mamba' if kind == 'mamba' else 'mlp'}."

    def linear(v, name):
        return _linear(v, layer[name], mode, rnd, amax_out, prefix + name)

    if kind == "mamba":
        return rnd(x + mamba_mixer(h, layer, s, rnd, linear))
    r = np.maximum(linear(h, "up"), np.float32(0))  # squared ReLU, float32
    return rnd(x + linear(rnd(r * r), "down"))


def _block(x, layer: dict, i: int, w: ForwardWeights, mode, rnd, amax_out, tables):
    if w.spec.hybrid:
        return _hybrid_block(x, layer, i, w, mode, rnd, amax_out, tables)
    s = w.spec
    h = _rms_norm(x, layer["attn_norm"], s.rms_norm_eps, rnd)
    x = rnd(x + _self_attention(h, layer, i, s, mode, rnd, amax_out, tables))
    h = _rms_norm(x, layer["mlp_norm"], s.rms_norm_eps, rnd)
    if "router" in layer:
        return rnd(x + _moe(h, layer, i, s, mode, rnd, amax_out))
    gate, up = np.split(
        _linear(h, layer["gate_up"], mode, rnd, amax_out, f"layers.{i}.mlp.gate_up"), 2, axis=-1
    )
    hidden = rnd(gate / (1.0 + np.exp(-gate)) * up)
    return rnd(x + _linear(hidden, layer["down"], mode, rnd, amax_out, f"layers.{i}.mlp.down"))


def _swiglu_mlp(h, gate_up: ForwardLinear, down: ForwardLinear, mode, rnd, amax_out, key):
    gate, up = np.split(_linear(h, gate_up, mode, rnd, amax_out, f"{key}.gate_up"), 2, axis=-1)
    hidden = rnd(gate / (1.0 + np.exp(-gate)) * up)
    return _linear(hidden, down, mode, rnd, amax_out, f"{key}.down")


def _route(x_TxD: np.ndarray, router_ExD: np.ndarray, spec: LlamaSpec):
    """(experts [T, k], combine weights [T, k]): float32 softmax top-k, ties to the lower index,
    renormalised with `norm_topk_prob` (training's `model.routing.route`)."""
    logits = x_TxD.astype(np.float64) @ router_ExD.astype(np.float64).T
    logits = logits.astype(np.float32)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True)).astype(np.float32)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, : spec.experts_per_token]
    weights = np.take_along_axis(probs, experts, axis=-1)
    if spec.norm_topk_prob:
        weights = (weights / weights.sum(-1, keepdims=True)).astype(np.float32)
    return experts, weights


def _record(amax_out: dict | None, key: str, expert: int, count: int, x: np.ndarray) -> None:
    if amax_out is not None:
        values = list(amax_out.get(key) or [0.0] * count)
        values[expert] = max(values[expert], float(np.max(np.abs(x))) if x.size else 0.0)
        amax_out[key] = values


def _moe(h, layer: dict, i: int, s: LlamaSpec, mode, rnd, amax_out):
    """The MoE MLP of block `i` (training's `model.moe.MoEMLP`): router, each expert on its own
    tokens (its input quantized with its own amax), combine in slot order in float32."""
    b, l, d = h.shape
    x = h.reshape(b * l, d)
    experts, weights = _route(x, layer["router"], s)
    y_TxKxD = np.zeros((b * l, experts.shape[1], d), np.float32)
    key = f"layers.{i}.mlp.experts"
    for e, (gate_up, down) in enumerate(zip(layer["experts_gate_up"], layer["experts_down"],
                                            strict=True)):  # fmt: skip
        tokens, slots = np.nonzero(experts == e)
        if tokens.size == 0:
            continue
        x_e = x[tokens]
        _record(amax_out, f"{key}.gate_up", e, s.num_experts, x_e)
        gu = rnd(_quantize_input(x_e, gate_up, mode) @ gate_up.w_OxI.T)
        gate, up = np.split(gu, 2, axis=-1)
        hidden = rnd(gate / (1.0 + np.exp(-gate)) * up)
        _record(amax_out, f"{key}.down", e, s.num_experts, hidden)
        y_TxKxD[tokens, slots] = rnd(_quantize_input(hidden, down, mode) @ down.w_OxI.T)
    out = y_TxKxD[:, 0] * weights[:, 0, None]
    for j in range(1, experts.shape[1]):
        out = out + y_TxKxD[:, j] * weights[:, j, None]
    out = rnd(out.reshape(b, l, d))
    if "shared_gate_up" in layer:
        shared = _swiglu_mlp(h, layer["shared_gate_up"], layer["shared_down"], mode, rnd,
                             amax_out, f"layers.{i}.mlp.shared")  # fmt: skip
        if "shared_gate" in layer:
            logit = (x.astype(np.float64) @ layer["shared_gate"].astype(np.float64).T).astype(
                np.float32
            )
            shared = rnd(1.0 / (1.0 + np.exp(-logit.reshape(b, l, 1))) * shared)
        out = rnd(out + shared)
    return out


def forward(
    weights: ForwardWeights,
    tokens_BxL: np.ndarray,
    *,
    activations: str = "dynamic",
    compute_dtype: str | None = None,
    amax_out: dict[str, float] | None = None,
) -> np.ndarray:
    """float32 logits [B, L, V] for int tokens [B, L].

    Args:
        weights: the decoder's weights.
        tokens_BxL: token ids.
        activations: "dynamic" (quantize each quantized linear's input with its own amax, as
            training does), "static" (with `ForwardLinear.act_amax`) or "none" (weight-only).
        compute_dtype: override the spec's dtype for the roundings ("float32": none).
        amax_out: if given, receives max |x| at each linear's input, keyed `layers.{i}.attn.qkv`...
    """
    if activations not in ACTIVATION_MODES:
        raise ValueError(f"activations must be one of {ACTIVATION_MODES}, got {activations!r}")
    tokens = np.asarray(tokens_BxL)
    if tokens.ndim != 2 or tokens.shape[1] > weights.spec.max_seq_len:
        raise ValueError(
            f"tokens must be [batch, length <= {weights.spec.max_seq_len}], got {tokens.shape}"
        )
    if tokens.size and (tokens.min() < 0 or tokens.max() >= weights.spec.vocab_size):
        raise ValueError(
            f"token ids must be in [0, {weights.spec.vocab_size}), got {tokens.min()}..{tokens.max()}"
        )
    rnd = _rounder(compute_dtype or weights.spec.dtype)
    tables = _rope_tables(tokens.shape[1], weights.spec)
    x = rnd(weights.embed_VxD[tokens])
    for i, layer in enumerate(weights.layers):
        x = _block(x, layer, i, weights, activations, rnd, amax_out, tables)
    x = _rms_norm(x, weights.final_norm, weights.spec.rms_norm_eps, rnd)
    return (x @ rnd(weights.lm_head_VxD).T).astype(np.float32)
