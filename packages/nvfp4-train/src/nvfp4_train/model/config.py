"""The Llama decoder's configuration: `ModelConfig` (shape, numerics, architecture, layer
scanning and rematerialisation) with its checks, the `RopeScaling` inside it, the values its
settings may take (`ARCHITECTURES`, `ROPE_TYPES`, `REMAT_POLICIES`, `AUTO_SCAN_LAYERS`), and what a
config implies about the parameter tree (`LINEAR_NAMES`, `block_params`, `linear_paths`).

The network built from it is `nvfp4_train.model.decoder.Llama`.

Example:
    >>> cfg = ModelConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
    ...                   mlp_dim=128)
    >>> linear_paths(cfg)[:2]
    ['layers.0.attn.qkv', 'layers.0.attn.o']
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp

import nvfp4_ops
from nvfp4_train.model.blocks.attention import ATTENTION_IMPLEMENTATIONS, SAVES_ATTENTION
from nvfp4_train.model.blocks.mamba_config import MambaConfig
from nvfp4_train.model.moe.config import MoEConfig, check_moe_architecture
from nvfp4_train.model.mtp.config import MTPConfig
from nvfp4_train.model.pattern import pattern_kinds
from nvfp4_train.model.structure import (  # re-exported: what a config implies about the tree
    BLOCK_KEYS as BLOCK_KEYS,
)
from nvfp4_train.model.structure import (
    LINEAR_NAMES as LINEAR_NAMES,
)
from nvfp4_train.model.structure import (
    MAMBA_PARAMS as MAMBA_PARAMS,
)
from nvfp4_train.model.structure import (
    MIXER_LINEAR_NAMES as MIXER_LINEAR_NAMES,
)
from nvfp4_train.model.structure import (
    MOE_LINEAR_NAMES as MOE_LINEAR_NAMES,
)
from nvfp4_train.model.structure import (
    block_kinds as block_kinds,
)
from nvfp4_train.model.structure import (
    block_linear_names as block_linear_names,
)
from nvfp4_train.model.structure import (
    block_params as block_params,
)
from nvfp4_train.model.structure import (
    input_amax_shape as input_amax_shape,
)
from nvfp4_train.model.structure import (
    is_moe_block as is_moe_block,
)
from nvfp4_train.model.structure import (
    linear_paths as linear_paths,
)
from nvfp4_train.model.structure import (
    moe_blocks_note as moe_blocks_note,
)
from nvfp4_train.model.structure import (
    moe_layers as moe_layers,
)

_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
ARCHITECTURES = (
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe", "nemotron_h"
)  # fmt: skip
"""The Hugging Face `model_type`s this decoder computes (see `ModelConfig.architecture`);
qwen3_moe, mixtral and qwen2_moe are Mixture-of-Experts classes (`moe.config.MOE_ARCHITECTURES`),
nemotron_h the hybrid Mamba-Transformer (`HYBRID_ARCHITECTURES`: a `model.pattern`)."""
HYBRID_ARCHITECTURES = ("nemotron_h",)
"""The `model.architecture`s whose blocks follow `model.pattern` (one mixer per block)."""
AUTO_SCAN_LAYERS = 8
"""`scan_layers: auto` scans models of at least this many blocks."""
_NAMES = jax.checkpoint_policies.save_only_these_names(nvfp4_ops.RESIDUAL_NAME)
_KEPT = jax.checkpoint_policies.save_from_both_policies(_NAMES, SAVES_ATTENTION)
REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "quantized": _NAMES,
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_saveable, _KEPT
    ),
    "dots_no_batch": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _KEPT
    ),
}
"""`model.remat` -> the `jax.checkpoint` policy of each block (None: no rematerialisation).

