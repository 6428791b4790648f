"""The `model.moe` section: Mixture-of-Experts blocks, their router and load balancing.

A block is an MoE block when `num_experts > 0` and `is_moe_layer(moe, i)`: the first
`first_dense_layers` blocks stay dense (DeepSeek-V3's `first_k_dense_replace`), then every
`layer_freq`-th block is MoE (Qwen's `decoder_sparse_step`: block i when `(i + 1) % layer_freq
== 0`), except the blocks listed in `dense_layers` (Qwen's `mlp_only_layers`).

Example:
    >>> moe = MoEConfig(num_experts=8, experts_per_token=2, expert_mlp_dim=64)
    >>> [is_moe_layer(moe, i) for i in range(3)]
    [True, True, True]
    >>> [is_moe_layer(MoEConfig(num_experts=8, expert_mlp_dim=64, first_dense_layers=1), i)
    ...  for i in range(3)]
    [False, True, True]
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal


def _check(ok: bool, key: str, expected: str, actual: object) -> None:
    if not ok:
        raise ValueError(f"model.moe.{key} must be {expected}, got {actual!r}")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-Experts blocks (`num_experts: 0`, the default, is a dense model).

    Attributes:
        num_experts: routed experts per MoE block (0: no MoE block).
        experts_per_token: top-k: how many experts each token is sent to.
        expert_mlp_dim: SwiGLU hidden width of each routed expert; a multiple of 16.
        shared_experts: experts every token goes through besides the routed ones (DeepSeek,
            Qwen2-MoE); they are computed as one SwiGLU MLP of `shared_experts *
            shared_expert_mlp_dim` hidden units.
        shared_expert_mlp_dim: hidden width of each shared expert; 0: `expert_mlp_dim`.
        shared_expert_gate: scale the shared experts' output by sigmoid(x @ w_gate) per token
            (Qwen2-MoE's `shared_expert_gate`, a [d_model, 1] linear never quantized).
        norm_topk_prob: renormalise the chosen experts' softmax weights to sum to 1 (Mixtral,
            Qwen3-MoE `norm_topk_prob: true`); false keeps the softmax weights as they are.
        first_dense_layers: the first blocks that stay dense (DeepSeek-V3 `first_k_dense_replace`).
        layer_freq: every `layer_freq`-th block is MoE (block i when `(i + 1) % layer_freq == 0`).
        dense_layers: blocks that stay dense anyway (Qwen `mlp_only_layers`).
        capacity_factor: 0 (default): dropless, every token reaches its k experts. > 0: each
            expert takes at most `ceil(capacity_factor * tokens * k / num_experts)` tokens of a
            batch (earlier tokens first); the rest of its assignments are dropped (those tokens
            get only their other experts, or the residual) and counted in the metrics.
        aux_loss_coef: weight of the load-balancing loss `num_experts * sum_e f_e * P_e` (Switch
            Transformer; `f_e` the fraction of assignments to expert e, `P_e` its mean router
            probability), averaged over the MoE blocks; 0: off.
        z_loss_coef: weight of the router z-loss `mean(logsumexp(logits)^2)` (ST-MoE), averaged
            over the MoE blocks; 0: off.
        bias_update_rate: DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to
            the router scores for choosing the top-k only (not to the weights), moved by this
            rate towards the mean load after every applied step (`+rate` for an expert under the
            mean, `-rate` over it); 0: no bias. The bias is saved with the parameters, never
            trained by the optimizer and restored exactly on resume. A sigmoid router always
            adds it (Nemotron 3's `e_score_correction_bias`; zero unless trained or imported).
        router: "softmax" (Mixtral, Qwen) or "sigmoid" (DeepSeek-V3, Nemotron 3: per-expert
            sigmoid scores in float32; the weights are the chosen scores, divided by their sum
            with `norm_topk_prob`).
        n_group: DeepSeek-V3's grouped top-k: the experts form `n_group` equal groups, each
            scored by the sum of its two best (bias-corrected) scores; only the `topk_group`
            best groups are searched for the top-k. 1: no grouping.
        topk_group: how many groups are searched (`<= n_group`).
        routed_scaling_factor: the routed experts' weights are multiplied by it (Nemotron 3
            Nano 2.5, Super 5.0).
        expert_activation: "swiglu" (gated: `experts.gate_up`, `shared.gate_up`) or "relu2"
            (Nemotron 3's non-gated `down(relu(up x)^2)`: `experts.up`, `shared.up`), for the
            routed and the shared experts.
        latent_dim: LatentMoE (Nemotron 3 Super, Ultra): the routed experts run in a latent of
            this width, `fc1_latent_proj` [d_model, latent_dim] before them and
            `fc2_latent_proj` [latent_dim, d_model] after the combine; the router and the shared
            experts see the full d_model. 0: none. A multiple of 16.
        dispatch: how expert parallelism (`mesh.expert` > 1) moves the tokens to their experts'
            devices: `all_to_all` (default; ragged all-to-all of each assignment's row, O(k T_l
            d) per device; the routed experts compute one device's bits) or `all_gather`
            (all-gather all T tokens, reduce-scatter the outputs, O(T d) per device; a token's
            outputs summed across devices, last-bit differences). No effect without
            `mesh.expert` > 1; a run may resume with the other.
    """

    num_experts: int = 0
    experts_per_token: int = 2
    expert_mlp_dim: int = 0
    shared_experts: int = 0
    shared_expert_mlp_dim: int = 0
    shared_expert_gate: bool = False
    norm_topk_prob: bool = True
    first_dense_layers: int = 0
    layer_freq: int = 1
    dense_layers: tuple[int, ...] = ()
    capacity_factor: float = 0.0
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0
    dispatch: Literal["all_to_all", "all_gather"] = "all_to_all"
    router: Literal["softmax", "sigmoid"] = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    expert_activation: Literal["swiglu", "relu2"] = "swiglu"
    latent_dim: int = 0

    def __post_init__(self) -> None:
        _check(self.num_experts >= 0, "num_experts", ">= 0 (0: a dense model)", self.num_experts)
        _check(self.dispatch in ("all_to_all", "all_gather"), "dispatch",
               "'all_to_all' or 'all_gather'", self.dispatch)  # fmt: skip
        if not self.num_experts:
            return
        _check(1 <= self.experts_per_token <= self.num_experts, "experts_per_token",
               f"in [1, num_experts={self.num_experts}]", self.experts_per_token)  # fmt: skip
        for key in ("expert_mlp_dim", "shared_expert_mlp_dim"):
            value = getattr(self, key)
            minimum = 1 if key == "expert_mlp_dim" else 0
            _check(value >= minimum, key, f">= {minimum}", value)
            _check(value % 16 == 0, key, "a multiple of 16 (NVFP4 blocks are 16 wide)", value)
        _check(self.shared_experts >= 0, "shared_experts", ">= 0", self.shared_experts)
        _check(self.first_dense_layers >= 0, "first_dense_layers", ">= 0",
               self.first_dense_layers)  # fmt: skip
        _check(self.layer_freq >= 1, "layer_freq", ">= 1", self.layer_freq)
        _check(all(isinstance(i, int) and i >= 0 for i in self.dense_layers), "dense_layers",
               "a list of block indices >= 0", self.dense_layers)  # fmt: skip
        _check(math.isfinite(self.capacity_factor) and self.capacity_factor >= 0,
               "capacity_factor", "> 0 (a capacity), or 0 (dropless)",
               self.capacity_factor)  # fmt: skip
        for key in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            value = getattr(self, key)
            _check(math.isfinite(value) and value >= 0, key, "a finite number >= 0", value)
        _check(not self.shared_expert_gate or self.shared_experts > 0, "shared_expert_gate",
               "false without shared experts (shared_experts=0)",
               self.shared_expert_gate)  # fmt: skip
        _check_nemotron_keys(self)

    @property
    def shared_mlp_dim(self) -> int:
        """The hidden width of the shared experts together (0: none)."""
        return self.shared_experts * (self.shared_expert_mlp_dim or self.expert_mlp_dim)


