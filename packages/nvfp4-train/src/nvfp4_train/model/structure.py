"""What a model config implies about the parameter tree: each block's kind (`block_kinds`), its
quantizable linears in stochastic-rounding key order (`block_linear_names`, `linear_paths`), its
parameters (`block_params`), which blocks are MoE (`moe_layers`, `moe_blocks_note`) and the input amax each linear
reports (`input_amax_shape`). Functions of a `ModelConfig` (`nvfp4_train.model.config`, which
re-exports them).

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
"""The quantizable linears of an MoE block (the shared ones only with `moe.shared_experts`), in
the order their SR keys are derived (0..5). The router and the shared-expert gate never quantize."""
BLOCK_KEYS = len(MOE_LINEAR_NAMES)
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
                "mlp.down", *MOE_LINEAR_NAMES[2:])  # fmt: skip
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


def block_linear_names(cfg, index: int) -> tuple[str, ...]:
    """The quantizable linears of block `index`, relative to `layers.{index}`, in SR-key order:
    `LINEAR_NAMES`, or for an MoE block `MOE_LINEAR_NAMES` (without the shared experts when
    there are none); a hybrid block's `MIXER_LINEAR_NAMES` of its kind."""
    kind = block_kinds(cfg)[index]
    if kind == "moe" or (kind == LLAMA and is_moe_layer(cfg.moe, index)):
        names = MOE_LINEAR_NAMES if cfg.moe.shared_experts else MOE_LINEAR_NAMES[:4]
        return names if kind == LLAMA else names[2:]
    if kind == LLAMA:
        return LINEAR_NAMES
    if kind == "mlp" and cfg.mlp_activation == "relu2":
        return ("mlp.up", "mlp.down")
    return MIXER_LINEAR_NAMES[kind]


MAMBA_PARAMS = ("mamba.in_proj.kernel", "mamba.conv1d.kernel", "mamba.conv1d.bias",
                "mamba.dt_bias", "mamba.A_log", "mamba.D", "mamba.norm.scale",
                "mamba.out_proj.kernel")  # fmt: skip
"""A Mamba block's parameters (with `mamba.conv_bias`; `mamba.proj_bias` adds
`mamba.in_proj.bias` and `mamba.out_proj.bias`)."""


def _mixer_params(cfg, kind: str, index: int) -> list[str]:
    """The parameters of one mixer of block `index` (`kind` "attention", "mlp", "moe" or
    "mamba"), relative to the block."""
    if kind == "attention":
        attn = ["attn.qkv.kernel", "attn.o.kernel"]
        attn += ["attn.qkv.bias"] * cfg.qkv_bias + ["attn.o.bias"] * cfg.o_bias
        return attn + ["attn.q_norm.scale", "attn.k_norm.scale"] * cfg.qk_norm
    if kind == "mamba":
        proj = ["mamba.in_proj.bias", "mamba.out_proj.bias"] * cfg.mamba.proj_bias
        return [p for p in MAMBA_PARAMS if cfg.mamba.conv_bias or p != "mamba.conv1d.bias"] + proj
    if not is_moe_block(cfg, index):
        return [f"{name}.kernel" for name in block_linear_names(cfg, index)[-2:]]
    mlp = ["mlp.router.kernel", "mlp.router.score_bias", "mlp.experts.gate_up.kernel",
           "mlp.experts.down.kernel"]  # fmt: skip
    mlp += ["mlp.shared.gate_up.kernel", "mlp.shared.down.kernel"] * bool(cfg.moe.shared_experts)
    return mlp + ["mlp.shared_gate.kernel"] * cfg.moe.shared_expert_gate


def block_params(cfg, index: int) -> tuple[str, ...]:
    """Every parameter of block `index`, relative to `layers.{index}`: a Llama-style block's
    `attn_norm`, attention, `mlp_norm` and MLP; a hybrid block's `norm` and its one mixer."""
    kind = block_kinds(cfg)[index]
    if kind != LLAMA:
        return ("norm.scale", *_mixer_params(cfg, "mlp" if kind == "moe" else kind, index))
    attn, mlp = _mixer_params(cfg, "attention", index), _mixer_params(cfg, "mlp", index)
    return ("attn_norm.scale", *attn, "mlp_norm.scale", *mlp)


def linear_paths(cfg) -> list[str]:
    """Module paths of every quantizable linear, e.g. `layers.0.attn.qkv`, in model order."""
    return [
        f"layers.{i}.{name}" for i in range(cfg.num_layers) for name in block_linear_names(cfg, i)
    ]


def linear_order(path: str) -> tuple[int, int]:
    """Sort key of a linear path `layers.{i}.{name}`: (i, the name's place in `LINEAR_ORDER`),
    so sorted paths come in model order (unknown names last in their block).

    Example:
        >>> sorted(["layers.1.attn.o", "layers.0.mamba.out_proj", "layers.0.mamba.in_proj"],
        ...        key=linear_order)
        ['layers.0.mamba.in_proj', 'layers.0.mamba.out_proj', 'layers.1.attn.o']
    """
    _, index, name = path.split(".", 2)
    return int(index), LINEAR_ORDER.index(name) if name in LINEAR_ORDER else len(LINEAR_ORDER)


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
