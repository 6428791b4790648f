"""What a model config implies about the parameter tree: each block's kind (`block_kinds`), its
quantizable linears in stochastic-rounding key order (`block_linear_names`, `linear_paths`), its
parameters (`block_params`), which blocks are MoE (`moe_layers`, `moe_blocks_note`), the input
amax each linear reports (`input_amax_shape`), and the multi-token prediction layers'
(`mtp_linear_names`, `mtp_layer_params`). Functions of a `ModelConfig`
(`nvfp4_train.model.config`, which re-exports most of them).

Example:
    >>> from nvfp4_train.model.blocks.mamba_config import MambaConfig
    >>> from nvfp4_train.model.config import ModelConfig
    >>> cfg = ModelConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
    ...                   mlp_dim=128, architecture="nemotron_h", pattern="M*",
    ...                   mamba=MambaConfig(num_heads=16, head_dim=8, state_dim=16))
    >>> linear_paths(cfg)
    ['layers.0.mamba.in_proj', 'layers.0.mamba.out_proj', 'layers.1.attn.qkv', 'layers.1.attn.o']
"""

from __future__ import annotations

from nvfp4_train.model.moe.config import is_moe_layer
from nvfp4_train.model.pattern import LLAMA, pattern_kinds

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
"""The quantizable linears of a Llama-style MoE block with SwiGLU experts (the shared ones only
with `moe.shared_experts`), in the order their SR keys are derived (0..5); `moe_linear_names`
gives any MoE block's. The router and the shared-expert gate never quantize."""
LATENT_LINEAR_NAMES = ("mlp.fc1_latent_proj", "mlp.fc2_latent_proj")
"""LatentMoE's projections (`moe.latent_dim > 0`), after the experts' linears in SR-key order."""
BLOCK_KEYS = len(MOE_LINEAR_NAMES) + len(LATENT_LINEAR_NAMES)
"""How many SR keys every block is given (a dense block uses the first four)."""
MIXER_LINEAR_NAMES = {
    "mamba": ("mamba.in_proj", "mamba.out_proj"),
    "attention": ("attn.qkv", "attn.o"),
    "mlp": ("mlp.gate_up", "mlp.down"),
    "moe": MOE_LINEAR_NAMES[2:],
}
"""A hybrid block's quantizable linears by kind, in SR-key order (a relu2 MLP has `mlp.up`
instead of `mlp.gate_up`; an MoE block's shared experts only with `moe.shared_experts`)."""
LINEAR_ORDER = ("mamba.in_proj", "mamba.out_proj", *LINEAR_NAMES[:2], "mlp.gate_up", "mlp.up",
                "mlp.down", "mlp.experts.gate_up", "mlp.experts.up", "mlp.experts.down",
                "mlp.shared.gate_up", "mlp.shared.up", "mlp.shared.down", *LATENT_LINEAR_NAMES,
                "eh_proj")  # fmt: skip
"""Every name a block's linear can have, in an order every block's `block_linear_names` keeps:
sorting by it puts a block's linears in SR-key order without the config (`linear_order`)."""


def block_kinds(cfg) -> tuple[str, ...]:
    """The kind of each block: `pattern.LLAMA` for every block without a pattern, else the
    pattern's kinds ("mamba", "attention", "mlp", "moe")."""
    if not cfg.pattern:
        return (LLAMA,) * cfg.num_layers
    return pattern_kinds(cfg.pattern)


def is_moe_block(cfg, index: int) -> bool:
    """Whether block `index` holds the MoE MLP: an `E` block of a pattern, or a Llama-style
    block that `model.moe` makes MoE (`moe.config.is_moe_layer`)."""
    if cfg.pattern:
        return block_kinds(cfg)[index] == "moe"
    return is_moe_layer(cfg.moe, index)


def moe_linear_names(moe) -> tuple[str, ...]:
    """The quantizable linears of an MoE MLP (`moe` a `MoEConfig`) in SR-key order: the experts'
    first linear (`gate_up`, or `up` with relu2 experts) and `down`, the shared experts' (with
    `shared_experts`), then LatentMoE's projections (with `latent_dim`)."""
    first = "gate_up" if moe.expert_activation == "swiglu" else "up"
    names = (f"mlp.experts.{first}", "mlp.experts.down")
    names += (f"mlp.shared.{first}", "mlp.shared.down") if moe.shared_experts else ()
    return names + (LATENT_LINEAR_NAMES if moe.latent_dim else ())