def _check_nemotron_keys(moe: MoEConfig) -> None:
    """Raises ValueError naming the first of the router / expert keys out of range."""
    _check(moe.router in ("softmax", "sigmoid"), "router", "'softmax' or 'sigmoid'", moe.router)
    _check(moe.expert_activation in ("swiglu", "relu2"), "expert_activation",
           "'swiglu' or 'relu2'", moe.expert_activation)  # fmt: skip
    _check(moe.n_group >= 1 and moe.num_experts % moe.n_group == 0, "n_group",
           f"a divisor of num_experts={moe.num_experts}", moe.n_group)  # fmt: skip
    group = moe.num_experts // moe.n_group
    _check(moe.n_group == 1 or group >= 2, "n_group",
           "1, or leave >= 2 experts per group (a group scores its two best)",
           moe.n_group)  # fmt: skip
    _check(1 <= moe.topk_group <= moe.n_group, "topk_group", f"in [1, n_group={moe.n_group}]",
           moe.topk_group)  # fmt: skip
    _check(moe.experts_per_token <= moe.topk_group * group, "experts_per_token",
           f"<= topk_group * experts per group = {moe.topk_group * group}",
           moe.experts_per_token)  # fmt: skip
    _check(math.isfinite(moe.routed_scaling_factor) and moe.routed_scaling_factor > 0,
           "routed_scaling_factor", "a finite number > 0", moe.routed_scaling_factor)  # fmt: skip
    _check(moe.latent_dim >= 0 and moe.latent_dim % 16 == 0, "latent_dim",
           "0 (none) or a multiple of 16 (NVFP4 blocks are 16 wide)", moe.latent_dim)  # fmt: skip


