"""Which inference servers an export is meant for, and whether each serves what was trained.

Two ways a server can serve a model other than the trained one, each read from the server's own
loading code (file and function named in the tables below; docs/export.md has the same table):

- it builds the architecture's attention without a bias the checkpoint holds, and its weight
  loader skips that `.bias` tensor without a word (vLLM's Qwen 3 has no `o_proj` bias);
- it cannot read the export's layout or mode at all (TensorRT-LLM on a weight-only
  compressed-tensors export), which is an error at load time instead of a silent difference;
- for a hybrid (Nemotron-H) model, its Mamba mixer computes otherwise than training
  (`hybrid_servers`: a dt clip it ignores, SGLang's fixed gated-norm eps).

`check_servers` refuses both for the servers the export is meant for; with `allow_dropped` a
dropped tensor becomes a warning instead (the export then serves differently on that server).

Example:
    >>> from nvfp4_export.model_spec import LlamaSpec
    >>> spec = LlamaSpec(vocab_size=32, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
    ...                  head_dim=16, mlp_dim=32, architecture="qwen3", qkv_bias=True,
    ...                  o_bias=True, qk_norm=True)
    >>> dropped_tensors("vllm", spec), dropped_tensors("sglang", spec)
    (('self_attn.o_proj.bias',), ())
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from nvfp4_export.errors import ExportError
from nvfp4_export.formats import BF16, COMPRESSED_TENSORS, MODELOPT, NVFP4
from nvfp4_export.hf_files import hf_config
from nvfp4_export.hybrid_servers import hybrid_differences, hybrid_layout_refusal
from nvfp4_export.layouts import LayoutPlan
from nvfp4_export.model_spec import LlamaSpec

SERVERS = ("vllm", "sglang", "tensorrt-llm", "transformers")
"""The servers `export_hf(servers=...)` / `--server` name."""
ATTENTION_BIAS = "attention_bias"
"""A bias a class builds exactly when config.json's `attention_bias` is true (`hf_files.hf_config`
writes the checkpoint's `o_bias` there for Llama and Qwen 3, and no such key for the others)."""


@dataclasses.dataclass(frozen=True)
class AttentionBiases:
    """The q/k/v and o_proj biases one server's class builds: True, False or `ATTENTION_BIAS`.

    Attributes:
        qkv: the q/k/v projections' biases (one fused `qkv_proj` bias in vLLM and SGLang).
        o: the output projection's bias.
        source: the server file and class the entry is read from.
    """

    qkv: bool | str
    o: bool | str
    source: str

    def builds(self, spec: LlamaSpec) -> dict[str, bool]:
        """{"qkv_bias": ..., "o_bias": ...} for the config.json an export of `spec` carries."""
        config = hf_config(spec, eos_token_id=None, bos_token_id=None)
        attention_bias = bool(config.get("attention_bias", False))
        return {
            flag: attention_bias if rule == ATTENTION_BIAS else bool(rule)
            for flag, rule in (("qkv_bias", self.qkv), ("o_bias", self.o))
        }


