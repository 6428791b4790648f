"""Named precision policies (`precision.preset`): the per-module, per-layer choices NVIDIA trained
its NVFP4 models with, and the scaled BF16-blocks rule they build on.

- "nvfp4-paper": the NVFP4 paper's 12B Nemotron-H (62 blocks: Mamba-2, MLP and attention): every
  linear in `precision.recipe` except the first 2 and the last 8 blocks, in BF16 (scaled to the
  model by `default_bf16_layers`: the default rule, named).
- "nemotron-3-super": Nemotron 3 Super's mixed policy (Megatron-Bridge's
  `nemotron_3_super_bf16_with_nvfp4_mixed` and its TE quantization config): the Mamba in_proj and
  the MoE experts in `precision.recipe` (NVFP4), the Mamba out_proj in MXFP8, the attention
  projections and LatentMoE's `fc1_latent_proj` / `fc2_latent_proj` in BF16, the last 15% of
  blocks in BF16 and none of the first; the router computes in FP32 (it always does here) and the
  MTP layers stay BF16 (as in every policy: `policy.layer_recipe_names`).

Modules that are not the recipe's linears never quantize, whatever a preset or an override says
(`NEVER_QUANTIZED`).

Example:
    >>> preset_bf16_layers("nemotron-3-super", 52), preset_bf16_layers("nvfp4-paper", 62)
    ((0, 8), (2, 8))
    >>> [rule.split("=")[1] for rule in preset_policy("nemotron-3-super")]
    ['mxfp8', 'bf16', 'bf16']
"""

from __future__ import annotations

import math

PRESETS = ("", "nvfp4-paper", "nemotron-3-super")
"""`precision.preset`: "" (none: the scaled rule and `precision.recipe`), or a named policy."""
NEVER_QUANTIZED = ("mamba.conv1d", "mamba.scan", "mamba.norm", "mlp.router", "mlp.shared_gate")
"""Modules that are not linears of the recipe and never quantize, whatever an override says:
Mamba's conv, scan and gated norm (float32), the MoE router and shared-expert gate (FP32)."""


def _round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


def default_bf16_layers(num_layers: int) -> tuple[int, int]:
    """The scaled paper rule: (first, last) blocks kept in BF16 for a model of `num_layers` blocks.

    Example:
        >>> [default_bf16_layers(n) for n in (1, 2, 4, 12, 32, 62)]
        [(0, 0), (0, 1), (1, 1), (1, 2), (1, 4), (2, 8)]
    """
    first = min(max(_round_half_up(2 * num_layers / 62), 1), 2)
    last = min(max(_round_half_up(8 * num_layers / 62), 1), 8)
    while first + last >= num_layers and first + last > 0:
        if first > 0:
            first -= 1
        else:
            last -= 1
    return first, last


def preset_bf16_layers(preset: str, num_layers: int) -> tuple[int, int]:
    """(first, last) blocks a preset keeps in BF16 (the scaled rule unless the preset says
    otherwise); explicit `precision.bf16_first_layers` / `bf16_last_layers` still win."""
    if preset == "nemotron-3-super":
        return 0, _round_half_up(0.15 * num_layers)
    return default_bf16_layers(num_layers)


def preset_policy(preset: str) -> tuple[str, ...]:
    """The overrides (`"REGEX=RECIPE"`) of `preset`, applied to the blocks the first/last rule
    leaves quantized, before the user's `precision.overrides`."""
    if preset == "nemotron-3-super":
        return (
            r"layers\.\d+\.mamba\.out_proj=mxfp8",
            r"layers\.\d+\.attn\..*=bf16",
            r"layers\.\d+\.mlp\.fc[12]_latent_proj=bf16",
        )
    return ()