def is_moe_layer(moe: MoEConfig, index: int) -> bool:
    """Whether block `index` is an MoE block (see the module docstring)."""
    return (
        moe.num_experts > 0
        and index >= moe.first_dense_layers
        and (index + 1) % moe.layer_freq == 0
        and index not in moe.dense_layers
    )


def expert_capacity(moe: MoEConfig, tokens: int) -> int:
    """How many assignments one expert takes from a batch of `tokens` tokens (`tokens *
    experts_per_token` when dropless: every assignment could go to one expert).

    Example:
        >>> expert_capacity(MoEConfig(num_experts=8, expert_mlp_dim=16, capacity_factor=1.0), 64)
        16
    """
    assignments = tokens * moe.experts_per_token
    if moe.capacity_factor == 0:
        return assignments
    return min(assignments, math.ceil(moe.capacity_factor * assignments / moe.num_experts))


MOE_ARCHITECTURES = {
    "qwen3_moe": {"shared_experts": (0,), "shared_expert_gate": (False,),
                  "first_dense_layers": (0,), "bias_update_rate": (0.0,)},
    "mixtral": {"shared_experts": (0,), "shared_expert_gate": (False,), "first_dense_layers": (0,),
                "layer_freq": (1,), "dense_layers": ((),), "norm_topk_prob": (True,),
                "bias_update_rate": (0.0,)},
    "qwen2_moe": {"shared_experts": (1,), "shared_expert_gate": (True,),
                  "first_dense_layers": (0,), "bias_update_rate": (0.0,)},
}  # fmt: skip
"""MoE `model.architecture` -> the `model.moe` values its Hugging Face class can build (key ->
allowed values; keys not listed are free). Qwen3-MoE: routed experts only, dense blocks by
`decoder_sparse_step` / `mlp_only_layers`; Mixtral: every block MoE, renormalised top-k; Qwen2-MoE:
one gated shared expert besides the routed ones. No class has DeepSeek-V3's routing bias or its
first dense blocks (a Qwen class spells those as `mlp_only_layers`: use `dense_layers`).
nvfp4-export repeats this table (`nvfp4_export.moe_spec.MOE_ARCHITECTURES`);
integration_tests/test_policy_agreement.py keeps the two equal."""
NEMOTRON_MOE_KEYS = {"router": ("softmax",), "n_group": (1,), "topk_group": (1,),
                     "routed_scaling_factor": (1.0,), "expert_activation": ("swiglu",),
                     "latent_dim": (0,)}  # fmt: skip
"""The `model.moe` keys of Nemotron 3's MoE (sigmoid router, grouped top-k, scaled weights,
squared-ReLU and latent experts) and the one value each that the classes of `MOE_ARCHITECTURES`
build (none of them has these features; `check_moe_architecture` refuses the others)."""


def check_moe_architecture(architecture: str, moe: MoEConfig) -> None:
    """Raises ValueError unless `moe` is a Mixture-of-Experts configuration the Hugging Face class
    of `architecture` builds: an MoE class needs `num_experts > 0` and the values of
    `MOE_ARCHITECTURES`; a dense class may hold MoE blocks (trained, but not exported as it).

    Example:
        >>> check_moe_architecture("mixtral", MoEConfig(num_experts=4, expert_mlp_dim=16,
        ...                                              shared_experts=1))
        Traceback (most recent call last):
        ...
        ValueError: model.architecture='mixtral' builds model.moe.shared_experts in (0,), got 1
    """
    rules = MOE_ARCHITECTURES.get(architecture)
    if rules is None:
        return
    if not moe.num_experts:
        raise ValueError(
            f"model.architecture={architecture!r} is a Mixture-of-Experts class and needs "
            "model.moe.num_experts > 0, got 0"
        )
    for key, allowed in (rules | NEMOTRON_MOE_KEYS).items():
        value = getattr(moe, key)
        if value not in allowed:
            raise ValueError(
                f"model.architecture={architecture!r} builds model.moe.{key} in {allowed}, "
                f"got {value!r}"
            )
