"""The model's dense (non-linear) tensors under their three names: `ForwardWeights` key, training
parameter and Hugging Face tensor, with the name of the `LlamaSpec` flag each one depends on.

The one table every reader and writer of these tensors goes through (`model_spec`, `hf_files`,
`reload`, `onnx_graph`). Per-layer entries (`LAYER_TENSORS`) are named relative to their layer;
`DenseTensor.in_layer` places them in `layers.{i}.` (key, parameter) and `model.layers.{i}.` (HF).
Which entries a given model has is the spec's to say (`LlamaSpec.has`, `model_spec.dense_entries`):
this table knows flags only by name.

Example:
    >>> layer_tensor("q_norm", 3).hf_name, layer_tensor("q_norm", 3).flag
    ('model.layers.3.self_attn.q_norm.weight', 'qk_norm')
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class DenseTensor:
    """One dense tensor: its names, the flag it exists under and how its layouts differ.

    Attributes:
        key: the `ForwardWeights` name: "embed", "final_norm", "lm_head", or a layer key
            ("attn_norm", ...; `layers.{i}.attn_norm` once placed).
        param: the training parameter path (relative to `layers.{i}` for a per-layer entry).
        hf_name: the HF tensor name (relative to `model.layers.{i}`); for a bias of a fused
            linear, its name inside each of that linear's HF modules ("bias").
        flag: the name of the `LlamaSpec` flag the tensor depends on, or None (always there).
        when: the flag's value with which the tensor exists (lm_head: `tie_embeddings` False).
        fused_linear: the training linear (relative to `layers.{i}`) whose HF modules each hold
            their rows of the tensor (`linears.hf_modules`), or None: one HF tensor.
        transposed: the training parameter is [in, out] and the HF tensor and `ForwardWeights`
            hold its transpose (lm_head: kernel [D, V], HF and forward [V, D]).
        layer: the layer a placed per-layer entry is in; None for a table entry or a
            model-wide tensor.
        conv_kernel: the training parameter is a depthwise conv kernel [K, C] and the HF tensor
            and `ForwardWeights` hold PyTorch's `Conv1d.weight` [C, 1, K] (`stored_value`).
        dtype: the dtype the export stores it in: "bfloat16", or "float32" for the Mamba
            mixer's conv and SSM parameters (training computes with them in float32).
    """

    key: str
    param: str
    hf_name: str
    flag: str | None = None
    when: bool = True
    fused_linear: str | None = None
    transposed: bool = False
    layer: int | None = None
    conv_kernel: bool = False
    dtype: str = "bfloat16"

    def in_layer(self, i: int) -> DenseTensor:
        """This per-layer entry with its names placed in layer `i`."""
        p = f"layers.{i}."
        hf_name = self.hf_name if self.fused_linear else f"model.{p}{self.hf_name}"
        fused = None if self.fused_linear is None else p + self.fused_linear
        return dataclasses.replace(
            self, key=p + self.key, param=p + self.param, hf_name=hf_name, fused_linear=fused,
            layer=i,
        )  # fmt: skip


EMBED = DenseTensor("embed", "embed.embedding", "model.embed_tokens.weight")
FINAL_NORM = DenseTensor("final_norm", "final_norm.scale", "model.norm.weight")
LM_HEAD = DenseTensor(
    "lm_head", "lm_head.kernel", "lm_head.weight", flag="tie_embeddings", when=False,
    transposed=True,
)  # fmt: skip
"""Absent when tied: `ForwardWeights` then computes the logits with `EMBED`."""
MODEL_TENSORS = (EMBED, FINAL_NORM, LM_HEAD)
"""The model-wide dense tensors."""
LAYER_TENSORS = (
    DenseTensor("attn_norm", "attn_norm.scale", "input_layernorm.weight"),
    DenseTensor("mlp_norm", "mlp_norm.scale", "post_attention_layernorm.weight"),
    DenseTensor("qkv_bias", "attn.qkv.bias", "bias", flag="qkv_bias", fused_linear="attn.qkv"),
    DenseTensor("o_bias", "attn.o.bias", "self_attn.o_proj.bias", flag="o_bias"),
    DenseTensor("q_norm", "attn.q_norm.scale", "self_attn.q_norm.weight", flag="qk_norm"),
    DenseTensor("k_norm", "attn.k_norm.scale", "self_attn.k_norm.weight", flag="qk_norm"),
)
"""Each layer's dense tensors, in the order `ForwardWeights` layers and exports list them."""


def layer_tensor(key: str, i: int) -> DenseTensor:
    """The per-layer entry of `ForwardWeights` layer key `key` ("attn_norm", ...) in layer `i`."""
    return {t.key: t for t in LAYER_TENSORS}[key].in_layer(i)


def stored_value(t: DenseTensor, param: np.ndarray) -> np.ndarray:
    """Training parameter `param` of entry `t` in the layout HF and `ForwardWeights` hold it:
    transposed (lm_head [V, D]), a conv kernel [K, C] as `Conv1d.weight` [C, 1, K], else as is.

    Example:
        >>> t = DenseTensor("conv1d", "k", "w", conv_kernel=True)
        >>> stored_value(t, np.arange(6.0).reshape(3, 2)).tolist()
        [[[0.0, 2.0, 4.0]], [[1.0, 3.0, 5.0]]]
    """
    if t.conv_kernel:
        return np.ascontiguousarray(np.asarray(param).T[:, None, :])
    return param.T if t.transposed else param
