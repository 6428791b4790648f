"""Precision policy: which recipe each linear layer uses (see docs/precision-policy.md).

Default rule (the paper keeps the first 2 and last 8 of 62 blocks in BF16, ~16% of the linears),
scaled to a model of L blocks:
    first = clamp(round_half_up(2 * L / 62), 1, 2)
    last  = clamp(round_half_up(8 * L / 62), 1, 8)
then, while the BF16 blocks would cover every block of a model with L >= 2, drop a first block,
then a last block, so at least one block keeps the quantized recipe (the last blocks are the
sensitive ones in the paper, so they are kept longest). L=1: the single block is quantized.
Examples (first, last): L=1 (0, 0); L=2 (0, 1); L=4 (1, 1); L=6 (1, 1); L=12 (1, 2); L=32 (1, 4);
L=62 (2, 8); L=126 (2, 8).

Overrides: `"REGEX=RECIPE"` strings, matched with `re.fullmatch` against module paths such as
`layers.3.mlp.down`, applied in order after the rule (the last match wins).

Late BF16 forward (`bf16_forward_from`, the NVFP4 paper's Appendix D): from the switch step on,
every quantized linear runs `recipe.with_bf16_fprop()` (Fprop GEMM in BF16, Dgrad and Wgrad
unchanged); see `bf16_forward_start`.

Precision schedule (`schedule`, `nvfp4_train.precision.schedule`): rules per layer, GEMM and step window.
The settings above are its implicit first rules (`schedule_rules`): `recipe`, the first/last
BF16 blocks and `overrides` (the table of `layer_recipe_names`, all GEMMs, the whole run), then
`bf16_forward_from` (the Fprop GEMM of the quantized linears in BF16 from the switch step on);
the user's rules follow and win. `precision_phases` resolves them into phases.
"""

from __future__ import annotations

import dataclasses
import re

import nvfp4_ops
from nvfp4_train.errors import ConfigError
from nvfp4_train.model.config import ModelConfig, block_linear_names, linear_paths
from nvfp4_train.model.decoder import layer_layout
from nvfp4_train.model.stacking import LayerLayout
from nvfp4_train.model.weight_gather import GATHER_MODES
from nvfp4_train.precision.presets import (
    NEVER_QUANTIZED,
    PRESETS,
    preset_bf16_layers,
    preset_policy,
)
from nvfp4_train.precision.presets import (  # re-exported: the rule's home was here
    default_bf16_layers as default_bf16_layers,
)
from nvfp4_train.precision.schedule import (
    GEMMS,
    PrecisionPhase,
    Rule,
    ScheduleRule,
    check_step_or_fraction,
    forward_weight_names,
    resolve_phases,
    resolve_rule,
    step_of,
)

BF16_RECIPE = "bf16"
VERIFY_MODES = ("warn", "strict", "off")


def backend_spec(text: str) -> str | tuple[str, ...]:
    """`precision.backend` as `nvfp4_ops.dot_general` takes it: "auto", a name, or an order.

    Example:
        >>> backend_spec("auto"), backend_spec("te"), backend_spec("te, emulated")
        ('auto', 'te', ('te', 'emulated'))
    """
    expected = f"'auto', one of {nvfp4_ops.BACKENDS}, or a comma-separated order of them"
    if not isinstance(text, str):
        raise ValueError(f"precision.backend must be {expected}, got {text!r}")
    names = tuple(part.strip() for part in text.split(","))
    if names == ("auto",):
        return "auto"
    unknown = [n for n in names if n not in nvfp4_ops.BACKENDS]
    if unknown or len(set(names)) != len(names):
        raise ValueError(f"precision.backend must be {expected}, got {text!r}")
    return names[0] if len(names) == 1 else names


