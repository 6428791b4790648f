"""Small random Hugging Face models, made by transformers itself (no download), to import.

Each case is a transformers config class and its keyword arguments: the architectures and options
`model.init_from` accepts (Llama 2/3, Llama 3.2 with llama3 RoPE scaling and tied embeddings,
attention biases, Mistral, Qwen 2 with q/k/v biases, Qwen 3 with q/k norms; the MoE classes;
Nemotron-H with Mamba-2, squared-ReLU MLP and attention blocks; Nemotron 3 with its MoE blocks).
Every parameter,
norms and biases included, is drawn at random, so a norm or bias read into the wrong place shows.
The tokenizer is a byte-level BPE trained on `TEXT` with the `<|endoftext|>` end-of-text token.
"""

from __future__ import annotations

import copy
from pathlib import Path

TEXT = (
    "In the beginning God created the heaven and the earth. And the earth was without form, and "
    "void; and darkness was upon the face of the deep. And the Spirit of God moved upon the face "
    "of the waters. And God said, Let there be light: and there was light. And God saw the light, "
    "that it was good: and God divided the light from the darkness. And God called the light Day, "
    "and the darkness he called Night. And the evening and the morning were the first day."
)
VOCAB = 320
EOS = "<|endoftext|>"
_SHAPE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    rms_norm_eps=1e-6,
)  # fmt: skip
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}  # fmt: skip
CASES = {
    "llama": ("LlamaConfig", {"rope_theta": 500000.0}),
    "llama3.2": (
        "LlamaConfig", {"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE, "tie_word_embeddings": True}
    ),
    "llama-bias": ("LlamaConfig", {"attention_bias": True}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {}),
    "qwen3-bias": ("Qwen3Config", {"attention_bias": True, "tie_word_embeddings": True}),
}  # fmt: skip
"""case -> (transformers config class, options beyond `_SHAPE`)."""
_MOE_SHAPE = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
)  # fmt: skip
_QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 intermediate_size=64)  # fmt: skip
MOE_CASES = {
    "qwen3_moe": ("Qwen3MoeConfig", {**_QWEN_MOE, "norm_topk_prob": True}),
    "qwen3_moe-fused": (
        "Qwen3MoeConfig", {**_QWEN_MOE, "norm_topk_prob": True, "mlp_only_layers": [0]}
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                  "intermediate_size": 32, "sliding_window": None}),
    "mixtral-fused": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                        "intermediate_size": 32, "sliding_window": None}),
    "qwen2_moe": ("Qwen2MoeConfig", {**_QWEN_MOE, "shared_expert_intermediate_size": 48,
                                     "norm_topk_prob": False}),
}  # fmt: skip
"""Mixture-of-Experts cases (2 blocks, 4 experts, top-2, d_model 64): saved per expert as
`save_pretrained` writes them, or `-fused` (transformers 5's in-memory `experts.gate_up_proj` /
`experts.down_proj`, `save_pretrained(save_original_format=False)`)."""
_NEMOTRON_H = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, layer_norm_epsilon=1e-6,
    layers_block_type=["mamba", "mlp", "mamba", "mlp", "attention", "mlp"], mamba_num_heads=16,
    mamba_head_dim=8, ssm_state_size=16, n_groups=2, chunk_size=16, time_step_limit=(0.4, 1.0),
)  # fmt: skip
NEMOTRON_H_CASES = {
    "nemotron_h": ("NemotronHConfig", _NEMOTRON_H),
    "nemotron_h-library": ("NemotronHConfig", _NEMOTRON_H),
}
"""Nemotron-H (6 blocks M-M-*-, d_model 64, 16 Mamba heads of 8 in 2 groups, state 16, chunks of
16; dt clipped to [0.4, 1.0], which binds for the random weights): `nemotron_h` as the Hub holds
it (`backbone.*`, config.json rewritten in the legacy form, `legacy_nemotron_h_config`),
`-library` in transformers' own layout (`model.*`) and config.json as transformers 5 writes it."""
_NEMOTRON3 = dict(
    {k: v for k, v in _NEMOTRON_H.items() if k != "time_step_limit"},
    layers_block_type=["mamba", "moe", "attention", "moe"], n_routed_experts=8,
    num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
    n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
)  # fmt: skip
NEMOTRON3_CASES = {
    "nemotron3": ("NemotronHConfig", _NEMOTRON3),
    "nemotron3-library": ("NemotronHConfig", _NEMOTRON3),
    "nemotron3-latent": ("NemotronHConfig", {**_NEMOTRON3, "moe_latent_size": 32}),
    "nemotron3-latent-library": ("NemotronHConfig", {**_NEMOTRON3, "moe_latent_size": 32}),
}
"""Nemotron 3 (4 blocks M E * E, d_model 64; 8 sigmoid-routed squared-ReLU experts of 32 in 4
groups, the best 2 groups searched, top-2 scaled by 2.5, one shared expert of 48; a random
`e_score_correction_bias`): Nano-style, and Super-style with LatentMoE (`-latent`, latent 32);
each as the Hub holds it (`backbone.*`, experts one by one, legacy config.json) and in
transformers' layout (`-library`: `model.*`, experts stacked [E, F, W] / [E, W, F])."""
ALL_CASES = {**CASES, **MOE_CASES, **NEMOTRON_H_CASES, **NEMOTRON3_CASES}
ARCHITECTURE = {
    case: {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "nemotronh": "nemotron_h"}.get(
        name, name
    )
    for case, (cls, _) in ALL_CASES.items()
    for name in [cls.removesuffix("Config").lower()]
}


