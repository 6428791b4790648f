"""Hugging Face Mixture-of-Experts models (`model.init_from`): config.json -> `model.moe`, and where
each MoE parameter is in the checkpoint.

Three classes, as transformers 5 builds them: `Qwen3MoeForCausalLM` (routed experts; dense blocks
by `decoder_sparse_step` / `mlp_only_layers`), `MixtralForCausalLM` (every block MoE, top-k
renormalised) and `Qwen2MoeForCausalLM` (plus one shared expert scaled by
`sigmoid(shared_expert_gate(x))`). Their experts are read from either on-disk layout:

- per expert, as the Hub holds them and as transformers 5's `save_pretrained` writes them (it
  reverts its load-time fusion): `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`
  (Mixtral: `model.layers.{i}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`), [out, in] each;
- fused, as transformers 5 holds them in memory (`save_pretrained(save_original_format=False)`):
  `model.layers.{i}.mlp.experts.gate_up_proj` [E, 2F, D] (gate rows first) and
  `model.layers.{i}.mlp.experts.down_proj` [E, D, F] (Mixtral too, and its router and shared
  tensors then under `mlp.` as well).

The router (`mlp.gate.weight`, Mixtral `block_sparse_moe.gate.weight`, [E, D]) becomes
`mlp.router.kernel` [D, E]; the router's balancing bias, which no HF class has, starts at zero.

Example:
    >>> moe_section({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2,
    ...              "intermediate_size": 64})["expert_mlp_dim"]
    64
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

from nvfp4_train.model.hf.errors import HFConfigError, HFImportError
from nvfp4_train.model.hf.sources import ZEROS, ExpertSources, Source
from nvfp4_train.model.moe.config import MoEConfig, is_moe_layer

MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "qwen2_moe")
"""The Hugging Face MoE `model_type`s this trainer imports."""
UNSUPPORTED_MOE = {
    "deepseek_v2": "multi-head latent attention (MLA) and grouped top-k routing",
    "deepseek_v3": "multi-head latent attention (MLA), grouped top-k routing (n_group, "
    "topk_group) and a sigmoid router with a correction bias",
    "qwen3_next": "gated DeltaNet linear attention",
    "gpt_oss": "attention sinks, biased experts and a clamped SwiGLU",
    "llama4": "chunked attention and a sigmoid top-1 router",
    "glm4_moe": "sigmoid grouped routing with a correction bias",
    "olmoe": "q/k norms over all heads",
    "dbrx": "fused attention and clipped q/k/v",
    "phimoe": "sparsemixer routing",
}
"""MoE `model_type`s met on the Hub that the MoE block does not implement, and why (the hybrid
Mamba ones, Jamba's included: `hf.nemotron_h.HYBRID_RELATIVES`)."""
BLOCK_PREFIX = {"qwen3_moe": "mlp", "mixtral": "block_sparse_moe", "qwen2_moe": "mlp"}
"""Where an MoE block's per-expert tensors and router live in each class's checkpoints."""
EXPERT_NAMES = {
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
    "mixtral": ("w1", "w3", "w2"),
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
}
"""Each class's per-expert projection names: (gate, up, down)."""
FUSED_PREFIX = "mlp"
"""Where transformers 5 keeps the fused `experts.gate_up_proj` / `experts.down_proj` (Mixtral
included: its conversion renames `block_sparse_moe` to `mlp`)."""


def _fail(message: str) -> HFConfigError:
    return HFConfigError(f"model.init_from: {message}")


def unsupported_model_type(kind: Any) -> str | None:
    """Why `kind` (an MoE `model_type` this trainer does not import) is refused, or None."""
    why = UNSUPPORTED_MOE.get(kind)
    if why is None:
        return None
    return (
        f"model_type {kind!r} is a Mixture-of-Experts variant whose {why} the MoE block does not "
        f"implement (supported MoE classes: {MOE_MODEL_TYPES})"
    )


def _positive(hf: Mapping[str, Any], *keys: str) -> int:
    """The first of `keys` config.json has, as an int > 0."""
    for key in keys:
        value = hf.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise _fail(f"config.json's {key} must be a whole number > 0, got {value!r}")
            return value
    raise _fail(f"config.json lacks {' or '.join(repr(k) for k in keys)}")


def _refuse_options(hf: Mapping[str, Any]) -> None:
    """Options of the MoE classes that the MoE block does not implement, refused by name."""
    kind = hf["model_type"]
    jitter = hf.get("router_jitter_noise") or 0.0
    if jitter:
        raise _fail(
            f"router_jitter_noise={jitter!r} is not supported (the router multiplies no noise "
            "into its input; only 0.0)"
        )
    shared = hf.get("shared_expert_intermediate_size") or 0
    if kind == "qwen3_moe" and shared:
        raise _fail(
            f"shared_expert_intermediate_size={shared!r} is not supported for qwen3_moe "
            "(Qwen3MoeForCausalLM builds no shared expert)"
        )
    if kind == "qwen2_moe" and hf.get("qkv_bias", True) is not True:
        raise _fail(
            f"qkv_bias={hf['qkv_bias']!r} is not supported for qwen2_moe (only true: vLLM, "
            "SGLang and TensorRT-LLM build Qwen2-MoE with q/k/v biases)"
        )


def moe_section(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The `model.moe` keys an MoE config.json fixes (`MOE_MODEL_TYPES`), plus the load-balancing
    coefficient it was trained with (`router_aux_loss_coef`, a default the user may change).

    Raises:
        HFConfigError: a missing or malformed key, or an option the MoE block does not implement.
    """
    kind = hf["model_type"]
    _refuse_options(hf)
    experts = _positive(hf, "num_experts", "num_local_experts")
    section: dict[str, Any] = {
        "num_experts": experts,
        "experts_per_token": _positive(hf, "num_experts_per_tok"),
        "norm_topk_prob": True if kind == "mixtral" else bool(hf.get("norm_topk_prob", False)),
        "aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001) or 0.0),
    }
    if kind == "mixtral":
        section["expert_mlp_dim"] = _positive(hf, "intermediate_size")
        return section
    section["expert_mlp_dim"] = _positive(hf, "moe_intermediate_size")
    section["layer_freq"] = (
        _positive(hf, "decoder_sparse_step") if "decoder_sparse_step" in hf else 1
    )
    dense = hf.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and i >= 0 for i in dense):
        raise _fail(f"config.json's mlp_only_layers must be a list of block indices, got {dense!r}")
    section["dense_layers"] = sorted(set(dense))
    if kind == "qwen2_moe":
        section["shared_experts"] = 1
        section["shared_expert_mlp_dim"] = _positive(hf, "shared_expert_intermediate_size")
        section["shared_expert_gate"] = True
    return section


STRUCTURE_KEYS = (
    "num_experts", "experts_per_token", "expert_mlp_dim", "norm_topk_prob", "layer_freq",
    "dense_layers", "first_dense_layers", "shared_experts", "shared_expert_mlp_dim",
    "shared_expert_gate", "router", "n_group", "topk_group", "routed_scaling_factor",
    "expert_activation", "latent_dim",
)  # fmt: skip
"""`model.moe` keys the checkpoint fixes (Nemotron 3's router and experts included,
`hf.nemotron_h_moe`): a value the user wrote must agree. The others
(`aux_loss_coef`, `z_loss_coef`, `capacity_factor`, `bias_update_rate`) are training settings: the
checkpoint's are defaults the user may change."""


def merge_moe(user: Any, checkpoint: Mapping[str, Any], model_dir: str) -> dict[str, Any]:
    """The user's `model.moe` over the checkpoint's (`moe_section`).

    Raises:
        HFConfigError: a structural key (`STRUCTURE_KEYS`) the user wrote disagrees.
    """
    user = dict(user or {})
    defaults = MoEConfig()
    disagree = [
        f"model.moe.{k}={user[k]!r} but {model_dir}/config.json gives "
        f"{checkpoint.get(k, getattr(defaults, k))!r}"
        for k in STRUCTURE_KEYS
        if k in user and _listed(user[k]) != _listed(checkpoint.get(k, getattr(defaults, k)))
    ]
    if disagree:
        raise _fail("; ".join(disagree))
    return {**checkpoint, **user}


def _listed(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


# ----------------------------------------------------------------------------- weights


def _expert_prefix(kind: str, i: int, fused: bool) -> str:
    return f"model.layers.{i}.{FUSED_PREFIX if fused else BLOCK_PREFIX[kind]}."


def is_fused(kind: str, i: int, names: Collection[str]) -> bool:
    """Whether block `i`'s experts are stored fused (`experts.gate_up_proj`) in `names`."""
    return _expert_prefix(kind, i, True) + "experts.gate_up_proj" in names


def stacked_experts(name: str, rows: int, count: int) -> ExpertSources:
    """The `count` entries of a stacked HF tensor [E, rows, in] (transformers 5's in-memory
    experts), each read transposed as one expert's [in, rows] kernel."""
    return ExpertSources(tuple(Source(((name, rows),), True, e) for e in range(count)))


def per_expert(parts: Callable[[int], tuple[tuple[str, int], ...]], count: int) -> ExpertSources:
    """One expert's kernel per index e < `count` from its own [out, in] HF tensors `parts(e)`
    (concatenated along the kernel's last axis), as the Hub stores experts."""
    return ExpertSources(tuple(Source(parts(e), True) for e in range(count)))


def moe_sources(cfg, i: int, names: Collection[str]) -> dict[str, Source | ExpertSources]:
    """The sources of MoE block `i`'s MLP parameters (relative to `layers.{i}.`), read from the
    layout `names` (the checkpoint's tensor names) holds."""
    kind, moe, d = cfg.architecture, cfg.moe, cfg.d_model
    f, e_count = moe.expert_mlp_dim, moe.num_experts
    fused = is_fused(kind, i, names)
    router_prefix = _expert_prefix(kind, i, fused)
    if fused:
        p = _expert_prefix(kind, i, True) + "experts."
        gate_up = stacked_experts(p + "gate_up_proj", 2 * f, e_count)
        down = stacked_experts(p + "down_proj", d, e_count)
    else:
        g, u, dn = EXPERT_NAMES[kind]
        p = _expert_prefix(kind, i, False) + "experts."
        gate_up = per_expert(lambda e: ((f"{p}{e}.{g}.weight", f), (f"{p}{e}.{u}.weight", f)),
                             e_count)  # fmt: skip
        down = per_expert(lambda e: ((f"{p}{e}.{dn}.weight", d),), e_count)
    out: dict[str, Source | ExpertSources] = {
        "mlp.router.kernel": Source(((router_prefix + "gate.weight", e_count),), True),
        "mlp.router.score_bias": ZEROS,
        "mlp.experts.gate_up.kernel": gate_up,
        "mlp.experts.down.kernel": down,
    }
    if moe.shared_experts:
        s, sp = moe.shared_mlp_dim, router_prefix + "shared_expert."
        out["mlp.shared.gate_up.kernel"] = Source(
            ((sp + "gate_proj.weight", s), (sp + "up_proj.weight", s)), True
        )
        out["mlp.shared.down.kernel"] = Source(((sp + "down_proj.weight", d),), True)
    if moe.shared_expert_gate:
        out["mlp.shared_gate.kernel"] = Source(((router_prefix + "shared_expert_gate.weight", 1),),
                                               True)  # fmt: skip
    return out


_EXPERT_INDEX = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")


def check_experts(cfg, names: Collection[str], shape_of: Callable[[str], tuple[int, ...]]) -> None:
    """One-line errors for an MoE checkpoint (`MOE_MODEL_TYPES`) whose experts disagree with its
    config, before any weight is read (`check_block_experts` for each MoE block).

    Raises:
        HFImportError: naming the block, the expert and the config's `num_experts`.
    """
    if cfg.architecture not in MOE_MODEL_TYPES:
        return
    found: dict[int, set[int]] = {}
    for name in names:
        match = _EXPERT_INDEX.match(name)
        if match:
            found.setdefault(int(match.group(1)), set()).add(int(match.group(2)))
    for i in range(cfg.num_layers):
        if not is_moe_layer(cfg.moe, i):
            continue
        fused = is_fused(cfg.architecture, i, names)
        prefix = _expert_prefix(cfg.architecture, i, fused)
        check_block_experts(f"layer {i}", prefix + "gate.weight", found.get(i, set()),
                            cfg.moe.num_experts, names, shape_of,
                            stacked=prefix + "experts.gate_up_proj" if fused else None)  # fmt: skip


def check_block_experts(
    block: str, router: str, have: Collection[int], num_experts: int, names: Collection[str],
    shape_of: Callable[[str], tuple[int, ...]], *, stacked: str | None = None,
    key: str = "num_experts",
) -> None:  # fmt: skip
    """One-line errors for one MoE block (`block`, as the errors name it) whose experts disagree
    with config.json's `key` (`num_experts`): a router (`router`, [E, D]) or a stacked expert
    tensor (`stacked`, [E, ...]: then `have` is ignored) for another count, or per-expert tensors
    (`have`: the expert indices found) with an expert missing or past the count. Shapes of single
    tensors are checked by the reader, naming the tensor.

    Raises:
        HFImportError: naming the block, the expert and the count.
    """
    for name, what in ((router, "routes to"), (stacked, "stacks")):
        if name is not None and name in names and shape_of(name)[0] != num_experts:
            raise HFImportError(
                f"model.init_from: {name} {what} {shape_of(name)[0]} experts, but config.json "
                f"gives {key}={num_experts}"
            )
    if stacked is not None:
        return
    expected, have = set(range(num_experts)), set(have)
    if have - expected:
        raise HFImportError(
            f"model.init_from: {block} holds expert {max(have - expected)}, beyond config.json's "
            f"{key}={num_experts} (experts 0..{num_experts - 1})"
        )
    if expected - have:
        missing = sorted(expected - have)
        raise HFImportError(
            f"model.init_from: {block} lacks expert {missing[0]} (missing experts "
            f"{missing[:8]} of {key}={num_experts})"
        )
