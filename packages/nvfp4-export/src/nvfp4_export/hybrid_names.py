"""The names a Nemotron-H export uses: its tensors under the Hub's `backbone.layers.{i}.mixer.*`
layout (NVIDIA's own checkpoints, which transformers, vLLM, SGLang and TensorRT-LLM load) and its
config.json.

| training (`layers.{i}.`) | HF tensor (`backbone.layers.{i}.`) | stored |
|---|---|---|
| `norm.scale` [D] | `norm.weight` [D] | BF16 |
| `mamba.in_proj.kernel` [D, W] | `mixer.in_proj.*` [W, D] | as trained |
| `mamba.conv1d.kernel` [K, C], `.bias` [C] | `mixer.conv1d.weight` [C, 1, K], `.bias` [C] | F32 |
| `mamba.dt_bias`, `.A_log`, `.D` [H] | `mixer.dt_bias`, `mixer.A_log`, `mixer.D` [H] | F32 |
| `mamba.norm.scale` [d_inner] | `mixer.norm.weight` [d_inner] | BF16 |
| `mamba.out_proj.kernel` [d_inner, D] | `mixer.out_proj.*` [D, d_inner] | as trained |
| `attn.qkv.kernel` | `mixer.{q,k,v}_proj.*` | as trained |
| `attn.o.kernel` | `mixer.o_proj.*` | as trained |
| `mlp.up.kernel`, `mlp.down.kernel` | `mixer.up_proj.*`, `mixer.down_proj.*` | as trained |

and `backbone.embeddings.weight`, `backbone.norm_f.weight`, `lm_head.weight`. The SSM
parameters and the conv stay float32, as training computes with them (servers cast them on
load; vLLM keeps `A = -exp(A_log)` in float32). vLLM maps these names with
`NemotronHForCausalLM.hf_to_vllm_mapper` (backbone -> model, A_log -> A, embeddings ->
embed_tokens, q/k/v -> qkv_proj; vllm/model_executor/models/nemotron_h.py), transformers with
its `conversion_mapping` (backbone. -> model.), TensorRT-LLM renames `backbone` to `model` in its
exclusion list and per-layer quant configs (tensorrt_llm/_torch/models/modeling_nemotron_h.py,
`NemotronHForCausalLM.__init__`).

Example:
    >>> hf_modules_of("attn.qkv", 3, (64, 32, 32), {})[0]
    ('backbone.layers.3.mixer.q_proj', 64)
"""

from __future__ import annotations

from nvfp4_export.dense_names import DenseTensor

LAYERS = "backbone.layers"
"""The prefix of a Nemotron-H block's tensors (`model.layers` for the Llama-style classes)."""
F32 = "float32"
EMBED = DenseTensor("embed", "embed.embedding", "backbone.embeddings.weight")
FINAL_NORM = DenseTensor("final_norm", "final_norm.scale", "backbone.norm_f.weight")
LM_HEAD = DenseTensor("lm_head", "lm_head.kernel", "lm_head.weight", transposed=True)
MAMBA_TENSORS = (
    DenseTensor("conv1d", "mamba.conv1d.kernel", "mixer.conv1d.weight", conv_kernel=True,
                dtype=F32),
    DenseTensor("conv1d_bias", "mamba.conv1d.bias", "mixer.conv1d.bias", flag="conv_bias",
                dtype=F32),
    DenseTensor("dt_bias", "mamba.dt_bias", "mixer.dt_bias", dtype=F32),
    DenseTensor("A_log", "mamba.A_log", "mixer.A_log", dtype=F32),
    DenseTensor("D", "mamba.D", "mixer.D", dtype=F32),
    DenseTensor("mixer_norm", "mamba.norm.scale", "mixer.norm.weight"),
)  # fmt: skip
"""A Mamba block's dense tensors (relative to its layer; `conv_bias` is a `HybridSpec` flag)."""
NORM = DenseTensor("norm", "norm.scale", "norm.weight")
"""Every hybrid block's pre-norm."""
MIXER_MODULES = {
    "mamba.in_proj": ("in_proj",), "mamba.out_proj": ("out_proj",),
    "attn.qkv": ("q_proj", "k_proj", "v_proj"), "attn.o": ("o_proj",),
    "mlp.up": ("up_proj",), "mlp.down": ("down_proj",),
}  # fmt: skip
"""Training linear (relative to its block) -> its HF modules under `backbone.layers.{i}.mixer.`."""
MOE_NAMES = {
    "router": "mixer.gate.weight", "score_bias": "mixer.gate.e_score_correction_bias",
    "expert": "mixer.experts.{e}.{proj}", "shared": "mixer.shared_experts.{proj}",
    "latent": "mixer.fc1_latent_proj", "latent_out": "mixer.fc2_latent_proj",
}  # fmt: skip
"""Where an `E` block's tensors go once exported (vLLM `NemotronHMoE`: `GateLinear` router in
FP32 with `e_score_correction_bias`, non-gated experts `up_proj`/`down_proj`, `shared_experts`,
LatentMoE's `fc1_latent_proj`/`fc2_latent_proj`): the router and its bias stay unquantized, the
experts take one input scale each as for Qwen3-MoE (`expert_scales`). Not used yet: `E` blocks
are refused (`hybrid_spec.hybrid_fields`)."""


