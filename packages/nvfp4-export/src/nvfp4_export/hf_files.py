"""The files of a Hugging Face model directory: config.json, generation_config.json, the tokenizer,
and the dense BF16 tensors under their HF names (`dense_slots`: names, dtypes and shapes;
`dense_parts` / `dense_tensors`: values, shared by the HF and ONNX exports). The weight files
themselves (and their names) are `shard_writer`'s."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from nvfp4_export.bfloat16 import to_bfloat16, transposed
from nvfp4_export.dense_names import DenseTensor, stored_value
from nvfp4_export.hybrid_names import hybrid_config
from nvfp4_export.json_files import write_json
from nvfp4_export.linears import hf_modules
from nvfp4_export.model_spec import ARCHITECTURES, LlamaSpec, dense_entries
from nvfp4_export.shard_writer import TensorSlot

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
HF_QUANT_CONFIG_FILE = "hf_quant_config.json"
"""ModelOpt's quantization metadata (only the "modelopt" layout writes it)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def hf_config(spec: LlamaSpec, *, eos_token_id: int | None, bos_token_id: int | None) -> dict:
    """config.json for the spec's architecture (`LlamaForCausalLM`, `Qwen3ForCausalLM`, ...; no
    quantization entry, the layout adds it). RoPE is written as `rope_theta` + `rope_scaling`,
    the spelling vLLM, TensorRT-LLM, SGLang and transformers (4.x and 5.x) all read; sliding
    windows are off, as training attends to the whole sequence. A hybrid spec's is
    `NemotronHForCausalLM`'s (`hybrid_names.hybrid_config`)."""
    if spec.hybrid:
        return hybrid_config(spec, eos_token_id=eos_token_id, bos_token_id=bos_token_id)
    config = {
        "architectures": [ARCHITECTURES[spec.architecture]],
        "model_type": spec.architecture,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.d_model,
        "intermediate_size": spec.mlp_dim,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_seq_len,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": spec.scaled_rope,
        "tie_word_embeddings": spec.tie_embeddings,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "bfloat16",
    }
    base = DENSE_BASE.get(spec.architecture, spec.architecture)
    if base in ("llama", "qwen3"):
        config["attention_bias"] = spec.o_bias
    if base == "llama":
        config["mlp_bias"] = False
    if base != "llama":
        config["sliding_window"] = None
    if base in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
        config["max_window_layers"] = spec.num_layers
        if spec.architecture != "qwen3_moe":  # Qwen3MoeConfig has no layer_types
            config["layer_types"] = ["full_attention"] * spec.num_layers
    return config | moe_config(spec)


DENSE_BASE = {"qwen3_moe": "qwen3", "mixtral": "mistral", "qwen2_moe": "qwen2"}
"""An MoE `model_type` -> the dense one whose attention options its config.json spells."""


def moe_config(spec: LlamaSpec) -> dict:
    """The config.json keys of an MoE class (none for a dense model): Qwen's `num_experts`,
    `moe_intermediate_size`, `decoder_sparse_step`, `mlp_only_layers`, `norm_topk_prob` (plus
    Qwen2-MoE's `shared_expert_intermediate_size`, `qkv_bias`), Mixtral's `num_local_experts`,
    `intermediate_size` (the experts' width), `router_jitter_noise` 0."""
    if not spec.num_experts:
        return {}
    if spec.architecture == "mixtral":
        return {"num_local_experts": spec.num_experts, "num_experts_per_tok": spec.experts_per_token,
                "intermediate_size": spec.expert_mlp_dim, "router_jitter_noise": 0.0,
                "output_router_logits": False}  # fmt: skip
    config = {
        "num_experts": spec.num_experts, "num_experts_per_tok": spec.experts_per_token,
        "moe_intermediate_size": spec.expert_mlp_dim, "norm_topk_prob": spec.norm_topk_prob,
        "decoder_sparse_step": spec.moe_layer_freq, "mlp_only_layers": list(spec.moe_dense_layers),
        "output_router_logits": False,
    }  # fmt: skip
    if spec.architecture == "qwen2_moe":
        config |= {"shared_expert_intermediate_size": spec.shared_mlp_dim, "qkv_bias": True}
    return config


def hf_dense_names(spec: LlamaSpec) -> list[str]:
    """Names of the tensors an export stores in BF16 besides the linears' weights: embeddings,
    norms (q/k norms included), biases and lm_head; the model-wide ones first, then layer by
    layer."""
    entries = sorted(dense_entries(spec), key=lambda t: t.layer is not None)
    return [name for t in entries for name in dense_hf_names(spec, t)]


