"""Mixture-of-Experts models in an export: which Hugging Face classes hold them, their checks, and
the names every server loads their tensors under.

Training's MoE block (docs/moe.md) is exported as one of three classes, per expert under the
names their Hub checkpoints use (and vLLM, SGLang, TensorRT-LLM and transformers load):

| class | expert modules | router (BF16) | shared expert |
|---|---|---|---|
| `Qwen3MoeForCausalLM` | `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj` | `mlp.gate.weight` | - |
| `MixtralForCausalLM` | `model.layers.{i}.block_sparse_moe.experts.{e}.{w1,w3,w2}` | `block_sparse_moe.gate.weight` | - |
| `Qwen2MoeForCausalLM` | as Qwen3-MoE | `mlp.gate.weight` | `mlp.shared_expert.{gate,up,down}_proj`, `mlp.shared_expert_gate.weight` (BF16) |

The servers build one fused MoE layer per block, named `model.layers.{i}.mlp.experts`
(`block_sparse_moe.experts`): that name is what their exclusion lists are matched against
(`layouts.fused_exclusions`).

Example:
    >>> expert_modules("mixtral", 3, "mlp.experts.gate_up", 1)
    ['model.layers.3.block_sparse_moe.experts.1.w1', 'model.layers.3.block_sparse_moe.experts.1.w3']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from nvfp4_export.errors import ExportError


@dataclasses.dataclass(frozen=True)
class MoENames:
    """Where one class keeps an MoE block's tensors (relative to `model.layers.{i}.`).

    Attributes:
        hf_class: the causal-LM class (config.json `architectures`).
        block: the MoE block's module (`mlp`, Mixtral `block_sparse_moe`).
        projections: the per-expert (gate, up, down) module names.
        shared: the shared expert's module, or None when the class has none.
    """

    hf_class: str
    block: str
    projections: tuple[str, str, str]
    shared: str | None = None


MOE_CLASSES = {
    "qwen3_moe": MoENames("Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": MoENames("MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2_moe": MoENames("Qwen2MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"),
                          shared="mlp.shared_expert"),
}  # fmt: skip
"""MoE `model_type` -> where its class keeps the MoE tensors."""
MOE_ARCHITECTURES = {
    "qwen3_moe": {"shared_experts": (0,), "shared_expert_gate": (False,),
                  "first_dense_layers": (0,), "bias_update_rate": (0.0,)},
    "mixtral": {"shared_experts": (0,), "shared_expert_gate": (False,), "first_dense_layers": (0,),
                "layer_freq": (1,), "dense_layers": ((),), "norm_topk_prob": (True,),
                "bias_update_rate": (0.0,)},
    "qwen2_moe": {"shared_experts": (1,), "shared_expert_gate": (True,),
                  "first_dense_layers": (0,), "bias_update_rate": (0.0,)},
}  # fmt: skip
"""MoE `model_type` -> the `model.moe` values its class builds (key -> allowed values): the
training package's table (`nvfp4_train.model.moe.config.MOE_ARCHITECTURES`), repeated here because
export never imports training; integration_tests/test_policy_agreement.py keeps them equal."""
EXPERT_LINEARS = ("mlp.experts.gate_up", "mlp.experts.down")
"""The routed experts' linears of an MoE block (kernels [E, in, out], one amax per expert)."""
SHARED_LINEARS = ("mlp.shared.gate_up", "mlp.shared.down")
"""The shared expert's linears (dense kernels [in, out])."""
_MOE_DEFAULTS = {
    "num_experts": 0, "experts_per_token": 2, "expert_mlp_dim": 0, "shared_experts": 0,
    "shared_expert_mlp_dim": 0, "shared_expert_gate": False, "norm_topk_prob": True,
    "first_dense_layers": 0, "layer_freq": 1, "dense_layers": (), "bias_update_rate": 0.0,
}  # fmt: skip
"""Training's `MoEConfig` defaults (a key absent from a checkpoint's config has this value)."""


def is_expert_linear(path: str) -> bool:
    """Whether linear `path` (`layers.{i}.mlp.experts.gate_up`) is a routed experts' linear."""
    return path.split(".", 2)[-1] in EXPERT_LINEARS