def in_layer(t: DenseTensor, i: int) -> DenseTensor:
    """Per-layer entry `t` placed in block `i` (`layers.{i}.` / `backbone.layers.{i}.`)."""
    return DenseTensor(
        f"layers.{i}.{t.key}", f"layers.{i}.{t.param}", f"{LAYERS}.{i}.{t.hf_name}",
        flag=t.flag, when=t.when, transposed=t.transposed, layer=i, conv_kernel=t.conv_kernel,
        dtype=t.dtype,
    )  # fmt: skip


def hybrid_dense_entries(spec) -> list[DenseTensor]:
    """The dense tensors of a hybrid `spec` (a `LlamaSpec` with `hybrid`), placed, in model
    order: embeddings, each block's norm (and a Mamba block's conv and SSM tensors), the final
    norm, lm_head."""
    hy, layers = spec.hybrid, []
    for i in range(spec.num_layers):
        layers.append(in_layer(NORM, i))
        if hy.kind(i) == "mamba":
            flags = {"conv_bias": hy.conv_bias}
            layers += [in_layer(t, i) for t in MAMBA_TENSORS if t.flag is None or flags[t.flag]]
    return [EMBED, *layers, FINAL_NORM, LM_HEAD]


def hf_modules_of(kind: str, i: int, qkv_split, rows: dict[str, int]) -> list[tuple[str, int]]:
    """(HF module, output rows) of training linear `kind` (`attn.qkv`) of block `i`, in the
    order its fused output holds them; `rows` gives the other linears' output rows."""
    names = [f"{LAYERS}.{i}.mixer.{m}" for m in MIXER_MODULES[kind]]
    counts = qkv_split if kind == "attn.qkv" else (rows[kind],)
    return list(zip(names, counts, strict=True))


def hybrid_hf_modules(spec, source: str) -> list[tuple[str, int]]:
    """(HF module, output rows) of training linear `source` (`layers.3.mamba.in_proj`)."""
    _, layer, kind = source.split(".", 2)
    hy, d = spec.hybrid, spec.d_model
    rows = {"mamba.in_proj": hy.in_proj_width, "mamba.out_proj": d, "attn.o": d,
            "mlp.up": spec.mlp_dim, "mlp.down": d}  # fmt: skip
    return hf_modules_of(kind, int(layer), spec.qkv_split, rows)


def hybrid_in_features(spec, source: str) -> int:
    """The input width of training linear `source` of a hybrid spec."""
    kind = source.split(".", 2)[2]
    widths = {"mamba.out_proj": spec.hybrid.d_inner, "attn.o": spec.num_heads * spec.head_dim,
              "mlp.down": spec.mlp_dim}  # fmt: skip
    return widths.get(kind, spec.d_model)


def conv1d_modules(spec) -> tuple[str, ...]:
    """Every Mamba block's conv module (`backbone.layers.{i}.mixer.conv1d`): never quantized,
    and listed as excluded because TensorRT-LLM builds the conv as a `Linear` with the
    checkpoint's quantization config (tensorrt_llm/_torch/modules/mamba/mamba2_mixer.py,
    `Mamba2Mixer.__init__`: `self.conv1d = Linear(..., quant_config=config.get_quant_config())`)
    and would otherwise quantize it."""
    hy = spec.hybrid
    return tuple(f"{LAYERS}.{i}.mixer.conv1d" for i in range(spec.num_layers)
                 if hy.kind(i) == "mamba")  # fmt: skip


def hybrid_config(spec, *, eos_token_id: int | None, bos_token_id: int | None) -> dict:
    """config.json of `NemotronHForCausalLM` for a hybrid `spec`: the Hub's keys (read by
    transformers' `NemotronHConfig`, vLLM's and SGLang's `NemotronHConfig` and TensorRT-LLM,
    which takes `layer_norm_epsilon` for its norms' eps when there is no `rms_norm_eps`). The
    dt clip is written only when training clipped (`time_step_limit`; the default, none, is
    every reader's (0, inf))."""
    hy = spec.hybrid
    config = {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "vocab_size": spec.vocab_size, "hidden_size": spec.d_model,
        "intermediate_size": spec.mlp_dim, "num_hidden_layers": spec.num_layers,
        "hybrid_override_pattern": hy.pattern, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_seq_len, "attention_bias": False, "mlp_bias": False,
        "mlp_hidden_act": "relu2", "mamba_num_heads": hy.mamba_num_heads,
        "mamba_head_dim": hy.mamba_head_dim, "ssm_state_size": hy.ssm_state_size,
        "n_groups": hy.n_groups, "conv_kernel": hy.conv_kernel, "chunk_size": hy.chunk_size,
        "use_conv_bias": hy.conv_bias, "use_bias": False, "mamba_proj_bias": False,
        "mamba_hidden_act": "silu", "layer_norm_epsilon": spec.rms_norm_eps,
        "residual_in_fp32": False, "tie_word_embeddings": False,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "torch_dtype": "bfloat16",
    }  # fmt: skip
    if hy.time_step_limit:
        config["time_step_limit"] = list(hy.time_step_limit)
    return config
