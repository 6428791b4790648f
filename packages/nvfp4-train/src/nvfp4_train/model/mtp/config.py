"""The `model.mtp` section: multi-token prediction layers (DeepSeek-V3, Nemotron 3 Super / Ultra).

MTP depth d (1..D) reads the hidden state h^{d-1} of each position i (h^0: the main model's last
hidden state, after its final norm) and the embedding of token i + d, and predicts token
i + d + 1 through the model's own embedding and output head:

    h' = eh_proj([enorm(embed(x_{i+d})) ; hnorm(h^{d-1}_i)])        [2 d_model] -> [d_model]
    h^d = final_layernorm(blocks(h'))                               the blocks of `pattern`
    logits^d = lm_head(h^d)

Each of the `num_layers` MTP modules holds the blocks of `pattern` (Nemotron's letters: `*`
attention, `-` MLP, `E` MoE; `mtp_hybrid_override_pattern`), stored flat as `mtp.layers.{j}`
(j = module * len(pattern) + block, as Hugging Face stores them): the first block of a module
also holds `enorm`, `hnorm` and `eh_proj`, the last `final_layernorm`. With `depths >
num_layers` (one module only) the module runs at every depth with shared weights (Megatron's
`mtp_use_repeated_layer`, Nemotron 3 Super's training). The loss (`mtp.loss`) is
`loss_scaling_factor / D * sum_d mean CE_d`, in float32.

Example:
    >>> MTPConfig(num_layers=1, pattern="*E").resolved_depths
    1
    >>> MTPConfig(num_layers=1, pattern="*E", depths=2).module_of_depth(1)
    0
"""

from __future__ import annotations

import dataclasses
import math

MTP_LETTERS = {"*": "attention", "-": "mlp", "E": "moe"}
"""The letters an MTP pattern may hold (no Mamba block: NVIDIA's MTP layers are attention and
MoE, and vLLM builds only those)."""


def _check(ok: bool, key: str, expected: str, actual: object) -> None:
    if not ok:
        raise ValueError(f"model.mtp.{key} must be {expected}, got {actual!r}")


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """Multi-token prediction (`num_layers: 0`, the default, is none).

    Attributes:
        num_layers: MTP modules, each with its own weights (Hugging Face's
            `num_nextn_predict_layers`); 0: no MTP.
        pattern: the blocks of each module, Nemotron's letters `*`, `-`, `E`
            (`mtp_hybrid_override_pattern`; Nemotron 3 Super: "*E").
        depths: prediction depths D (Megatron's `mtp_num_layers`); 0: `num_layers`. More depths
            than modules needs one module, run at every depth (shared weights).
        loss_scaling_factor: the MTP loss's weight in the objective: `factor / D * sum_d CE_d`
            (Megatron's `mtp_loss_scaling_factor`; 0.1 its default, Nemotron 3 Super 0.3).
    """

    num_layers: int = 0
    pattern: str = "*E"
    depths: int = 0
    loss_scaling_factor: float = 0.1

    def __post_init__(self) -> None:
        _check(self.num_layers >= 0, "num_layers", ">= 0 (0: no MTP)", self.num_layers)
        if not self.num_layers:
            return
        _check(isinstance(self.pattern, str) and len(self.pattern) > 0
               and set(self.pattern) <= set(MTP_LETTERS), "pattern",
               f"a string of the letters {''.join(MTP_LETTERS)} (attention, MLP, MoE)",
               self.pattern)  # fmt: skip
        _check(self.depths >= 0, "depths", ">= 0 (0: num_layers)", self.depths)
        _check(self.resolved_depths == self.num_layers or self.num_layers == 1, "depths",
               f"0 or num_layers={self.num_layers} (more depths than modules needs one module, "
               "shared by every depth)", self.depths)  # fmt: skip
        _check(self.resolved_depths >= self.num_layers, "depths",
               f">= num_layers={self.num_layers}", self.depths)  # fmt: skip
        factor = self.loss_scaling_factor
        _check(math.isfinite(factor) and factor >= 0, "loss_scaling_factor",
               "a finite number >= 0", factor)  # fmt: skip

    @property
    def resolved_depths(self) -> int:
        """D: the prediction depths (`depths`, or `num_layers` when it is 0)."""
        return self.depths or self.num_layers

    @property
    def kinds(self) -> tuple[str, ...]:
        """The block kinds of one module ("attention", "mlp", "moe")."""
        return tuple(MTP_LETTERS[letter] for letter in self.pattern)

    def module_of_depth(self, depth: int) -> int:
        """The module (0-based) that runs at depth index `depth` (0-based)."""
        return depth if self.num_layers > 1 else 0