def _parse_override(text: str) -> tuple[re.Pattern[str], str]:
    """Splits `"REGEX=RECIPE"` at its last `=`; validates both halves."""
    if not isinstance(text, str) or "=" not in text:
        raise ValueError(
            f"precision.overrides entries must be strings 'REGEX=RECIPE' "
            f"(e.g. 'layers\\.0\\..*=bf16'), got {text!r}"
        )
    pattern, recipe = text.rsplit("=", 1)
    try:
        compiled = re.compile(pattern.strip())
    except re.error as err:
        raise ValueError(f"precision.overrides: bad regex {pattern!r} in {text!r}: {err}") from err
    _check_recipe_name(recipe.strip(), f"precision.overrides ({text!r})")
    return compiled, recipe.strip()


def _check_recipe_name(name: str, where: str) -> None:
    try:
        nvfp4_ops.get_recipe(name)
    except (KeyError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from err


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """Which recipe each GEMM of each linear runs with, and on which backend.

    (Loss scaling and the skip-step on non-finite gradients are `optimizer.loss_scaling`.)

    Attributes:
        recipe: `nvfp4_ops` preset for the quantized linears ("nvfp4", "nvfp4-no-rht",
            "nvfp4-no-sr", "nvfp4-no-2d", "nvfp4-naive", "nvfp4-4over6", "nvfp4-fwd-mxfp8-bwd",
            "nvfp4-per-token", "mxfp4", "mxfp8", "fp8", "bf16").
        backend: which `nvfp4_ops` backend runs the quantized GEMMs: "auto" (TE on sm_100+
            GPUs, falling back per call to "xla" on GPUs and "emulated" elsewhere), "emulated",
            "xla", "te", or a comma-separated order such as "te,emulated".
        verify_backend: before step 1, check every backend the run may use other than
            "emulated" against "emulated" (`nvfp4_ops.verify_backend`, seconds): "warn" (a
            disagreeing backend is not used, the run says so and continues on the others),
            "strict" (the run stops) or "off".
        bf16_first_layers: Blocks at the start kept in BF16; -1 = the scaled default rule.
        bf16_last_layers: Blocks at the end kept in BF16; -1 = the scaled default rule.
        overrides: `"REGEX=RECIPE"` strings matched (fullmatch) against module paths such as
            `layers.3.attn.qkv`; applied in order after the first/last rule, the last match wins.
        bf16_forward_from: When the forward (Fprop) GEMMs of the quantized linears switch to BF16
            while Dgrad and Wgrad stay quantized (`nvfp4_ops.Recipe.with_bf16_fprop`): a float in
            (0, 1] is a fraction of `train.steps` (switch step = round_half_up(fraction * steps);
            the paper switches at ~0.82), an int >= 0 a step number; None (default) never. The
            training step with `k` completed steps before it runs the BF16 forward when
            `k >= switch step`, and so does validation of a model with `k` completed steps.
        schedule: `ScheduleRule`s applied in order after the settings above (later rules win):
            which preset quantizes which GEMMs (fprop, dgrad, wgrad) of which linears (regex)
            in which window of steps; see `nvfp4_train.precision.schedule` and docs/precision-policy.md.
        gather: what FSDP (`mesh.fsdp` > 1) gathers of each linear's kernel: "master" (default:
            the float32 master, cast after the gather as XLA places it), "compute" (each slice cast
            to the compute dtype, then gathered), "quantized" (each slice quantized in the recipe's
            16x16 weight tiles with the global tensor scale, the packed FP4 codes and E4M3 scales
            gathered; linears whose recipe cannot use them gather as "compute"). Same bits in
            every mode; see `nvfp4_train.model.weight_gather` and docs/distributed.md.
        preset: a named per-module, per-layer policy applied before `overrides` (`PRESETS`,
            `preset_policy`): "nvfp4-paper" (the NVFP4 paper's 12B Nemotron-H: every linear in
            `recipe` but the first 2 and last 8 of 62 blocks, scaled to the model), or
            "nemotron-3-super" (Mamba in_proj and the experts in `recipe`, Mamba out_proj
            MXFP8, attention BF16, the last 15% of blocks BF16; the router is FP32 always).

    Example:
        >>> PrecisionConfig(recipe="nvfp4", overrides=("layers\\\\.0\\\\..*=bf16",)).recipe
        'nvfp4'
    """

    recipe: str = "nvfp4"
    backend: str = "auto"
    verify_backend: str = "warn"
    bf16_first_layers: int = -1
    bf16_last_layers: int = -1
    overrides: tuple[str, ...] = ()
    bf16_forward_from: int | float | None = None
    schedule: tuple[ScheduleRule, ...] = ()
    gather: str = "master"
    preset: str = ""

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"precision.preset must be one of {PRESETS}, got {self.preset!r}")
        if self.gather not in GATHER_MODES:
            raise ValueError(f"precision.gather must be one of {GATHER_MODES}, got {self.gather!r}")
        if self.gather == "quantized" and backend_spec(self.backend) == "te":
            raise ValueError(
                "precision.gather=quantized runs the quantized linears on a quantized weight, "
                "which the 'emulated' and 'xla' backends take and 'te' does not (it quantizes "
                "its own); got precision.backend='te'"
            )
        _check_recipe_name(self.recipe, "precision.recipe")
        backend_spec(self.backend)
        if self.verify_backend not in VERIFY_MODES:
            raise ValueError(
                f"precision.verify_backend must be one of {VERIFY_MODES}, "
                f"got {self.verify_backend!r}"
            )
        _check_bf16_forward_from(self.bf16_forward_from)
        for name in ("bf16_first_layers", "bf16_last_layers"):
            value = getattr(self, name)
            if value < -1:
                raise ValueError(f"precision.{name} must be >= 0 or -1 (default rule), got {value}")
        if isinstance(self.overrides, str):
            raise ValueError(
                f"precision.overrides must be a list of 'REGEX=RECIPE' strings, got the single "
                f"string {self.overrides!r}"
            )
        for text in self.overrides:
            _parse_override(text)
        _check_schedule(self.schedule)