_AB = ATTENTION_BIAS
BIASES: dict[str, dict[str, AttentionBiases]] = {
    "vllm": {
        "llama": AttentionBiases(_AB, _AB, "vllm/model_executor/models/llama.py, "
                                 "LlamaDecoderLayer: bias and bias_o_proj = attention_bias"),
        "mistral": AttentionBiases(_AB, _AB, "vllm/model_executor/models/mistral.py, "
                                   "MistralForCausalLM(LlamaForCausalLM)"),
        "qwen2": AttentionBiases(True, False, "vllm/model_executor/models/qwen2.py, "
                                 "Qwen2Attention: qkv_proj bias=True, o_proj bias=False"),
        "qwen3": AttentionBiases(_AB, False, "vllm/model_executor/models/qwen3.py, "
                                 "Qwen3Attention: qkv_proj bias=attention_bias, o_proj bias=False; "
                                 "Qwen2Model.load_weights skips a .bias it has no parameter for"),
        "qwen3_moe": AttentionBiases(_AB, False, "vllm/model_executor/models/qwen3_moe.py, "
                                     "Qwen3MoeAttention: qkv_proj bias=qkv_bias (attention_bias), "
                                     "o_proj bias=False"),
        "mixtral": AttentionBiases(False, False, "vllm/model_executor/models/mixtral.py, "
                                   "MixtralAttention: bias=False"),
        "qwen2_moe": AttentionBiases(True, False, "vllm/model_executor/models/qwen2_moe.py, "
                                     "Qwen2MoeAttention: qkv_proj bias=True, o_proj bias=False"),
        "nemotron_h": AttentionBiases(False, False, "vllm/model_executor/models/nemotron_h.py, "
                                      "NemotronHAttention: bias=False"),
    },
    "sglang": {
        "llama": AttentionBiases(_AB, _AB, "python/sglang/srt/models/llama.py, LlamaAttention: "
                                 "qkv_proj and o_proj bias=attention_bias"),
        "mistral": AttentionBiases(_AB, _AB, "python/sglang/srt/models/mistral.py, "
                                   "MistralForCausalLM(LlamaForCausalLM)"),
        "qwen2": AttentionBiases(True, False, "python/sglang/srt/models/qwen2.py, Qwen2Attention"),
        "qwen3": AttentionBiases(_AB, _AB, "python/sglang/srt/models/qwen3.py, Qwen3Attention: "
                                 "qkv_proj and o_proj bias=attention_bias"),
        "qwen3_moe": AttentionBiases(_AB, _AB, "python/sglang/srt/models/qwen3_moe.py, "
                                     "Qwen3MoeAttention: qkv_proj and o_proj bias=attention_bias"),
        "mixtral": AttentionBiases(False, False, "python/sglang/srt/models/mixtral.py, "
                                   "MixtralAttention: bias=False"),
        "qwen2_moe": AttentionBiases(True, False, "python/sglang/srt/models/qwen2_moe.py, "
                                     "Qwen2MoeAttention: qkv_bias (config, default True), "
                                     "o_proj bias=False"),
        "nemotron_h": AttentionBiases(False, False, "python/sglang/srt/models/nemotron_h.py, "
                                      "NemotronHAttention: qkv_proj and o_proj bias=False"),
    },
    "tensorrt-llm": {
        "llama": AttentionBiases(_AB, _AB, "tensorrt_llm/_torch/models/modeling_llama.py, "
                                 "LlamaAttention: bias=attention_bias (dense_bias defaults to it)"),
        "mistral": AttentionBiases(False, False, "tensorrt_llm/_torch/models/modeling_mistral.py, "
                                   "MistralAttention: bias=False"),
        "qwen2": AttentionBiases(True, False, "tensorrt_llm/_torch/models/modeling_qwen.py, "
                                 "QwenAttention: bias=True, dense_bias=False"),
        "qwen3": AttentionBiases(_AB, _AB, "tensorrt_llm/_torch/models/modeling_qwen3.py, "
                                 "Qwen3DecoderLayer: bias and dense_bias=attention_bias"),
        "qwen3_moe": AttentionBiases(_AB, _AB, "tensorrt_llm/_torch/models/modeling_qwen3_moe.py "
                                     "(its attention is modeling_qwen3.py's Qwen3Attention)"),
        "mixtral": AttentionBiases(False, False, "tensorrt_llm/_torch/models/modeling_mixtral.py, "
                                   "MixtralAttention: bias=False"),
        "qwen2_moe": AttentionBiases(True, False, "tensorrt_llm/_torch/models/modeling_qwen_moe.py "
                                     "(QwenAttention: bias=True, dense_bias=False)"),
        "nemotron_h": AttentionBiases(_AB, _AB, "tensorrt_llm/_torch/models/modeling_nemotron_h"
                                      ".py, TransformerLayer: bias=config.attention_bias"),
    },
    "transformers": {
        "llama": AttentionBiases(_AB, _AB, "transformers LlamaAttention: bias=attention_bias"),
        "mistral": AttentionBiases(False, False, "transformers MistralAttention: bias=False"),
        "qwen2": AttentionBiases(True, False, "transformers Qwen2Attention: q/k/v bias=True"),
        "qwen3": AttentionBiases(_AB, _AB, "transformers Qwen3Attention: bias=attention_bias"),
        "qwen3_moe": AttentionBiases(_AB, _AB, "transformers Qwen3MoeAttention: "
                                     "bias=attention_bias"),
        "mixtral": AttentionBiases(False, False, "transformers MixtralAttention: bias=False"),
        "qwen2_moe": AttentionBiases(True, False, "transformers Qwen2MoeAttention: "
                                     "q/k/v bias=qkv_bias, o_proj bias=False"),
        "nemotron_h": AttentionBiases(False, False, "transformers NemotronHAttention: "
                                      "bias=False"),
    },
}  # fmt: skip
"""server -> architecture -> the attention biases its class builds. Every server builds Qwen 3's
q/k norms and no other architecture's (`check_architecture` ties qk_norm to Qwen 3)."""
HF_BIAS_NAMES = {"qkv_bias": "self_attn.{q,k,v}_proj.bias", "o_bias": "self_attn.o_proj.bias"}


def dropped_tensors(server: str, spec: LlamaSpec) -> tuple[str, ...]:
    """The per-layer tensors of an export of `spec` that `server` builds no parameter for."""
    built = BIASES[server][spec.architecture].builds(spec)
    return tuple(HF_BIAS_NAMES[f] for f, has in built.items() if getattr(spec, f) and not has)