def mixer_linear_names(cfg, kind: str) -> tuple[str, ...]:
    """The quantizable linears of one hybrid mixer of `kind`, in SR-key order."""
    if kind == "moe":
        return moe_linear_names(cfg.moe)
    if kind == "mlp" and cfg.mlp_activation == "relu2":
        return ("mlp.up", "mlp.down")
    return MIXER_LINEAR_NAMES[kind]


def block_linear_names(cfg, index: int) -> tuple[str, ...]:
    """The quantizable linears of block `index`, relative to `layers.{index}`, in SR-key order:
    `LINEAR_NAMES`, or for an MoE block attention then `moe_linear_names`; a hybrid block's
    `mixer_linear_names` of its kind."""
    kind = block_kinds(cfg)[index]
    if kind == LLAMA:
        mlp = moe_linear_names(cfg.moe) if is_moe_layer(cfg.moe, index) else LINEAR_NAMES[2:]
        return (*LINEAR_NAMES[:2], *mlp)
    return mixer_linear_names(cfg, kind)


MAMBA_PARAMS = ("mamba.in_proj.kernel", "mamba.conv1d.kernel", "mamba.conv1d.bias",
                "mamba.dt_bias", "mamba.A_log", "mamba.D", "mamba.norm.scale",
                "mamba.out_proj.kernel")  # fmt: skip
"""A Mamba block's parameters (with `mamba.conv_bias`; `mamba.proj_bias` adds
`mamba.in_proj.bias` and `mamba.out_proj.bias`)."""


def _mixer_params(cfg, kind: str, moe: bool) -> list[str]:
    """The parameters of one mixer (`kind` "attention", "mlp" or "mamba"; an "mlp" is the MoE MLP
    when `moe`), relative to the block."""
    if kind == "attention":
        attn = ["attn.qkv.kernel", "attn.o.kernel"]
        attn += ["attn.qkv.bias"] * cfg.qkv_bias + ["attn.o.bias"] * cfg.o_bias
        return attn + ["attn.q_norm.scale", "attn.k_norm.scale"] * cfg.qk_norm
    if kind == "mamba":
        proj = ["mamba.in_proj.bias", "mamba.out_proj.bias"] * cfg.mamba.proj_bias
        return [p for p in MAMBA_PARAMS if cfg.mamba.conv_bias or p != "mamba.conv1d.bias"] + proj
    if not moe:
        return [f"{name}.kernel" for name in mixer_linear_names(cfg, "mlp")]
    linears = [f"{name}.kernel" for name in moe_linear_names(cfg.moe)]
    return ["mlp.router.kernel", "mlp.router.score_bias", *linears] + [
        "mlp.shared_gate.kernel"
    ] * cfg.moe.shared_expert_gate


def block_params(cfg, index: int) -> tuple[str, ...]:
    """Every parameter of block `index`, relative to `layers.{index}`: a Llama-style block's
    `attn_norm`, attention, `mlp_norm` and MLP; a hybrid block's `norm` and its one mixer."""
    kind = block_kinds(cfg)[index]
    moe = is_moe_block(cfg, index)
    if kind != LLAMA:
        return ("norm.scale", *_mixer_params(cfg, "mlp" if kind == "moe" else kind, moe))
    attn, mlp = _mixer_params(cfg, "attention", False), _mixer_params(cfg, "mlp", moe)
    return ("attn_norm.scale", *attn, "mlp_norm.scale", *mlp)


def mtp_layer_kind(cfg, j: int) -> str:
    """The kind of MTP layer `j` (`mtp.layers.{j}`, `model.mtp.config`)."""
    return cfg.mtp.kinds[j % len(cfg.mtp.pattern)]


def mtp_layer_count(cfg) -> int:
    """How many MTP layers the model stores: `num_layers` modules of `len(pattern)` blocks."""
    return cfg.mtp.num_layers * len(cfg.mtp.pattern) if cfg.mtp.num_layers else 0


