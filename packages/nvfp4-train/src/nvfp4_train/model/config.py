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
from nvfp4_train.model.moe.config import MoEConfig, check_moe_architecture, is_moe_layer

_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
LINEAR_NAMES = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
"""The quantizable linears of a dense block, in the order their SR keys are derived (0..3)."""
MOE_LINEAR_NAMES = (
    "attn.qkv",
    "attn.o",
    "mlp.experts.gate_up",
    "mlp.experts.down",
    "mlp.shared.gate_up",
    "mlp.shared.down",
)
"""The quantizable linears of an MoE block (the shared ones only with `moe.shared_experts`), in
the order their SR keys are derived (0..5). The router and the shared-expert gate never quantize."""
BLOCK_KEYS = len(MOE_LINEAR_NAMES)
"""How many SR keys every block is given (a dense block uses the first four)."""
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe")
"""The Hugging Face `model_type`s this decoder computes (see `ModelConfig.architecture`); the
last three are Mixture-of-Experts classes (`moe_config.MOE_ARCHITECTURES`)."""
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
            "mistral", "qwen2", "qwen3", and the MoE classes "qwen3_moe", "mixtral",
            "qwen2_moe"; `ARCHITECTURES`); the bias and norm options must be ones it can express
            (e.g. qwen2: q/k/v biases and no o bias), and an MoE class needs `moe` blocks it
            builds (`moe_config.MOE_ARCHITECTURES`).
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
        "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe"
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

    def __post_init__(self):
        for name in (
            "d_model",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "mlp_dim",
            "max_seq_len",
        ):
            _check(getattr(self, name) > 0, name, "> 0", getattr(self, name))
        _check(self.vocab_size >= 0, "vocab_size", ">= 0 (0 = take from data)", self.vocab_size)
        _check(self.head_dim >= 0, "head_dim", ">= 0 (0 = d_model // num_heads)", self.head_dim)
        _check(self.dtype in _DTYPES, "dtype", f"one of {sorted(_DTYPES)}", self.dtype)
        _check(self.rope_theta > 0, "rope_theta", "> 0", self.rope_theta)
        _check(self.rms_norm_eps > 0, "rms_norm_eps", "> 0", self.rms_norm_eps)
        _check(self.init_std > 0, "init_std", "> 0", self.init_std)
        _check(self.scan_layers in (True, False, "auto"), "scan_layers", "true, false or 'auto'",
               self.scan_layers)  # fmt: skip
        _check(self.remat in REMAT_POLICIES, "remat", f"one of {list(REMAT_POLICIES)}", self.remat)
        _check(self.attention in ATTENTION_IMPLEMENTATIONS, "attention",
               f"one of {list(ATTENTION_IMPLEMENTATIONS)}", self.attention)  # fmt: skip
        _check(self.attention_block > 0, "attention_block", "> 0", self.attention_block)
        _check(self.attention_max_documents >= 0, "attention_max_documents",
               ">= 0 (0 = one per token)", self.attention_max_documents)  # fmt: skip
        _check(self.architecture in ARCHITECTURES, "architecture", f"one of {ARCHITECTURES}",
               self.architecture)  # fmt: skip
        _check_architecture(self)
        _check(
            self.num_heads % self.num_kv_heads == 0,
            "num_kv_heads",
            f"a divisor of num_heads={self.num_heads}",
            self.num_kv_heads,
        )
        if self.head_dim == 0:
            _check(
                self.d_model % self.num_heads == 0,
                "num_heads",
                f"a divisor of d_model={self.d_model} when head_dim=0",
                self.num_heads,
            )
        hd = self.resolved_head_dim
        _check(hd % 2 == 0, "head_dim", "even (RoPE rotates pairs)", hd)
        widths = {
            "d_model": self.d_model,
            "mlp_dim": self.mlp_dim,
            "num_heads * head_dim": self.num_heads * hd,
            "(num_heads + 2 * num_kv_heads) * head_dim": (self.num_heads + 2 * self.num_kv_heads)
            * hd,
        }
        for name, width in widths.items():
            _check(width % 16 == 0, name, "a multiple of 16 (NVFP4 blocks are 16 wide)", width)
        late = [i for i in self.moe.dense_layers if i >= self.num_layers]
        _check(not late, "moe.dense_layers", f"block indices < num_layers={self.num_layers}",
               list(self.moe.dense_layers))  # fmt: skip

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


def _check_architecture(cfg: ModelConfig) -> None:
    """Raises ValueError unless `cfg.architecture` can express the bias and norm options."""
    options = {"qkv_bias": cfg.qkv_bias, "o_bias": cfg.o_bias, "qk_norm": cfg.qk_norm}
    allowed = ARCHITECTURE_OPTIONS[cfg.architecture]
    if options not in allowed:
        raise ValueError(
            f"model.architecture={cfg.architecture!r} builds {' or '.join(map(str, allowed))}; "
            f"got {options}"
        )
    check_moe_architecture(cfg.architecture, cfg.moe)


def block_linear_names(cfg: ModelConfig, index: int) -> tuple[str, ...]:
    """The quantizable linears of block `index`, relative to `layers.{index}`, in SR-key order:
    `LINEAR_NAMES`, or for an MoE block `MOE_LINEAR_NAMES` (without the shared experts when
    there are none)."""
    if not is_moe_layer(cfg.moe, index):
        return LINEAR_NAMES
    return MOE_LINEAR_NAMES if cfg.moe.shared_experts else MOE_LINEAR_NAMES[:4]


def block_params(cfg: ModelConfig, index: int) -> tuple[str, ...]:
    """Every parameter of block `index`, relative to `layers.{index}`, in tree order."""
    attn = ["attn.qkv.kernel", "attn.o.kernel"]
    attn += ["attn.qkv.bias"] * cfg.qkv_bias + ["attn.o.bias"] * cfg.o_bias
    attn += ["attn.q_norm.scale", "attn.k_norm.scale"] * cfg.qk_norm
    mlp = ["mlp.gate_up.kernel", "mlp.down.kernel"]
    if is_moe_layer(cfg.moe, index):
        mlp = ["mlp.router.kernel", "mlp.router.score_bias", "mlp.experts.gate_up.kernel",
               "mlp.experts.down.kernel"]  # fmt: skip
        mlp += ["mlp.shared.gate_up.kernel", "mlp.shared.down.kernel"] * bool(
            cfg.moe.shared_experts
        )
        mlp += ["mlp.shared_gate.kernel"] * cfg.moe.shared_expert_gate
    return ("attn_norm.scale", *attn, "mlp_norm.scale", *mlp)


def linear_paths(cfg: ModelConfig) -> list[str]:
    """Module paths of every quantizable linear, e.g. `layers.0.attn.qkv`, in model order."""
    return [
        f"layers.{i}.{name}" for i in range(cfg.num_layers) for name in block_linear_names(cfg, i)
    ]


def input_amax_shape(cfg: ModelConfig, path: str) -> tuple[int, ...]:
    """The shape of the input amax a linear reports (`layers.INPUT_AMAX`): a scalar, or one per
    expert for the routed experts' linears (`layers.{i}.mlp.experts.*`)."""
    return (cfg.moe.num_experts,) if ".mlp.experts." in path else ()


def moe_layers(cfg: ModelConfig) -> list[int]:
    """The indices of the MoE blocks (none for a dense model)."""
    return [i for i in range(cfg.num_layers) if is_moe_layer(cfg.moe, i)]