def _check_bf16_forward_from(value: object) -> None:
    """Raises ValueError unless `value` is None, an int >= 0 or a float in (0, 1]."""
    check_step_or_fraction(value, "precision.bf16_forward_from", nullable=True)


def _check_schedule(schedule: object) -> None:
    """Raises ValueError unless `schedule` is a tuple of `ScheduleRule`s."""
    if not isinstance(schedule, tuple):
        raise ValueError(
            f"precision.schedule must be a list of rules, got {type(schedule).__name__} "
            f"{schedule!r}"
        )
    for i, rule in enumerate(schedule):
        if not isinstance(rule, ScheduleRule):
            raise ValueError(
                f"precision.schedule[{i}] must be a ScheduleRule (a mapping in YAML), "
                f"got {type(rule).__name__}"
            )


def bf16_forward_start(precision_cfg: PrecisionConfig, total_steps: int) -> int | None:
    """The step count from which the forward GEMMs run in BF16, or None (never).

    Training step `k + 1` (k completed steps before it) uses `layer_recipes(...,
    bf16_forward=True)` when `k >= bf16_forward_start(...)`. A fraction is rounded half up.

    Example:
        >>> bf16_forward_start(PrecisionConfig(bf16_forward_from=0.82), 1000)
        820
        >>> bf16_forward_start(PrecisionConfig(bf16_forward_from=30), 1000)
        30
    """
    value = precision_cfg.bf16_forward_from
    return None if value is None else step_of(value, total_steps)


def bf16_layer_range(model_cfg: ModelConfig, precision_cfg: PrecisionConfig) -> tuple[int, int]:
    """(first, last) blocks in BF16 after applying the config (explicit counts, else the preset's
    or the scaled rule's)."""
    rule_first, rule_last = preset_bf16_layers(precision_cfg.preset, model_cfg.num_layers)
    first = rule_first if precision_cfg.bf16_first_layers < 0 else precision_cfg.bf16_first_layers
    last = rule_last if precision_cfg.bf16_last_layers < 0 else precision_cfg.bf16_last_layers
    return min(first, model_cfg.num_layers), min(last, model_cfg.num_layers)