def _moe_value(moe: Mapping[str, Any], key: str) -> Any:
    value = moe.get(key, _MOE_DEFAULTS[key])
    return tuple(value) if isinstance(value, list) else value


def moe_fields(model: Mapping[str, Any]) -> dict[str, Any]:
    """The `LlamaSpec` MoE fields of a training config's `model:` section (none for a dense one).

    Raises:
        ExportError: an MoE model whose architecture is not an MoE class (or the reverse), or
            `model.moe` values its class cannot build (`MOE_ARCHITECTURES`).
    """
    moe = model.get("moe") if isinstance(model.get("moe"), Mapping) else {}
    arch = str(model.get("architecture", "llama"))
    experts = int(moe.get("num_experts") or 0)
    if not experts:
        if arch in MOE_CLASSES:
            raise ExportError(f"model.architecture={arch!r} is a Mixture-of-Experts class, but "
                              "the checkpoint config has model.moe.num_experts=0")  # fmt: skip
        return {}
    if arch not in MOE_CLASSES:
        raise ExportError(
            f"the checkpoint is of a Mixture-of-Experts model (model.moe.num_experts={experts}) "
            f"with model.architecture={arch!r}, which no Hugging Face MoE class is; export writes "
            f"MoE models as {sorted(MOE_CLASSES)} (train with model.architecture one of them, "
            "e.g. by starting from such a model with model.init_from)"
        )
    for key, allowed in MOE_ARCHITECTURES[arch].items():
        if _moe_value(moe, key) not in allowed:
            raise ExportError(
                f"model.architecture={arch!r} ({MOE_CLASSES[arch].hf_class}) builds "
                f"model.moe.{key} in {allowed}, but the checkpoint config has "
                f"{_moe_value(moe, key)!r}: a server would serve another model"
            )
    first = int(_moe_value(moe, "first_dense_layers"))
    shared = int(_moe_value(moe, "shared_experts")) * int(
        _moe_value(moe, "shared_expert_mlp_dim") or _moe_value(moe, "expert_mlp_dim")
    )
    return {
        "num_experts": experts,
        "experts_per_token": int(_moe_value(moe, "experts_per_token")),
        "expert_mlp_dim": int(_moe_value(moe, "expert_mlp_dim")),
        "shared_mlp_dim": shared,
        "shared_expert_gate": bool(_moe_value(moe, "shared_expert_gate")),
        "norm_topk_prob": bool(_moe_value(moe, "norm_topk_prob")),
        "moe_layer_freq": int(_moe_value(moe, "layer_freq")),
        "moe_dense_layers": tuple(sorted({*range(first), *_moe_value(moe, "dense_layers")})),
    }


def block_module(architecture: str, i: int) -> str:
    """The MoE block module of layer `i` (`model.layers.3.mlp`, Mixtral `...block_sparse_moe`)."""
    return f"model.layers.{i}.{MOE_CLASSES[architecture].block}"


def experts_module(architecture: str, i: int) -> str:
    """The fused MoE layer servers build for block `i` (their exclusion lists name it)."""
    return block_module(architecture, i) + ".experts"


def expert_modules(architecture: str, i: int, kind: str, expert: int) -> list[str]:
    """The HF modules of expert `expert` of training linear `kind` (`mlp.experts.gate_up`: gate,
    up; `mlp.experts.down`: down) in block `i`."""
    gate, up, down = MOE_CLASSES[architecture].projections
    base = f"{experts_module(architecture, i)}.{expert}."
    return [base + gate, base + up] if kind.endswith("gate_up") else [base + down]


def shared_modules(architecture: str, i: int, kind: str) -> list[str]:
    """The shared expert's HF modules of training linear `kind` (`mlp.shared.gate_up`: gate, up)."""
    base = f"model.layers.{i}.{MOE_CLASSES[architecture].shared}."
    return (
        [base + "gate_proj", base + "up_proj"] if kind.endswith("gate_up") else [base + "down_proj"]
    )


def router_tensor(architecture: str, i: int) -> str:
    """The router's weight [E, D] (BF16) of block `i`."""
    return block_module(architecture, i) + ".gate.weight"


def shared_gate_tensor(i: int) -> str:
    """Qwen2-MoE's shared-expert gate weight [1, D] (BF16) of block `i`."""
    return f"model.layers.{i}.mlp.shared_expert_gate.weight"
