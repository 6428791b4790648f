"""Nemotron 3's MoE blocks (`E`) in a `NemotronHForCausalLM` checkpoint: config.json ->
`model.moe`, and where each parameter of an MoE block is.

config.json (transformers 5's `NemotronHConfig` names; an absent key takes its default):

    n_routed_experts (num_local_experts)    -> num_experts
    num_experts_per_tok                     -> experts_per_token
    moe_intermediate_size                   -> expert_mlp_dim
    moe_shared_expert_intermediate_size     -> shared_expert_mlp_dim (one shared expert)
    n_group, topk_group, norm_topk_prob, routed_scaling_factor  -> the same keys
    moe_latent_size (null: none)            -> latent_dim (LatentMoE, Nemotron 3 Super)

and always `router: sigmoid` (plus `e_score_correction_bias`) and `expert_activation: relu2`
(`mlp_hidden_act`, whose only supported value is relu2). `n_shared_experts` must be 1: transformers
builds one shared expert of `moe_shared_expert_intermediate_size` whatever it says, vLLM one of
`n_shared_experts` times that width, so any other value is ambiguous.

Tensors under `layers.{i}.mixer.` (relative names; `E` experts, `F` their width, `S` the shared
expert's, `W` the experts' input: d_model, or the latent):

    gate.weight [E, D]                       -> mlp.router.kernel [D, E]
    gate.e_score_correction_bias [E]         -> mlp.router.score_bias [E]
    experts.{e}.up_proj.weight [F, W]        -> mlp.experts.up.kernel[e] [W, F]   (the Hub's)
    experts.{e}.down_proj.weight [W, F]      -> mlp.experts.down.kernel[e] [F, W]
    experts.up_proj [E, F, W], experts.down_proj [E, W, F]   (transformers' in-library layout)
    shared_experts.up_proj.weight [S, D]     -> mlp.shared.up.kernel [D, S]
    shared_experts.down_proj.weight [D, S]   -> mlp.shared.down.kernel [S, D]
    fc1_latent_proj.weight [W, D], fc2_latent_proj.weight [D, W]  -> mlp.fc{1,2}_latent_proj.kernel

Each block's experts are read from whichever layout it holds (`experts.up_proj` present: stacked).

Example:
    >>> section = nemotron_moe_section({"n_routed_experts": 8, "num_experts_per_tok": 2,
    ...     "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 64})
    >>> section["router"], section["expert_activation"], section["latent_dim"]
    ('sigmoid', 'relu2', 0)
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from nvfp4_train.model.hf.errors import HFConfigError
from nvfp4_train.model.hf.moe import per_expert, stacked_experts
from nvfp4_train.model.hf.sources import ExpertSources, Source
from nvfp4_train.model.hf.values import json_float, whole_number

DEFAULTS = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 7688,
            "moe_shared_expert_intermediate_size": 7688, "n_group": 1, "topk_group": 1}  # fmt: skip
"""transformers' `NemotronHConfig` defaults of the whole-number MoE keys."""


def nemotron_moe_section(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The `model.moe` keys a Nemotron 3 config.json fixes (see the module docstring).

    Raises:
        HFConfigError: a malformed value, or `n_shared_experts` other than 1.
    """
    shared = hf.get("n_shared_experts", 1)
    if shared != 1 or isinstance(shared, bool):
        raise HFConfigError(
            f"model.init_from: n_shared_experts={shared!r} is not supported for nemotron_h (only "
            "1: transformers builds one shared expert whatever it says, vLLM n_shared_experts of "
            "them, so any other value is ambiguous)"
        )
    number = {key: whole_number(hf, key, default) for key, default in DEFAULTS.items()}
    norm = hf.get("norm_topk_prob", True)
    if not isinstance(norm, bool):
        raise HFConfigError(f"model.init_from: config.json's norm_topk_prob must be true or "
                            f"false, got {norm!r}")  # fmt: skip
    return {
        "num_experts": number["n_routed_experts"],
        "experts_per_token": number["num_experts_per_tok"],
        "expert_mlp_dim": number["moe_intermediate_size"],
        "shared_experts": 1,
        "shared_expert_mlp_dim": number["moe_shared_expert_intermediate_size"],
        "norm_topk_prob": norm,
        "router": "sigmoid",
        "n_group": number["n_group"],
        "topk_group": number["topk_group"],
        "routed_scaling_factor": json_float(
            hf.get("routed_scaling_factor", 1.0), "routed_scaling_factor"
        ),  # fmt: skip
        "expert_activation": "relu2",
        "latent_dim": whole_number(hf, "moe_latent_size", 0),
    }


def stacked_expert_tensor(mixer: str) -> str:
    """The stacked up-projection of the experts under `mixer` (transformers' layout)."""
    return mixer + "experts.up_proj"


def nemotron_moe_sources(cfg, mixer: str, names: Collection[str]) -> dict[str, Any]:
    """The sources of an MoE block's parameters (relative to the block), whose HF tensors are
    under `mixer` (`backbone.layers.{i}.mixer.`, `mtp.layers.{j}.mixer.`), its experts in the
    layout `names` holds."""
    moe, d = cfg.moe, cfg.d_model
    e_count, f, s, w = moe.num_experts, moe.expert_mlp_dim, moe.shared_mlp_dim, moe.latent_dim or d
    experts = mixer + "experts."
    if stacked_expert_tensor(mixer) in names:
        up = stacked_experts(experts + "up_proj", f, e_count)
        down = stacked_experts(experts + "down_proj", w, e_count)
    else:
        up = per_expert(lambda e: ((f"{experts}{e}.up_proj.weight", f),), e_count)
        down = per_expert(lambda e: ((f"{experts}{e}.down_proj.weight", w),), e_count)
    out: dict[str, Source | ExpertSources] = {
        "mlp.router.kernel": Source(((mixer + "gate.weight", e_count),), True),
        "mlp.router.score_bias": Source(((mixer + "gate.e_score_correction_bias", e_count),)),
        "mlp.experts.up.kernel": up,
        "mlp.experts.down.kernel": down,
        "mlp.shared.up.kernel": Source(((mixer + "shared_experts.up_proj.weight", s),), True),
        "mlp.shared.down.kernel": Source(((mixer + "shared_experts.down_proj.weight", d),), True),
    }
    if moe.latent_dim:
        out["mlp.fc1_latent_proj.kernel"] = Source(((mixer + "fc1_latent_proj.weight", w),), True)
        out["mlp.fc2_latent_proj.kernel"] = Source(((mixer + "fc2_latent_proj.weight", d),), True)
    return out