def layer_recipe_names(model_cfg: ModelConfig, precision_cfg: PrecisionConfig) -> dict[str, str]:
    """Module path -> recipe name for every linear (see `layer_recipes`). The multi-token
    prediction layers (`mtp.layers.*`) are BF16 unless an override names them (Megatron-Bridge's
    `keep_mtp_spec_in_bf16`, set by its Nemotron 3 Super recipes)."""
    first, last = bf16_layer_range(model_cfg, precision_cfg)
    n = model_cfg.num_layers
    names = {}
    for i in range(n):
        in_bf16 = i < first or i >= n - last
        for linear in block_linear_names(model_cfg, i):
            names[f"layers.{i}.{linear}"] = BF16_RECIPE if in_bf16 else precision_cfg.recipe
    names |= dict.fromkeys(
        (p for p in linear_paths(model_cfg) if p.startswith("mtp.")), BF16_RECIPE
    )
    quantized = [p for p, name in names.items() if name != BF16_RECIPE]
    for pattern, recipe in map(_parse_override, preset_policy(precision_cfg.preset)):
        names.update(dict.fromkeys(filter(pattern.fullmatch, quantized), recipe))
    for text in precision_cfg.overrides:
        pattern, recipe = _parse_override(text)
        matched = [path for path in names if pattern.fullmatch(path)]
        if not matched:
            raise ConfigError(_unmatched(text, pattern, model_cfg))
        names.update(dict.fromkeys(matched, recipe))
    return names


def _unmatched(text: str, pattern: re.Pattern[str], model_cfg: ModelConfig) -> str:
    """The error for an override that matches no linear: a module that never quantizes
    (`NEVER_QUANTIZED`) named as such, else what linear paths look like."""
    for i in range(model_cfg.num_layers):
        for module in NEVER_QUANTIZED:
            if pattern.fullmatch(f"layers.{i}.{module}"):
                return (
                    f"precision.overrides entry {text!r} would quantize layers.{i}.{module}, "
                    "which never quantizes (Mamba's conv, scan and gated norm run in float32, "
                    "the router and shared-expert gate in FP32); only linears take a recipe"
                )
    return (
        f"precision.overrides entry {text!r} matches no linear; paths look like "
        f"{linear_paths(model_cfg)[:4]}"
    )


def layer_recipes(
    model_cfg: ModelConfig, precision_cfg: PrecisionConfig, *, bf16_forward: bool = False
) -> dict[str, nvfp4_ops.Recipe]:
    """Module path -> `nvfp4_ops.Recipe` for every linear of the model.

    With `bf16_forward` every quantized recipe becomes `recipe.with_bf16_fprop()` (the late phase
    of `PrecisionConfig.bf16_forward_from`); BF16 linears are unchanged.

    Example:
        >>> cfg = ModelConfig(vocab_size=256, d_model=64, num_layers=4, num_heads=4,
        ...                   num_kv_heads=2, mlp_dim=128)
        >>> recipes = layer_recipes(cfg, PrecisionConfig(recipe="nvfp4"))
        >>> recipes["layers.0.attn.qkv"] == nvfp4_ops.get_recipe("bf16")
        True
    """
    names = layer_recipe_names(model_cfg, precision_cfg)
    recipes = {path: nvfp4_ops.get_recipe(name) for path, name in names.items()}
    if bf16_forward:
        recipes = {path: recipe.with_bf16_fprop() for path, recipe in recipes.items()}
    return recipes