def mtp_linear_names(cfg, j: int) -> tuple[str, ...]:
    """The quantizable linears of MTP layer `j`, relative to `mtp.layers.{j}`, in SR-key order:
    its mixer's, then `eh_proj` on a module's first layer."""
    first = j % len(cfg.mtp.pattern) == 0
    return (*mixer_linear_names(cfg, mtp_layer_kind(cfg, j)), *(("eh_proj",) if first else ()))


def mtp_layer_params(cfg, j: int) -> tuple[str, ...]:
    """Every parameter of MTP layer `j`, relative to `mtp.layers.{j}`: a hybrid block's (`norm`
    and its mixer), `enorm`, `hnorm` and `eh_proj` on a module's first layer, `final_layernorm`
    on its last."""
    kind, p, last = mtp_layer_kind(cfg, j), j % len(cfg.mtp.pattern), len(cfg.mtp.pattern) - 1
    params = ["norm.scale", *_mixer_params(cfg, "mlp" if kind == "moe" else kind, kind == "moe")]
    params += ["enorm.scale", "hnorm.scale", "eh_proj.kernel"] * (p == 0)
    return (*params, *["final_layernorm.scale"] * (p == last))


def linear_paths(cfg) -> list[str]:
    """Module paths of every quantizable linear, e.g. `layers.0.attn.qkv`, in model order (the
    MTP layers' `mtp.layers.{j}...` last)."""
    blocks = [
        f"layers.{i}.{name}" for i in range(cfg.num_layers) for name in block_linear_names(cfg, i)
    ]
    return blocks + [
        f"mtp.layers.{j}.{name}" for j in range(mtp_layer_count(cfg))
        for name in mtp_linear_names(cfg, j)
    ]  # fmt: skip


def linear_order(path: str) -> tuple[int, int, int]:
    """Sort key of a linear path `layers.{i}.{name}` or `mtp.layers.{j}.{name}`: (0 for a block, 1
    for an MTP layer, its index, the name's place in `LINEAR_ORDER`), so sorted paths come in
    model order (unknown names last in their block).

    Example:
        >>> sorted(["mtp.layers.0.eh_proj", "layers.1.attn.o", "layers.0.mamba.in_proj"],
        ...        key=linear_order)
        ['layers.0.mamba.in_proj', 'layers.1.attn.o', 'mtp.layers.0.eh_proj']
    """
    mtp = path.startswith("mtp.")
    _, index, name = path.removeprefix("mtp.").split(".", 2)
    place = LINEAR_ORDER.index(name) if name in LINEAR_ORDER else len(LINEAR_ORDER)
    return int(mtp), int(index), place


def input_amax_shape(cfg, path: str) -> tuple[int, ...]:
    """The shape of the input amax a linear reports (`layers.INPUT_AMAX`): a scalar, or one per
    expert for the routed experts' linears (`layers.{i}.mlp.experts.*`)."""
    return (cfg.moe.num_experts,) if ".mlp.experts." in path else ()


def moe_layers(cfg) -> list[int]:
    """The indices of the MoE blocks (none for a dense model)."""
    return [i for i in range(cfg.num_layers) if is_moe_block(cfg, i)]


def moe_blocks_note(cfg) -> str:
    """Which blocks are MoE, for the run's start-up line ("" for a dense model).

    Example:
        >>> from nvfp4_train.model.config import ModelConfig
        >>> from nvfp4_train.model.moe.config import MoEConfig
        >>> moe_blocks_note(ModelConfig(vocab_size=256, d_model=64, num_layers=6, num_heads=4,
        ...     num_kv_heads=2, mlp_dim=128, moe=MoEConfig(num_experts=4, expert_mlp_dim=32,
        ...     first_dense_layers=1, dense_layers=(4,))))
        'MoE blocks 1-3, 5 (4 experts, top 2)'
    """
    runs: list[list[int]] = []
    for i in moe_layers(cfg):
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    if not runs:
        return ""
    spans = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
    moe = cfg.moe
    return f"MoE blocks {spans} ({moe.num_experts} experts, top {moe.experts_per_token})"
