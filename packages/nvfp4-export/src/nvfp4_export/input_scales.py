"""Where an export's input (activation) scales come from, and when it must go without them.

W4A4 layouts store one static input scale per quantized linear, from the activation amax the run
recorded (`quant_stats`) or a calibration pass (`calibrate`); an MoE block's experts share theirs
(`expert_scales`). Without any, an export can only be weight-only (`weight_only_fallback`), and a
linear trained with per-token activation scales cannot be served W4A4 at all
(`refuse_per_token_w4a4`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from nvfp4_export.calibrate import amax_from_stats, calibrate, calibration_tokens
from nvfp4_export.checkpoint import QUANT_STATS_ITEM
from nvfp4_export.errors import ExportError
from nvfp4_export.expert_scales import resolve_expert_amax
from nvfp4_export.formats import FORMATS, MODELOPT, calibrated_input
from nvfp4_export.layouts import LayoutPlan
from nvfp4_export.policy import weight_format
from nvfp4_export.reload import weights_from_checkpoint


@dataclasses.dataclass(frozen=True)
class InputAmax:
    """Activation amax per quantized linear path, where it came from ("quant_stats",
    "calibration" or None), the calibration's facts (`ExportResult.calibration`) and notes."""

    amax: dict[str, float]
    source: str | None
    calibration: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()


def calibrated_amax(ckpt, spec, recipes, n: int, text: Path | None, log) -> InputAmax:
    """Input amax from a calibration pass over (up to) `n` sequences, saying how many it used."""
    tokens = calibration_tokens(n, ckpt.reference, text, ckpt.tokenizer_dir, spec.max_seq_len)
    used, length = (int(d) for d in tokens.shape)
    where = f"--calibration-text {str(text)!r}" if text else "the checkpoint's reference item"
    log(f"calibrating input scales on {used} sequences of {length} tokens from {where}")
    notes = ()
    if used < n:
        notes = (f"calibrated on {used} sequences, fewer than the {n} asked: {where} holds only "
                 f"{used} sequences of {length} tokens",)  # fmt: skip
    info = {"sequences": used, "requested": n, "tokens_per_sequence": length,
            "from": "calibration-text" if text else "reference"}  # fmt: skip
    weights = weights_from_checkpoint(ckpt, spec, recipes, {})
    return InputAmax(calibrate(weights, tokens), "calibration", info, notes)


def input_amax(
    ckpt,
    spec,
    recipes,
    calibrate_n: int | None,
    calibration_text,
    log,
    allow_uncalibrated: bool = False,
) -> InputAmax:
    """Input amax per quantized linear: from a calibration pass over `calibrate_n` sequences, else
    from the run's `quant_stats`; an MoE block's experts then share theirs (`expert_scales`)."""
    if calibrate_n is not None:
        found = calibrated_amax(ckpt, spec, recipes, calibrate_n, calibration_text, log)
    else:
        stats = amax_from_stats(ckpt.quant_stats, spec.linear_paths())
        found = InputAmax(stats, QUANT_STATS_ITEM if stats else None)
    if not (spec.num_experts and found.amax):
        return found
    amax, notes = resolve_expert_amax(spec, recipes, found.amax,
                                      allow_uncalibrated=allow_uncalibrated)  # fmt: skip
    return dataclasses.replace(found, amax=amax, notes=found.notes + notes)


def weight_only_fallback(plan: LayoutPlan, weight_only: bool) -> tuple[str, ...]:
    """Refuse, or warn about, a weight-only export nobody asked for.

    Without activation amax (no `quant_stats` in the checkpoint, no --calibrate) an NVFP4 export
    can only be weight-only. ModelOpt's W4A16_NVFP4 is refused by SGLang and by vLLM releases
    whose QUANT_ALGOS lack it, so that is an error unless --weight-only says it is meant;
    compressed-tensors weight-only loads in transformers and vLLM, so that is a warning.

    Raises:
        ExportError: a ModelOpt export would silently become W4A16_NVFP4.
    """
    calibrated = [f for f in plan.formats or (plan.fmt,) if calibrated_input(f)]
    if not calibrated or plan.w4a4 or weight_only:
        return ()
    why = (
        f"the checkpoint has no {QUANT_STATS_ITEM}.activation_amax for every "
        f"{FORMATS[calibrated[0]].label} linear and --calibrate was not given, so there are no "
        "input scales"
    )
    if plan.layout == MODELOPT:
        raise ExportError(
            f"{why}: a W4A4 ModelOpt export (quant_algo NVFP4) needs them. Pass --calibrate N "
            "(input scales from N sequences of the run's validation data), or --weight-only "
            "for W4A16_NVFP4, which SGLang and older vLLM releases refuse (docs/export.md)"
        )
    return (
        f"{why}: exported WEIGHT-ONLY (W4A16, no input scales); vLLM and transformers load it, "
        "vLLM runs it W4A16 (Marlin), TensorRT-LLM does not load it. Pass --calibrate N for "
        "W4A4, or --weight-only to say weight-only is meant",
    )


def refuse_per_token_w4a4(plan: LayoutPlan, recipes: dict[str, str]) -> None:
    """A W4A4 export of linears trained with per-token activation scales is an error.

    Their weights are standard NVFP4, but compressed-tensors' and ModelOpt's NVFP4 W4A4 layouts
    (and so vLLM, SGLang, TensorRT-LLM and transformers) quantize activations with ONE static
    input global scale per tensor: the served model would compute with other activation
    numerics than it was trained with.

    Raises:
        ExportError: naming the first such linear and the way out (--weight-only).
    """
    if not plan.w4a4:
        return
    for path, recipe in recipes.items():
        if weight_format(recipe, path).input_outer_scale != "tensor":
            raise ExportError(
                f"linear {path!r} was trained with recipe {recipe!r}, whose activations have "
                "one outer scale per token; no server's NVFP4 W4A4 layout holds per-token "
                "activation scales (they apply one static input scale per tensor), so a W4A4 "
                "export would not compute what the model trained with. Export --weight-only "
                "(W4A16: the weights are standard NVFP4 and load everywhere)"
            )


def refuse_unscaled_standins(plan: LayoutPlan) -> None:
    """A ModelOpt export with FP8 stand-ins (MXFP8-trained linears) needs their static input
    scales: ModelOpt's FP8 layers quantize activations with the `input_scale` they load (vLLM
    `ModelOptFp8LinearMethod`, SGLang, TensorRT-LLM), so without one they serve garbage.

    Raises:
        ExportError: the export has FP8 stand-ins and is not W4A4 (weight-only, or no amax).
    """
    if "fp8" in plan.formats and not plan.w4a4:
        raise ExportError(
            "the MXFP8-trained linears are stored as FP8 per tensor in the ModelOpt layout, whose "
            "readers need their static input scales: export W4A4 (input amax from quant_stats or "
            "--calibrate N, without --weight-only), or use --layout compressed-tensors (MXFP8 as "
            "trained, activations scaled at run time)"
        )