def schedule_rules(
    model_cfg: ModelConfig, precision_cfg: PrecisionConfig, total_steps: int
) -> tuple[Rule, ...]:
    """Every rule of the run in order: the implicit ones of the older settings, then
    `precision.schedule`.

    Implicit rules: each preset of `layer_recipe_names` (`recipe`, first/last BF16 blocks,
    `overrides`) on its linears, all GEMMs, the whole run; then, from the `bf16_forward_from`
    switch step on, "bf16" for the Fprop GEMM of the linears whose preset quantizes.

    Raises:
        ValueError: an override or a schedule rule matches no linear, or a rule's window is
            empty for `total_steps`.
    """
    names = layer_recipe_names(model_cfg, precision_cfg)
    rules = [
        Rule(tuple(p for p, n in names.items() if n == name), GEMMS, 0, None, name,
             "precision.recipe / bf16_first_layers / bf16_last_layers / overrides")
        for name in dict.fromkeys(names.values())
    ]  # fmt: skip
    switch = bf16_forward_start(precision_cfg, total_steps)
    quantized = tuple(p for p, n in names.items() if nvfp4_ops.get_recipe(n).quantized)
    if switch is not None and switch <= total_steps and quantized:
        rules.append(
            Rule(quantized, ("fprop",), switch, None, BF16_RECIPE, "precision.bf16_forward_from")
        )
    paths = linear_paths(model_cfg)
    rules += [
        resolve_rule(rule, i, paths, total_steps) for i, rule in enumerate(precision_cfg.schedule)
    ]
    return tuple(rules)


def precision_phases(
    model_cfg: ModelConfig, precision_cfg: PrecisionConfig, total_steps: int
) -> tuple[PrecisionPhase, ...]:
    """The precision phases of a run of `total_steps` steps (`nvfp4_train.precision.schedule`).

    Without `schedule` they are today's: one phase of `layer_recipes(...)`, and with
    `bf16_forward_from` a second one of `layer_recipes(..., bf16_forward=True)` from the switch.

    Example:
        >>> cfg = ModelConfig(vocab_size=256, d_model=64, num_layers=4, num_heads=4,
        ...                   num_kv_heads=2, mlp_dim=128)
        >>> phases = precision_phases(cfg, PrecisionConfig(bf16_forward_from=0.5), 10)
        >>> [(p.label, p.recipes["layers.1.mlp.down"].name) for p in phases]
        [('[0, 5)', 'nvfp4'), ('[5, end)', 'nvfp4+bf16-fprop')]
    """
    rules = schedule_rules(model_cfg, precision_cfg, total_steps)
    return resolve_phases(rules, linear_paths(model_cfg), total_steps)


def export_recipe_names(
    model_cfg: ModelConfig, precision_cfg: PrecisionConfig, total_steps: int
) -> dict[str, str]:
    """Module path -> the preset of the forward the final weights reproduce (the checkpoints'
    `quant_stats.recipes`, what an export quantizes the weight as): `layer_recipe_names` without
    a schedule (also with `bf16_forward_from`); see `schedule.forward_weight_names`."""
    return forward_weight_names(
        precision_phases(model_cfg, precision_cfg, total_steps), total_steps
    )


def run_layout(cfg) -> LayerLayout:
    """Which blocks a run stores stacked (`model.scan_layers`, `model.layer_layout`): runs of
    blocks whose recipes agree in every precision phase, in the base model (`layer_recipes`) and
    in the export's forward (`export_recipe_names`), so that every model of the run has the same
    params tree, and with the same weight-decay mask (`optimizer.no_decay`).

    Args:
        cfg: the run config (reads `model`, `precision`, `train.steps`, `optimizer.no_decay`).
    """
    phases = precision_phases(cfg.model, cfg.precision, cfg.train.steps)
    base = layer_recipes(cfg.model, cfg.precision)
    exported = forward_weight_names(phases, cfg.train.steps)
    signatures = {
        path: (recipe, nvfp4_ops.get_recipe(exported[path]), *(p.recipes[path] for p in phases))
        for path, recipe in base.items()
    }  # compared per block only: a tuple of recipes serves as the block's recipe
    return layer_layout(cfg.model, signatures, cfg.optimizer.no_decay)