def tokenizer():
    """A byte-level BPE of `VOCAB` entries trained on `TEXT`, with `EOS`."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator([TEXT] * 4, trainer)
    return tok


def make_model(case: str, out_dir: Path, *, seed: int = 0):
    """Writes a random `case` model (float32 safetensors, config.json, tokenizer.json) to
    `out_dir` with `save_pretrained`; returns the torch model in eval mode."""
    import torch
    import transformers

    class_name, options = ALL_CASES[case]
    options = copy.deepcopy(options)  # transformers writes rope_theta into a rope_scaling dict
    nemotron = class_name == "NemotronHConfig"
    shape = _MOE_SHAPE if case in MOE_CASES else {} if nemotron else _SHAPE
    config = getattr(transformers, class_name)(**shape, **options)
    tok = tokenizer()
    config.eos_token_id = config.bos_token_id = tok.token_to_id(EOS)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
            elif name.endswith(
                ("mlp.gate.weight", "shared_expert_gate.weight", "mixer.gate.weight")
            ):
                param.copy_(0.5 * torch.randn_like(param))  # decisive routing: few near-ties
            else:
                param.copy_(0.08 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # changes which experts are chosen
                buffer.copy_(0.1 * torch.randn_like(buffer))
    model.save_pretrained(out_dir, save_original_format=not case.endswith(("-fused", "-library")))
    tok.save(str(out_dir / "tokenizer.json"))
    if nemotron and not case.endswith("-library"):
        legacy_nemotron_h_config(out_dir / "config.json")
    return model


LEGACY_NAMES = {
    "n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "expand": "mamba_expand",
    "time_step_min": "mamba_dt_min", "time_step_max": "mamba_dt_max",
    "time_step_limit": "mamba_dt_limit", "time_step_floor": "mamba_dt_init_floor",
    "use_conv_bias": "mamba_conv_bias", "chunk_size": "mamba_chunk_size",
}  # fmt: skip
"""transformers 5's Nemotron-H key -> the legacy name its `NemotronHConfig` still reads."""


def legacy_nemotron_h_config(path: Path) -> None:
    """Rewrites a Nemotron-H config.json in the legacy form: `hybrid_override_pattern` letters
    and `num_hidden_layers` for `layers_block_type`, the `mamba_*` names of `LEGACY_NAMES`."""
    import json

    config = json.loads(path.read_text())
    letters = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
    blocks = config.pop("layers_block_type")
    config["hybrid_override_pattern"] = "".join(letters[b] for b in blocks)
    config["num_hidden_layers"] = len(blocks)
    for new, old in LEGACY_NAMES.items():
        config[old] = config.pop(new)
    path.write_text(json.dumps(config, indent=2))


def text_batch(rows: int, length: int):
    """int [rows, length] tokens of `TEXT` (repeated as needed) under `tokenizer()`."""
    import numpy as np

    ids = tokenizer().encode(TEXT).ids
    ids = (ids * (rows * length // len(ids) + 1))[: rows * length]
    return np.asarray(ids, np.int32).reshape(rows, length)