def layout_refusal(server: str, plan: LayoutPlan) -> str | None:
    """Why `server` does not load an export of `plan` at all, or None when it loads it."""
    if server == "transformers" and plan.layout == MODELOPT and plan.fmt != BF16:
        return (
            "transformers has no ModelOpt quantizer (transformers/quantizers/auto.py, "
            "AUTO_QUANTIZER_MAPPING has no 'modelopt'); use --layout compressed-tensors"
        )
    nvfp4 = NVFP4.name in (plan.formats or (plan.fmt,))
    if server == "sglang" and plan.layout == MODELOPT and nvfp4 and not plan.w4a4:
        return (
            "SGLang refuses quant_algo W4A16_NVFP4 (python/sglang/srt/layers/quantization/"
            "modelopt_quant.py, ModelOptFp4Config.from_config: quant_method not in "
            "['FP8', 'NVFP4']); export W4A4 (input scales from quant_stats or --calibrate N)"
        )
    if server == "transformers" and plan.layout == COMPRESSED_TENSORS and plan.moe:
        return (
            "transformers + compressed-tensors does not load NVFP4 experts as trained: its "
            "dequantizing loader builds each expert from weight_packed, weight_scale and "
            "weight_shape without its weight_global_scale, and drops BF16 experts "
            "(transformers/integrations/compressed_tensors.py, CompressedTensorsDequantize."
            "convert; transformers 5.25). Dequantize with compressed-tensors first "
            "(nvfp4_export.clients.moe_dense_copy), or leave transformers out of --server"
        )
    weight_only_ct = plan.layout == COMPRESSED_TENSORS and nvfp4 and not plan.w4a4
    if server == "tensorrt-llm" and weight_only_ct:
        return (
            "TensorRT-LLM reads input_activations['strategy'] of an NVFP4 (tensor_group) "
            "compressed-tensors group (tensorrt_llm/models/quant_config_utils.py, "
            "_quant_config_from_config_group), and a weight-only export has input_activations: "
            "null, so the load fails; export W4A4 (input scales from quant_stats or --calibrate N)"
        )
    return hybrid_layout_refusal(server, plan)


def target_servers(plan: LayoutPlan, servers: Sequence[str] | None) -> tuple[str, ...]:
    """`servers` checked against `SERVERS`, or by default every server that loads `plan`."""
    if servers is None:
        return tuple(s for s in SERVERS if layout_refusal(s, plan) is None)
    unknown = sorted(set(servers) - set(SERVERS))
    if unknown or not servers:
        raise ExportError(f"servers must be some of {SERVERS}, got {list(servers)}")
    return tuple(dict.fromkeys(servers))


def check_servers(
    spec: LlamaSpec, plan: LayoutPlan, servers: Sequence[str] | None, *, allow_dropped: bool
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The servers the export is for, and warnings; raises if one would not serve it as trained.

    Args:
        spec: the model exported.
        plan: the layout, format and mode written.
        servers: the servers named by the user (`--server`), or None for every server that
            loads the layout and mode.
        allow_dropped: a tensor a target server drops is a warning instead of an error.

    Returns:
        (target servers, warnings for the user).

    Raises:
        ExportError: a named server does not load the layout or mode; a target server would
            drop a trained tensor and `allow_dropped` is False.
    """
    targets = target_servers(plan, servers)
    refused = {s: why for s in targets if (why := layout_refusal(s, plan)) is not None}
    if refused:
        raise ExportError("; ".join(f"--server {s}: {why}" for s, why in refused.items()))
    drops = {s: dropped for s in targets if (dropped := dropped_tensors(s, spec))}
    lines = [
        f"{s} builds {spec.architecture} without {', '.join(t)} "
        f"({BIASES[s][spec.architecture].source}) and would skip the trained tensor silently"
        for s, t in drops.items()
    ]
    lines += [f"{s} computes {why}" for s in targets for why in hybrid_differences(s, spec)]
    if lines and not allow_dropped:
        raise ExportError("; ".join(lines) + ": the served model would not be the trained one. "
                          + _way_out(spec, plan))  # fmt: skip
    return targets, tuple(f"{line}: it serves a model OTHER than the trained one" for line in lines)


def _way_out(spec: LlamaSpec, plan: LayoutPlan) -> str:
    """What to do instead: name the servers that keep every tensor, or allow the drop."""
    keep = [s for s in SERVERS if layout_refusal(s, plan) is None and not dropped_tensors(s, spec)
            and not hybrid_differences(s, spec)]  # fmt: skip
    allow = "pass --allow-dropped-tensors to export anyway"
    if not keep:
        return allow.capitalize()
    return (
        f"Name the servers that keep every tensor (--server {' --server '.join(keep)}), or {allow}"
    )
