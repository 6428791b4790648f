"""The Llama shape and numerics of a checkpoint, taken from its config and checked against its params.

Parameter names (the training model's tree, float32, kernels [in, out]):
    embed.embedding [V, D]; final_norm.scale [D]; lm_head.kernel [D, V] (absent when tied);
    layers.{i}.attn_norm.scale, layers.{i}.mlp_norm.scale [D];
    layers.{i}.attn.qkv.kernel [D, (H + 2G) * K]   columns q | k | v, each head's K columns contiguous;
    layers.{i}.attn.o.kernel [H * K, D]; layers.{i}.mlp.gate_up.kernel [D, 2F] (gate | up);
    layers.{i}.mlp.down.kernel [F, D];
    with `qkv_bias` layers.{i}.attn.qkv.bias [(H + 2G) * K], with `o_bias` layers.{i}.attn.o.bias
    [D], with `qk_norm` layers.{i}.attn.q_norm.scale and layers.{i}.attn.k_norm.scale [K].

`architecture` is the Hugging Face `model_type` the export is written as (llama, mistral, qwen2,
qwen3, and the Mixture-of-Experts qwen3_moe, mixtral, qwen2_moe); the bias and norm options are
those its model class builds. An MoE block `i` (`LlamaSpec.is_moe_layer`) has instead of
`mlp.gate_up` / `mlp.down`: layers.{i}.mlp.router.kernel [D, E], layers.{i}.mlp.router.score_bias
[E] (zero: no exported class has it), layers.{i}.mlp.experts.gate_up.kernel [E, D, 2F] (per expert
gate | up), layers.{i}.mlp.experts.down.kernel [E, F, D], and with a shared expert
layers.{i}.mlp.shared.gate_up.kernel [D, 2S], layers.{i}.mlp.shared.down.kernel [S, D],
layers.{i}.mlp.shared_gate.kernel [D, 1] (`moe_spec`). A `nemotron_h` block: `hybrid_spec`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from nvfp4_export.dense_names import (
    EMBED,
    FINAL_NORM,
    LAYER_TENSORS,
    LM_HEAD,
    MODEL_TENSORS,
    DenseTensor,
)
from nvfp4_export.errors import ExportError
from nvfp4_export.hybrid_names import hybrid_dense_entries
from nvfp4_export.hybrid_spec import HybridSpec, hybrid_fields
from nvfp4_export.moe_spec import (
    EXPERT_LINEARS,
    MOE_CLASSES,
    SHARED_LINEARS,
    moe_fields,
    router_tensor,
    shared_gate_tensor,
)
from nvfp4_export.rope import ROPE_TYPES, rope_inv_freq, rope_scaling_of, scaled_rope

COMPUTE_DTYPES = ("bfloat16", "float32", "float16")
LINEAR_NAMES = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    **{kind: names.hf_class for kind, names in MOE_CLASSES.items()},
    "nemotron_h": "NemotronHForCausalLM",
}
"""Hugging Face `model_type` -> its causal-LM class (config.json `architectures`)."""
ARCHITECTURE_OPTIONS = {
    "llama": ({"qkv_bias": False, "o_bias": False, "qk_norm": False},
              {"qkv_bias": True, "o_bias": True, "qk_norm": False}),
    "mistral": ({"qkv_bias": False, "o_bias": False, "qk_norm": False},),
    "qwen2": ({"qkv_bias": True, "o_bias": False, "qk_norm": False},),
    "qwen3": ({"qkv_bias": False, "o_bias": False, "qk_norm": True},
              {"qkv_bias": True, "o_bias": True, "qk_norm": True}),
    "qwen3_moe": ({"qkv_bias": False, "o_bias": False, "qk_norm": True},
                  {"qkv_bias": True, "o_bias": True, "qk_norm": True}),
    "mixtral": ({"qkv_bias": False, "o_bias": False, "qk_norm": False},),
    "qwen2_moe": ({"qkv_bias": True, "o_bias": False, "qk_norm": False},),
    "nemotron_h": ({"qkv_bias": False, "o_bias": False, "qk_norm": False},),
}  # fmt: skip
"""`model_type` -> the (qkv_bias, o_bias, qk_norm) its Hugging Face class can build: Llama's and
Qwen 3's `attention_bias` switches the q/k/v and o_proj biases together, Qwen 2 always has q/k/v
biases and no o_proj bias, Mistral has none; only Qwen 3 has q/k norms. The same table as
training's `ModelConfig` check (nvfp4_train.model.config.ARCHITECTURE_OPTIONS), kept here
because export never imports training; integration_tests/test_policy_agreement.py keeps them equal."""


@dataclasses.dataclass(frozen=True)
class LlamaSpec:
    """Dimensions and numerics of the decoder (names follow the training config's `model:` section).

    Example:
        >>> LlamaSpec(vocab_size=257, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
        ...           head_dim=16, mlp_dim=192).qkv_split
        (64, 32, 32)
    """

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: str = "bfloat16"
    architecture: str = "llama"
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = None
    num_experts: int = 0
    experts_per_token: int = 0
    expert_mlp_dim: int = 0
    shared_mlp_dim: int = 0
    shared_expert_gate: bool = False
    norm_topk_prob: bool = True
    moe_layer_freq: int = 1
    moe_dense_layers: tuple[int, ...] = ()
    hybrid: HybridSpec | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "moe_dense_layers", tuple(self.moe_dense_layers))
        if isinstance(self.hybrid, dict):  # read back from a manifest
            object.__setattr__(self, "hybrid", HybridSpec(**self.hybrid))
        _check_choices(self)
        _check_widths(self)

    @property
    def qkv_split(self) -> tuple[int, int, int]:
        """Output rows of q, k and v inside the fused `attn.qkv` (in that order)."""
        kv = self.num_kv_heads * self.head_dim
        return (self.num_heads * self.head_dim, kv, kv)

    @property
    def scaled_rope(self) -> dict[str, Any] | None:
        """`rope_scaling` unless it is None or of rope_type "default" (then None)."""
        return scaled_rope(self.rope_scaling)

    def rope_inv_freq(self) -> np.ndarray:
        """float32 [head_dim / 2] RoPE frequencies, scaled by `rope_scaling` (HF's formulas)."""
        return rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)

    def has(self, t: DenseTensor) -> bool:
        """Whether a model of this spec has dense tensor `t` (`dense_names`): it has no flag, or
        the spec's flag of that name is `t.when`."""
        return t.flag is None or getattr(self, t.flag) == t.when

    def is_moe_layer(self, i: int) -> bool:
        """Whether block `i` is an MoE block (training's `moe_config.is_moe_layer`; the first
        dense blocks are among `moe_dense_layers`)."""
        return bool(
            self.num_experts
            and (i + 1) % self.moe_layer_freq == 0
            and i not in self.moe_dense_layers
        )

    def block_linear_names(self, i: int) -> tuple[str, ...]:
        """The quantizable linears of block `i`, relative to `layers.{i}` (training's order)."""
        if self.hybrid:
            return self.hybrid.block_linear_names(i)
        if not self.is_moe_layer(i):
            return LINEAR_NAMES
        return (
            "attn.qkv",
            "attn.o",
            *EXPERT_LINEARS,
            *SHARED_LINEARS[: 2 * bool(self.shared_mlp_dim)],
        )

    def linear_paths(self) -> list[str]:
        """`layers.{i}.attn.qkv`, ... for every quantizable linear, in model order."""
        return [
            f"layers.{i}.{n}" for i in range(self.num_layers) for n in self.block_linear_names(i)
        ]

    def moe_layers(self) -> list[int]:
        """The MoE blocks."""
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    def _dense_shapes(self) -> dict[str, tuple[int, ...]]:
        """`dense_names` key (per-layer ones unplaced: "attn_norm", ...) -> its parameter's shape."""
        d, v, k = self.d_model, self.vocab_size, self.head_dim
        return {
            "embed": (v, d), "final_norm": (d,), "lm_head": (d, v),
            "attn_norm": (d,), "mlp_norm": (d,), "qkv_bias": (sum(self.qkv_split),),
            "o_bias": (d,), "q_norm": (k,), "k_norm": (k,),
        }  # fmt: skip

    def expected_params(self) -> dict[str, tuple[int, ...]]:
        """Parameter path -> shape, exactly the tree the training model has."""
        d, f, dense = self.d_model, self.mlp_dim, self._dense_shapes()
        shapes = {t.param: dense[t.key] for t in MODEL_TENSORS if self.has(t)}
        if self.hybrid:
            return shapes | self.hybrid.layer_params(self)
        for i in range(self.num_layers):
            p = f"layers.{i}."
            shapes[p + "attn.qkv.kernel"] = (d, sum(self.qkv_split))
            shapes[p + "attn.o.kernel"] = (self.num_heads * self.head_dim, d)
            if self.is_moe_layer(i):
                shapes.update({p + k: v for k, v in self._moe_shapes().items()})
            else:
                shapes[p + "mlp.gate_up.kernel"] = (d, 2 * f)
                shapes[p + "mlp.down.kernel"] = (f, d)
            for t in LAYER_TENSORS:
                if self.has(t):
                    shapes[t.in_layer(i).param] = dense[t.key]
        return shapes

    def _moe_shapes(self) -> dict[str, tuple[int, ...]]:
        """An MoE block's MLP parameters (relative to `layers.{i}.`) -> shapes."""
        d, e, f, s = self.d_model, self.num_experts, self.expert_mlp_dim, self.shared_mlp_dim
        shapes = {
            "mlp.router.kernel": (d, e), "mlp.router.score_bias": (e,),
            "mlp.experts.gate_up.kernel": (e, d, 2 * f), "mlp.experts.down.kernel": (e, f, d),
        }  # fmt: skip
        if s:
            shapes |= {"mlp.shared.gate_up.kernel": (d, 2 * s), "mlp.shared.down.kernel": (s, d)}
        if self.shared_expert_gate:
            shapes["mlp.shared_gate.kernel"] = (d, 1)
        return shapes


def _check_choices(spec: LlamaSpec) -> None:
    """ExportError unless the spec's dtype, architecture and RoPE type are ones export writes."""
    if spec.dtype not in COMPUTE_DTYPES:
        raise ExportError(f"model.dtype must be one of {COMPUTE_DTYPES}, got {spec.dtype!r}")
    if spec.architecture not in ARCHITECTURES:
        raise ExportError(
            f"model.architecture must be one of {sorted(ARCHITECTURES)}, got {spec.architecture!r}"
        )
    rope_type = (spec.rope_scaling or {}).get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ExportError(f"model.rope_scaling.rope_type {rope_type!r} is not one of {ROPE_TYPES}")


def _check_widths(spec: LlamaSpec) -> None:
    """ExportError unless the kv heads divide the heads and each linear input is 16-blocked."""
    if spec.num_heads % spec.num_kv_heads:
        raise ExportError(
            f"model.num_kv_heads must divide num_heads={spec.num_heads}, got {spec.num_kv_heads}"
        )
    widths = {
        "d_model": spec.d_model,
        "mlp_dim": spec.mlp_dim,
        "num_heads * head_dim": spec.num_heads * spec.head_dim,
        "model.moe.expert_mlp_dim": spec.expert_mlp_dim,
        "the shared experts' width": spec.shared_mlp_dim,
        **(spec.hybrid.widths() if spec.hybrid else {}),
    }
    for name, width in widths.items():
        if width % 16:
            raise ExportError(
                f"{name} must be a multiple of 16 (NVFP4 blocks are 16 wide along a linear's "
                f"input), got {width}"
            )


def moe_dense_entries(spec: LlamaSpec, i: int) -> list[DenseTensor]:
    """The BF16 tensors of MoE block `i` besides its linears: the router [E, D] and Qwen2-MoE's
    shared-expert gate [1, D] (both transposed from their [D, E] / [D, 1] kernels)."""
    if not spec.is_moe_layer(i):
        return []
    p, arch = f"layers.{i}.", spec.architecture
    out = [DenseTensor(p + "router", p + "mlp.router.kernel", router_tensor(arch, i),
                       transposed=True, layer=i)]  # fmt: skip
    if spec.shared_expert_gate:
        out.append(DenseTensor(p + "shared_gate", p + "mlp.shared_gate.kernel",
                               shared_gate_tensor(i), transposed=True, layer=i))  # fmt: skip
    return out


def dense_entries(spec: LlamaSpec) -> list[DenseTensor]:
    """The dense tensors a model of `spec` has, placed, in model order: embed, layer 0's, ...,
    final_norm, lm_head.

    Example:
        >>> spec = LlamaSpec(vocab_size=32, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
        ...                  head_dim=16, mlp_dim=32, qk_norm=True)
        >>> [t.hf_name for t in dense_entries(spec) if t.layer is not None][-2:]
        ['model.layers.0.self_attn.q_norm.weight', 'model.layers.0.self_attn.k_norm.weight']
    """
    if spec.hybrid:
        return hybrid_dense_entries(spec)
    layers = [
        t
        for i in range(spec.num_layers)
        for t in [
            *(t.in_layer(i) for t in LAYER_TENSORS if spec.has(t)),
            *moe_dense_entries(spec, i),
        ]
    ]
    return [t for t in (EMBED, *layers, FINAL_NORM, LM_HEAD) if spec.has(t)]


def param_shapes(params: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Path -> shape of `params`: a dict of arrays, or a `CheckpointParams` (its metadata shapes,
    so that nothing is read from disk)."""
    shapes = getattr(params, "shapes", None)
    if shapes is not None:
        return {name: tuple(shape) for name, shape in shapes.items()}
    return {name: tuple(np.shape(value)) for name, value in params.items()}


def spec_from_config(config: dict[str, Any], params: Mapping[str, Any]) -> LlamaSpec:
    """The `LlamaSpec` of a training config's `model:` section, checked against `params`
    (arrays, or a `CheckpointParams`, whose shapes are read without reading its values).

    `vocab_size` comes from the embedding (the config may say 0 = "from the data").

    Raises:
        ExportError: missing config keys, or parameters that do not match the config's shapes.
    """
    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model, dict):
        raise ExportError("the checkpoint config has no 'model' section")
    if EMBED.param not in params:
        raise ExportError(f"params lack {EMBED.param!r}; have {sorted(params)[:6]}...")
    hybrid = hybrid_fields(model)  # first: an MoE hybrid is refused as such
    try:
        heads = int(model["num_heads"])
        spec = LlamaSpec(
            vocab_size=int(param_shapes(params)[EMBED.param][0]),
            d_model=int(model["d_model"]),
            num_layers=int(model["num_layers"]),
            num_heads=heads,
            num_kv_heads=int(model["num_kv_heads"]),
            head_dim=int(model.get("head_dim") or int(model["d_model"]) // heads),
            mlp_dim=int(model["mlp_dim"]),
            max_seq_len=int(model.get("max_seq_len", 256)),
            rope_theta=float(model.get("rope_theta", 10000.0)),
            rms_norm_eps=float(model.get("rms_norm_eps", 1e-5)),
            tie_embeddings=bool(model.get("tie_embeddings", False)),
            dtype=str(model.get("dtype", "bfloat16")),
            architecture=str(model.get("architecture", "llama")),
            qkv_bias=bool(model.get("qkv_bias", False)),
            o_bias=bool(model.get("o_bias", False)),
            qk_norm=bool(model.get("qk_norm", False)),
            rope_scaling=rope_scaling_of(model.get("rope_scaling")),
            **moe_fields(model),
            **hybrid,
        )
    except KeyError as err:
        raise ExportError(f"the checkpoint config's model section lacks {err}") from err
    check_architecture(spec)
    check_params(spec, params)
    return spec


def check_architecture(spec: LlamaSpec) -> None:
    """Raises ExportError unless the Hugging Face class of `spec.architecture` builds exactly the
    biases and q/k norms the checkpoint has (`ARCHITECTURE_OPTIONS`).

    Training refuses such a model; a hand-edited config can still name one. Exported anyway, the
    servers would build the class's own tensors: a checkpoint bias the class lacks is skipped
    without a word (vLLM's `LlamaModel.load_weights` / `Qwen2Model.load_weights` skip a `.bias`
    they have no parameter for) and the served model is not the trained one.

    Example:
        >>> spec = LlamaSpec(vocab_size=32, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
        ...                  head_dim=16, mlp_dim=32, architecture="mistral", qkv_bias=True)
        >>> check_architecture(spec)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        nvfp4_export.errors.ExportError: model.architecture='mistral' (MistralForCausalLM) ...
    """
    options = {"qkv_bias": spec.qkv_bias, "o_bias": spec.o_bias, "qk_norm": spec.qk_norm}
    allowed = ARCHITECTURE_OPTIONS[spec.architecture]
    if options not in allowed:
        raise ExportError(
            f"model.architecture={spec.architecture!r} ({ARCHITECTURES[spec.architecture]}) "
            f"builds {' or '.join(map(str, allowed))}, but the checkpoint config has {options}: "
            "a server would load it as that class and silently drop (or never find) the other "
            "tensors. Fix model.architecture or the bias/norm options in the run's config to "
            "what the model was trained with"
        )


def check_params(spec: LlamaSpec, params: Mapping[str, Any]) -> None:
    """Raises ExportError unless `params` has exactly the tree and shapes `spec` implies."""
    shapes = param_shapes(params)
    expected = spec.expected_params()
    missing = sorted(set(expected) - set(params))
    extra = sorted(set(params) - set(expected))
    if missing or extra:
        raise ExportError(
            f"params do not match the config's Llama: missing {missing[:8]}, unexpected {extra[:8]}"
        )
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise ExportError(
                f"param {name!r} must have shape {shape} per the config, got {shapes[name]}"
            )
