"""Which weight format each linear was trained with: the checkpoint's list, else the config's rule.

Preferred source: the `quant_stats` item's `recipes` map (module path -> recipe name), written by
training. Without it the map is re-derived from the config's `precision:` section with the rule
of the training package's precision policy (documented in docs/export.md):

    first = clamp(round_half_up(2 * L / 62), 1, 2); last = clamp(round_half_up(8 * L / 62), 1, 8)
    while first + last >= L (and > 0): drop a first block if any, else a last block
    explicit `bf16_first_layers` / `bf16_last_layers` >= 0 replace the rule's counts
    blocks i < first or i >= L - last use "bf16", the others `precision.recipe`
    then each `overrides` entry "REGEX=RECIPE" (re.fullmatch on the path) is applied in order.

A config with a `precision.schedule` (rules per GEMM, layer and step window) or a
`precision.preset` other than "nvfp4-paper" (the rule above, named) is not re-derived:
which preset the final weights' forward used depends on the schedule's last phases, which the
training package resolves and writes into `quant_stats.recipes`; without that item such a
checkpoint is refused.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from nvfp4_export.errors import ExportError
from nvfp4_export.hybrid_spec import never_quantized_refusal
from nvfp4_export.model_spec import LlamaSpec


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """How a recipe quantized the weight in the forward pass (the values the model computed with).

    Attributes:
        fmt: "nvfp4", "mxfp4", "mxfp8" or "bf16" (not quantized).
        block_shape: (16, 16) or (1, 16) for NVFP4 (blocks along the input axis of W^T); None else.
        quantized_input: the recipe quantizes the activations too (W4A4).
        input_outer_scale: "tensor", or "row" when the recipe gave the activations one outer
            scale per token ("nvfp4-per-token"): no server's NVFP4 W4A4 layout holds those (they
            apply one static input global scale per tensor), so such linears export weight-only.
        block_scale_rule: "max", or "4over6" for Four Over Six weights (standard NVFP4 codes and
            scales under the global scale amax / (6 * 256); servers read them unchanged).
    """

    fmt: str
    block_shape: tuple[int, int] | None = None
    quantized_input: bool = False
    input_outer_scale: str = "tensor"
    block_scale_rule: str = "max"


RECIPE_WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "nvfp4": WeightFormat("nvfp4", (16, 16), True),
    "nvfp4-no-rht": WeightFormat("nvfp4", (16, 16), True),
    "nvfp4-no-sr": WeightFormat("nvfp4", (16, 16), True),
    "nvfp4-no-2d": WeightFormat("nvfp4", (1, 16), True),
    "nvfp4-naive": WeightFormat("nvfp4", (1, 16), True),
    "nvfp4-4over6": WeightFormat("nvfp4", (16, 16), True, block_scale_rule="4over6"),
    "nvfp4-fwd-mxfp8-bwd": WeightFormat("nvfp4", (16, 16), True),
    "nvfp4-per-token": WeightFormat("nvfp4", (16, 16), True, input_outer_scale="row"),
    "mxfp4": WeightFormat("mxfp4", None, True),
    "mxfp8": WeightFormat("mxfp8", None, True),
    "bf16": WeightFormat("bf16"),
}
"""Training recipe presets -> their forward weight format. ("fp8", per-tensor current scaling,
has no export: the stored per-tensor FP8 is a stand-in for MXFP8, `eight_bit_formats`.)"""


def weight_format(recipe: str, path: str) -> WeightFormat:
    """The `WeightFormat` of recipe preset `recipe` used by linear `path`."""
    if recipe == "fp8":
        raise ExportError(
            f"linear {path!r} was trained with the 'fp8' recipe (per-tensor current scaling), "
            f"which nvfp4-export does not export (use recipes {sorted(RECIPE_WEIGHT_FORMATS)})"
        )
    if recipe not in RECIPE_WEIGHT_FORMATS:
        raise ExportError(
            f"linear {path!r}: unknown recipe {recipe!r}; expected one of "
            f"{sorted(RECIPE_WEIGHT_FORMATS)}"
        )
    return RECIPE_WEIGHT_FORMATS[recipe]


def default_bf16_layers(num_layers: int) -> tuple[int, int]:
    """(first, last) blocks the scaled paper rule keeps in BF16.

    Example:
        >>> [default_bf16_layers(n) for n in (1, 2, 4, 12, 32, 62)]
        [(0, 0), (0, 1), (1, 1), (1, 2), (1, 4), (2, 8)]
    """
    first = min(max(math.floor(2 * num_layers / 62 + 0.5), 1), 2)
    last = min(max(math.floor(8 * num_layers / 62 + 0.5), 1), 8)
    while first + last >= num_layers and first + last > 0:
        if first > 0:
            first -= 1
        else:
            last -= 1
    return first, last


def _rule_recipes(spec: LlamaSpec, precision: dict[str, Any]) -> dict[str, str]:
    if precision.get("schedule"):
        raise ExportError(
            f"the config has a precision.schedule ({len(precision['schedule'])} rules), so the "
            "recipe map of its linears must come from the checkpoint's quant_stats item "
            "(quant_stats.recipes, written by nvfp4-train with every checkpoint); this one lacks it"
        )
    if precision.get("preset") not in (None, "", "nvfp4-paper"):
        raise ExportError(
            f"the config has precision.preset={precision['preset']!r}, so the recipe map of its "
            "linears must come from the checkpoint's quant_stats item (quant_stats.recipes, "
            "written by nvfp4-train with every checkpoint); this one lacks it"
        )
    rule_first, rule_last = default_bf16_layers(spec.num_layers)
    first = int(precision.get("bf16_first_layers", -1))
    last = int(precision.get("bf16_last_layers", -1))
    first = min(rule_first if first < 0 else first, spec.num_layers)
    last = min(rule_last if last < 0 else last, spec.num_layers)
    recipe, n = str(precision.get("recipe", "nvfp4")), spec.num_layers
    names = {}
    for i in range(n):
        for linear in spec.block_linear_names(i):
            names[f"layers.{i}.{linear}"] = "bf16" if i < first or i >= n - last else recipe
    for text in precision.get("overrides", []) or []:
        if not isinstance(text, str) or "=" not in text:
            raise ExportError(f"precision.overrides entries must be 'REGEX=RECIPE', got {text!r}")
        pattern, override = text.rsplit("=", 1)
        compiled = re.compile(pattern.strip())
        for path in names:
            if compiled.fullmatch(path):
                names[path] = override.strip()
    return names


def linear_recipes(
    spec: LlamaSpec, config: dict[str, Any], quant_stats: dict[str, Any] | None
) -> dict[str, str]:
    """Module path (`layers.3.attn.qkv`) -> recipe name for every linear.

    Args:
        spec: the model.
        config: the resolved training config (its `precision:` section is used without a list).
        quant_stats: the checkpoint's `quant_stats` item or None; its `recipes` map wins.

    Raises:
        ExportError: the list does not cover exactly the model's linears, or there is no list
            and the config has a `precision.schedule`.
    """
    listed = (quant_stats or {}).get("recipes")
    if spec.hybrid:
        overrides = (config.get("precision") or {}).get("overrides") or []
        never_quantized_refusal(spec.hybrid, listed or {}, overrides, spec.linear_paths())
    if listed is None:
        return _rule_recipes(spec, config.get("precision") or {})
    expected = set(spec.linear_paths())
    missing, extra = sorted(expected - set(listed)), sorted(set(listed) - expected)
    if missing or extra:
        raise ExportError(
            f"quant_stats.recipes must list exactly the model's linears; missing {missing[:4]}, "
            f"unexpected {extra[:4]}"
        )
    return {path: str(listed[path]) for path in spec.linear_paths()}