def dense_hf_names(spec: LlamaSpec, t: DenseTensor) -> list[str]:
    """The HF names of placed entry `t`: its `hf_name`, or for a fused linear's bias that name in
    each of the linear's HF modules, in `hf_modules` order (q, k, v)."""
    if t.fused_linear is None:
        return [t.hf_name]
    return [f"{module}.{t.hf_name}" for module, _ in hf_modules(spec, t.fused_linear)]


def _as_stored(spec: LlamaSpec, t: DenseTensor, param: np.ndarray) -> dict[str, np.ndarray]:
    """Training parameter `param` of placed entry `t` under its HF names, as stored: in HF's
    layout (`dense_names.stored_value`), cut into each HF module's rows when `t.fused_linear`."""
    value = stored_value(t, param)
    if t.fused_linear is None:
        return {t.hf_name: value}
    rows = [n for _, n in hf_modules(spec, t.fused_linear)]
    return dict(zip(dense_hf_names(spec, t), np.split(value, np.cumsum(rows)[:-1]), strict=True))


def _bf16(x: np.ndarray) -> np.ndarray:
    """`x` as C-contiguous bfloat16 (a transposed view is rounded first, then transposed)."""
    if x.ndim == 2 and not x.flags.c_contiguous and x.T.flags.c_contiguous:
        return transposed(to_bfloat16(x.T).view(np.uint16)).view(ml_dtypes.bfloat16)
    return to_bfloat16(x)


def dense_parts(spec: LlamaSpec, t: DenseTensor, param: np.ndarray) -> dict[str, np.ndarray]:
    """Placed entry `t` of training parameter `param` under its HF names, in BF16 (or float32
    for an entry of `dtype` "float32": the Mamba mixer's conv and SSM parameters)."""
    parts = _as_stored(spec, t, param).items()
    if t.dtype == "float32":
        return {name: np.ascontiguousarray(value, np.float32) for name, value in parts}
    return {name: _bf16(value) for name, value in parts}


def dense_slots(spec: LlamaSpec, shapes: Mapping[str, tuple[int, ...]]) -> list[TensorSlot]:
    """The (name, dtype, shape) of every tensor `dense_tensors` gives, from parameter shapes."""
    dtypes = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
    return [
        TensorSlot(name, dtypes[t.dtype], tuple(value.shape))
        for t in dense_entries(spec)
        for name, value in _as_stored(
            spec, t, np.broadcast_to(np.float32(0), shapes[t.param])
        ).items()
    ]


def dense_tensors(spec: LlamaSpec, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Embeddings, norms, biases and lm_head in BF16 under their HF names (a fused q|k|v bias
    split like its kernel), in model order."""
    return {
        name: v
        for t in dense_entries(spec)
        for name, v in dense_parts(spec, t, params[t.param]).items()
    }


def generation_config(*, eos_token_id: int | None, bos_token_id: int | None) -> dict:
    """generation_config.json: the special tokens; greedy decoding by default."""
    return {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "do_sample": False}


def special_token_ids(tokenizer_dir: Path | None) -> tuple[int | None, int | None]:
    """(bos, eos) ids from a `tokenizer/` directory: eos from special_tokens_map.json's `eos_token`
    looked up in tokenizer.json's added tokens; bos = eos (training prepends no BOS token)."""
    if tokenizer_dir is None:
        return None, None
    try:
        special = json.loads((tokenizer_dir / "special_tokens_map.json").read_text("utf-8"))
        tok = json.loads((tokenizer_dir / "tokenizer.json").read_text("utf-8"))
    except (OSError, ValueError):  # unreadable, not UTF-8, not JSON
        return None, None
    if not isinstance(special, dict) or not isinstance(tok, dict):
        return None, None
    eos = special.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    for added in tok.get("added_tokens", []):
        if isinstance(added, dict) and added.get("content") == eos:
            return int(added["id"]), int(added["id"])
    vocab = (tok.get("model") or {}).get("vocab") or {}
    eos_id = vocab.get(eos) if isinstance(vocab, dict) else None
    return eos_id, eos_id


def copy_tokenizer(tokenizer_dir: Path | None, out_dir: Path) -> list[str]:
    """Copies the run's tokenizer files (tokenizer.json + its configs) into `out_dir`.

    Training writes `tokenizer.json` (Hugging Face `tokenizers` format; the byte tokenizer as a
    byte-level BPE without merges) with `tokenizer_config.json` naming `PreTrainedTokenizerFast`,
    which `transformers.AutoTokenizer` loads as they are. A missing `tokenizer_config.json` is
    written here with that class.
    """
    if tokenizer_dir is None or not (tokenizer_dir / "tokenizer.json").is_file():
        return []
    copied = []
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, out_dir / name)
            copied.append(name)
    if "tokenizer_config.json" not in copied:
        write_json(
            out_dir / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast"}
        )
        copied.append("tokenizer_config.json")
    return copied