full: keep only each block's input, recompute the rest; quantized: also keep the FP4 operands the
quantized linears saved for their backward pass (`nvfp4_ops.RESIDUAL_NAME`) and recompute
everything else (norms, attention, BF16 linears); dots / dots_no_batch: keep the outputs of every
matmul (without batch dimensions) plus those FP4 operands and what a fused attention's backward
reads (`attention.SAVES_ATTENTION`: its output and softmax statistics; a custom call or a loop is
not a dot, so without it the forward of te, cudnn and chunked ran twice), recompute the
elementwise work.
"""


def _check(ok: bool, key: str, expected: str, actual: object) -> None:
    if not ok:
        raise ValueError(f"model.{key} must be {expected}, got {actual!r}")


ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as Hugging Face's `rope_scaling` / `rope_parameters` say it.

    Attributes:
        rope_type: "default" (none), "linear" (every frequency / `factor`) or "llama3"
            (Llama 3.1/3.2: low frequencies / `factor`, high ones kept, a smooth ramp between).
        factor: the context extension factor.
        low_freq_factor, high_freq_factor: "llama3": the wavelength band
            (`original_max_position_embeddings / factor`) of the ramp.
        original_max_position_embeddings: "llama3": the context the model was pretrained on.
    """

    rope_type: Literal["default", "linear", "llama3"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        key = "rope_scaling"
        _check(self.rope_type in ROPE_TYPES, f"{key}.rope_type", f"one of {ROPE_TYPES}",
               self.rope_type)  # fmt: skip
        _check(self.factor > 0, f"{key}.factor", "> 0", self.factor)
        _check(0 < self.low_freq_factor < self.high_freq_factor, f"{key}.low_freq_factor",
               f"> 0 and < high_freq_factor={self.high_freq_factor}", self.low_freq_factor)  # fmt: skip
        _check(self.original_max_position_embeddings > 0,
               f"{key}.original_max_position_embeddings", "> 0",
               self.original_max_position_embeddings)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of the Llama decoder.

    Attributes:
        vocab_size: Vocabulary size; 0 means "take it from the data" (see `with_vocab_size`).
        d_model: Residual width; a multiple of 16 (NVFP4 blocks are 16 wide).
        num_layers: Number of decoder blocks.
        num_heads: Query heads.
        num_kv_heads: Key/value heads (grouped-query attention); must divide `num_heads`.
        head_dim: Per-head width; 0 means `d_model // num_heads`. Must be even (RoPE).
        mlp_dim: SwiGLU hidden width; a multiple of 16.
        max_seq_len: Longest sequence the model accepts.
        rope_theta: RoPE base frequency.
        rms_norm_eps: RMSNorm epsilon.
        tie_embeddings: Use the embedding matrix as the output head.
        rope_scaling: RoPE frequency scaling (`RopeScaling`; Llama 3.1 / 3.2 use "llama3").
        qkv_bias: q, k and v projections have biases (Qwen 2; Llama/Qwen 3 `attention_bias`).
        o_bias: the output projection has a bias (Llama/Qwen 3 `attention_bias`).
        qk_norm: RMSNorm over each head's q and k before RoPE, one [head_dim] scale each (Qwen 3).
        architecture: the Hugging Face `model_type` the model is exported as ("llama",
            "mistral", "qwen2", "qwen3", the MoE classes "qwen3_moe", "mixtral", "qwen2_moe",
            and the hybrid "nemotron_h"; `ARCHITECTURES`); the bias and norm options must be
            ones it can express (e.g. qwen2: q/k/v biases and no o bias), and an MoE class
            needs `moe` blocks it builds (`moe.config.MOE_ARCHITECTURES`).
        init_from: a Hugging Face model directory (`config.json`, safetensors weights,
            `tokenizer.json`) to start from instead of a random init. The config loader fills
            this section from its `config.json` (`nvfp4_train.model.hf.config`); a fresh run reads
            its weights (`nvfp4_train.model.hf.weights`), a resumed one its checkpoint.
        init_std: Std of the normal init; `attn.o` and `mlp.down` use init_std / sqrt(2 * num_layers).
        dtype: Compute dtype: "bfloat16", "float32" or "float16" (parameters stay float32).
        scan_layers: Store each run of >= 2 consecutive blocks with the same recipes stacked and
            run it under `jax.lax.scan` (compile time then hardly grows with depth): true, false,
            or "auto" (scan from `AUTO_SCAN_LAYERS` blocks on). Checkpoints stay per-layer, so a
            run may resume with another setting.
        remat: Rematerialisation of each block in the backward pass: "none", "full",
            "quantized", "dots" or "dots_no_batch" (`REMAT_POLICIES`). It changes memory and
            time, never the numbers.
        attention: how causal attention is computed ("auto", "naive", "xla", "cudnn", "te",
            "chunked"; `nvfp4_train.model.blocks.attention`). "auto": on an NVIDIA GPU (bfloat16 / float16)
            TransformerEngine's fused attention where TE is installed and the GPU runs it (sm_90+,
            cuDNN >= 9.6, head_dim % 16 == 0), else cudnn; elsewhere "chunked" from
            `attention.AUTO_CHUNKED_FROM` tokens, else "naive". A fused kernel is checked
            against the reference before a run uses it (`precision.verify_backend`); one that
            fails gives way to the next fused kernel, then to the unfused ones.
            The implementations agree to float32 rounding; a run may resume with another.
        attention_block: "chunked": the tile size along the sequence (tokens; memory grows as
            L x attention_block). Any length works (padded to a multiple of it).
        attention_max_documents: "te": the most documents one packed row may hold (cuDNN gets
            one sequence slot per document; TE's compile time and memory grow with it); 0: the
            most any row of the run's data holds, counted at start-up (a run without documents:
            1). Every training and validation batch is checked against it.
        moe: Mixture-of-Experts blocks (`MoEConfig`; `num_experts: 0`, the default, is dense).
        pattern: "" (every block attention + MLP), or a hybrid model's blocks, one mixer each
            (`nvfp4_train.model.pattern`): Nemotron's letters (`M` Mamba-2, `*` attention, `-`
            MLP, `E` MoE) or a list of kinds, one per block; needs architecture "nemotron_h".
        mamba: the Mamba-2 mixer of the `M` blocks (`MambaConfig`).
        rope: rotary position embeddings in attention (Nemotron-H's attention has none).
        mlp_activation: "swiglu" (gated, `mlp.gate_up`) or "relu2" (Nemotron-H's
            `down(relu(up x)^2)`, `mlp.up`), for the dense MLPs.
        mtp: multi-token prediction layers (`MTPConfig`, `nvfp4_train.model.mtp`; `num_layers:
            0`, the default, is none); a hybrid model's only.

    Example:
        >>> ModelConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
        ...             mlp_dim=128).resolved_head_dim
        16
    """

    vocab_size: int = 0
    d_model: int = 256
    num_layers: int = 6
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 0
    mlp_dim: int = 768
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    rope_scaling: RopeScaling = dataclasses.field(default_factory=RopeScaling)
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    architecture: Literal[
        "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe", "nemotron_h"
    ] = "llama"
    init_from: str = ""
    tie_embeddings: bool = False
    init_std: float = 0.02
    dtype: str = "bfloat16"
    scan_layers: bool | Literal["auto"] = "auto"
    remat: Literal["none", "full", "quantized", "dots", "dots_no_batch"] = "none"
    attention: Literal["auto", "naive", "xla", "cudnn", "te", "chunked"] = "auto"
    attention_block: int = 512
    attention_max_documents: int = 0
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
    pattern: str | tuple[str, ...] = ""
    mamba: MambaConfig = dataclasses.field(default_factory=MambaConfig)
    rope: bool = True
    mlp_activation: Literal["swiglu", "relu2"] = "swiglu"
    mtp: MTPConfig = dataclasses.field(default_factory=MTPConfig)

    def __post_init__(self):
        _check_shape(self)
        _check_architecture(self)
        _check_hybrid(self)
        _check_some_block_is_moe(self)

    @property
    def resolved_head_dim(self) -> int:
        """`head_dim`, or `d_model // num_heads` when it is 0."""
        return self.head_dim or self.d_model // self.num_heads

    @property
    def scans(self) -> bool:
        """Whether runs of alike blocks are stacked and scanned (`scan_layers`, "auto" resolved)."""
        if self.scan_layers == "auto":
            return self.num_layers >= AUTO_SCAN_LAYERS
        return bool(self.scan_layers)

    @property
    def compute_dtype(self) -> jnp.dtype:
        """The compute dtype as a JAX dtype."""
        return _DTYPES[self.dtype]


ARCHITECTURE_OPTIONS = {
    "llama": tuple({"qkv_bias": b, "o_bias": b, "qk_norm": False} for b in (False, True)),
    "mistral": ({"qkv_bias": False, "o_bias": False, "qk_norm": False},),
    "qwen2": ({"qkv_bias": True, "o_bias": False, "qk_norm": False},),
    "qwen3": tuple({"qkv_bias": b, "o_bias": b, "qk_norm": True} for b in (False, True)),
    "qwen3_moe": tuple({"qkv_bias": b, "o_bias": b, "qk_norm": True} for b in (False, True)),
    "mixtral": ({"qkv_bias": False, "o_bias": False, "qk_norm": False},),
    "qwen2_moe": ({"qkv_bias": True, "o_bias": False, "qk_norm": False},),
}
"""`model.architecture` -> the (qkv_bias, o_bias, qk_norm) its Hugging Face class builds.
nvfp4-export repeats this table (`nvfp4_export.model_spec.ARCHITECTURE_OPTIONS`) for hand-edited
configs; integration_tests/test_policy_agreement.py keeps the two equal."""


def _check_shape(cfg: ModelConfig) -> None:
    """Raises ValueError naming the first `model.*` size that is out of range."""
    for name in ("d_model", "num_layers", "num_heads", "num_kv_heads", "mlp_dim", "max_seq_len"):
        _check(getattr(cfg, name) > 0, name, "> 0", getattr(cfg, name))
    _check(cfg.vocab_size >= 0, "vocab_size", ">= 0 (0 = take from data)", cfg.vocab_size)
    _check(cfg.head_dim >= 0, "head_dim", ">= 0 (0 = d_model // num_heads)", cfg.head_dim)
    _check(cfg.dtype in _DTYPES, "dtype", f"one of {sorted(_DTYPES)}", cfg.dtype)
    for name in ("rope_theta", "rms_norm_eps", "init_std", "attention_block"):
        _check(getattr(cfg, name) > 0, name, "> 0", getattr(cfg, name))
    _check(cfg.scan_layers in (True, False, "auto"), "scan_layers", "true, false or 'auto'",
           cfg.scan_layers)  # fmt: skip
    _check(cfg.remat in REMAT_POLICIES, "remat", f"one of {list(REMAT_POLICIES)}", cfg.remat)
    _check(cfg.attention in ATTENTION_IMPLEMENTATIONS, "attention",
           f"one of {list(ATTENTION_IMPLEMENTATIONS)}", cfg.attention)  # fmt: skip
    _check(cfg.attention_max_documents >= 0, "attention_max_documents",
           ">= 0 (0 = one per token)", cfg.attention_max_documents)  # fmt: skip
    _check(cfg.architecture in ARCHITECTURES, "architecture", f"one of {ARCHITECTURES}",
           cfg.architecture)  # fmt: skip
    _check(cfg.mlp_activation in ("swiglu", "relu2"), "mlp_activation", "'swiglu' or 'relu2'",
           cfg.mlp_activation)  # fmt: skip
    _check(cfg.num_heads % cfg.num_kv_heads == 0, "num_kv_heads",
           f"a divisor of num_heads={cfg.num_heads}", cfg.num_kv_heads)  # fmt: skip
    if cfg.head_dim == 0:
        _check(cfg.d_model % cfg.num_heads == 0, "num_heads",
               f"a divisor of d_model={cfg.d_model} when head_dim=0", cfg.num_heads)  # fmt: skip
    hd = cfg.resolved_head_dim
    _check(hd % 2 == 0 or not cfg.rope, "head_dim", "even (RoPE rotates pairs)", hd)
    widths = {
        "d_model": cfg.d_model,
        "mlp_dim": cfg.mlp_dim,
        "num_heads * head_dim": cfg.num_heads * hd,
        "(num_heads + 2 * num_kv_heads) * head_dim": (cfg.num_heads + 2 * cfg.num_kv_heads) * hd,
    }
    if "mamba" in block_kinds(cfg):
        m = cfg.mamba
        widths |= {"mamba.num_heads * mamba.head_dim": m.inner,
                   "mamba in_proj width (2 * d_inner + 2 * n_groups * state_dim + num_heads)":
                   m.in_proj_width}  # fmt: skip
    for name, width in widths.items():
        _check(width % 16 == 0, name, "a multiple of 16 (NVFP4 blocks are 16 wide)", width)
    late = [i for i in cfg.moe.dense_layers if i >= cfg.num_layers]
    _check(not late, "moe.dense_layers", f"block indices < num_layers={cfg.num_layers}",
           list(cfg.moe.dense_layers))  # fmt: skip


def _check_architecture(cfg: ModelConfig) -> None:
    """Raises ValueError unless `cfg.architecture` can express the bias and norm options."""
    options = {"qkv_bias": cfg.qkv_bias, "o_bias": cfg.o_bias, "qk_norm": cfg.qk_norm}
    allowed = ARCHITECTURE_OPTIONS.get(cfg.architecture, ARCHITECTURE_OPTIONS["mistral"])
    if options not in allowed:
        raise ValueError(
            f"model.architecture={cfg.architecture!r} builds {' or '.join(map(str, allowed))}; "
            f"got {options}"
        )
    check_moe_architecture(cfg.architecture, cfg.moe)


def _check_hybrid(cfg: ModelConfig) -> None:
    """Raises ValueError naming the key unless the pattern, the architecture and the sections its
    blocks read agree: a pattern exactly for a hybrid architecture, one kind per block, MoE
    settings exactly when it has `E` blocks (and then none of the block-choosing keys)."""
    hybrid = cfg.architecture in HYBRID_ARCHITECTURES
    _check(not cfg.mtp.num_layers or cfg.pattern, "mtp.num_layers",
           "0 without a model.pattern (MTP layers are hybrid blocks)",
           cfg.mtp.num_layers)  # fmt: skip
    if not cfg.pattern:
        _check(not hybrid, "pattern", f"set for model.architecture={cfg.architecture!r} (a "
               "hybrid: one letter per block, e.g. 'M-M*-')", cfg.pattern)  # fmt: skip
        _check(cfg.rope and cfg.mlp_activation == "swiglu", "pattern",
               "set to use rope=false or mlp_activation='relu2' (hybrid blocks only)",
               cfg.pattern)  # fmt: skip
        return
    _check(hybrid, "architecture", f"one of {HYBRID_ARCHITECTURES} with a model.pattern",
           cfg.architecture)  # fmt: skip
    kinds = pattern_kinds(cfg.pattern)
    _check(len(kinds) == cfg.num_layers, "pattern",
           f"one kind per block: num_layers={cfg.num_layers} of them, got {len(kinds)} in",
           cfg.pattern)  # fmt: skip
    has_moe = "moe" in kinds or (cfg.mtp.num_layers > 0 and "moe" in cfg.mtp.kinds)
    _check(has_moe == (cfg.moe.num_experts > 0), "moe.num_experts",
           "> 0 exactly when model.pattern (or model.mtp.pattern) has MoE blocks (E)",
           cfg.moe.num_experts)  # fmt: skip
    for key in ("first_dense_layers", "layer_freq", "dense_layers"):
        default = getattr(MoEConfig(), key)
        _check(getattr(cfg.moe, key) == default, f"moe.{key}",
               f"{default!r} with a model.pattern (the pattern's E letters say which blocks are "
               "MoE)", getattr(cfg.moe, key))  # fmt: skip


def _check_some_block_is_moe(cfg: ModelConfig) -> None:
    """Raises ValueError when `model.moe` asks for experts but its block-choosing keys leave every
    block dense (the run would train the dense model while its config says MoE). A pattern's
    `E` letters are checked by `_check_hybrid`."""
    moe = cfg.moe
    if cfg.pattern or not moe.num_experts or moe_layers(cfg):
        return
    raise ValueError(
        f"model.moe.num_experts={moe.num_experts} but no block is MoE: "
        f"model.moe.first_dense_layers={moe.first_dense_layers}, "
        f"model.moe.layer_freq={moe.layer_freq} and model.moe.dense_layers="
        f"{list(moe.dense_layers)} leave all num_layers={cfg.num_layers} blocks dense "
        "(set model.moe.num_experts=0 for a dense model)"
    )
