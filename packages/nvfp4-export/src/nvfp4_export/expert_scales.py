"""Every routed expert's input scale, never zero and never missing.

Servers read one `input_scale` (`input_global_scale`) per expert and projection, and none copes
with a missing or zero one: vLLM allocates the per-expert scales with `torch.empty` and reads
whatever is there for an expert the checkpoint lacks (vllm/model_executor/layers/quantization/
modelopt.py, `ModelOptNvFp4FusedMoE.create_weights`; a zero turns into NaN downstream), SGLang
fills them with 1.0 (python/sglang/srt/layers/quantization/modelopt_quant.py,
`ModelOptNvFp4FusedMoEMethod.create_weights`, `input_scale_fill`), and most kernels take the max
over the experts, so one wrong value changes every expert's activations.

Training records one input amax per expert (`quant_stats.activation_amax` of
`layers.{i}.mlp.experts.gate_up` / `.down`: a list, docs/checkpoint-schema.md). An expert that
received no token during training has amax 0. Its fallback, documented in docs/export.md, is
what ModelOpt's exporter does for an uncalibrated expert (modelopt/torch/export/layer_utils.py,
`set_expert_quantizer_amax`): the largest amax of the block's other experts of the same
projection, with a warning line naming the expert. When every expert of a block's projection
is 0, or the list is missing or malformed, there is nothing to fall back on in that block: the
export is refused, naming the block and experts, unless `allow_uncalibrated` is set; then the
largest amax of that projection in any other MoE block is used (warned), and without any at all
the export is still refused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from nvfp4_export.errors import ExportError
from nvfp4_export.model_spec import LlamaSpec
from nvfp4_export.moe_spec import is_expert_linear

ALLOW_FLAG = "--allow-uncalibrated-experts"
"""The command-line flag (`export_hf(allow_uncalibrated_experts=True)`) that accepts a model-wide
fallback for experts whose block has no input amax at all."""


def _listed(path: str, value, experts: int) -> list[float] | None:
    """The per-expert amax list of `path`, or None when it is not one (missing, a scalar, the
    wrong length, or not finite >= 0)."""
    if not isinstance(value, (list, tuple)) or len(value) != experts:
        return None
    try:
        out = [float(v) for v in value]
    except (TypeError, ValueError):
        return None
    return out if all(math.isfinite(v) and v >= 0 for v in out) else None


def _refusal(path: str, value, experts: int) -> str:
    if value is None:
        return f"{path}: no input amax for its {experts} experts"
    listed = _listed(path, value, experts)
    if listed is None:
        return (f"{path}: input amax {str(value)[:60]} is not a list of {experts} finite "
                "numbers >= 0 (one per expert)")  # fmt: skip
    return f"{path}: every expert ({', '.join(map(str, range(experts)))}) has input amax 0"


def resolve_expert_amax(
    spec: LlamaSpec,
    recipes: Mapping[str, str],
    amax: Mapping[str, object],
    *,
    allow_uncalibrated: bool = False,
) -> tuple[dict[str, object], tuple[str, ...]]:
    """`amax` with every quantized expert linear's list filled (no zero, none missing), and the
    warning lines for the experts that got a fallback.

    Args:
        spec: the model.
        recipes: linear path -> recipe (BF16 experts need no input scale).
        amax: linear path -> input amax (a list per expert for the experts' linears).
        allow_uncalibrated: a block with no amax for a projection takes the model's largest
            amax of that projection instead of being refused.

    Raises:
        ExportError: an expert linear without any usable amax in its block (unless
            `allow_uncalibrated` and another block has one), naming the block and experts.
    """
    experts = spec.num_experts
    paths = [p for p in spec.linear_paths() if is_expert_linear(p) and recipes[p] != "bf16"]
    out, notes, refused = dict(amax), [], {}
    for path in paths:
        listed = _listed(path, amax.get(path), experts)
        if listed is None or max(listed) <= 0:
            refused[path] = _refusal(path, amax.get(path), experts)
            continue
        idle = [e for e, v in enumerate(listed) if v <= 0]
        if idle:
            fallback = max(listed)
            notes.append(
                f"{path}: experts {idle} received no token in training (input amax 0); their "
                f"input scale uses the largest amax of the block's other experts, {fallback:.6g} "
                "(ModelOpt's fallback for uncalibrated experts)"
            )
            listed = [fallback if v <= 0 else v for v in listed]
        out[path] = listed
    if refused:
        notes += _model_wide(out, refused, allow_uncalibrated, experts)
    return out, tuple(notes)


def _model_wide(out: dict, refused: dict[str, str], allow: bool, experts: int) -> list[str]:
    """Fills the refused blocks from the model's largest amax per projection (with `allow`)."""
    what = "; ".join(refused.values())
    if not allow:
        raise ExportError(
            f"{what}: a server would get a zero or missing input scale for these experts (vLLM "
            "reads uninitialised memory, SGLang 1.0). Export from a checkpoint whose quant_stats "
            f"hold them, pass --calibrate N, pass {ALLOW_FLAG} to use the largest amax of the "
            "same projection in the model's other MoE blocks, or --weight-only"
        )
    notes = []
    for path in refused:
        kind = path.rsplit(".", 1)[-1]
        others = [max(v) for p, v in out.items() if p not in refused and is_expert_linear(p)
                  and p.endswith(kind) and isinstance(v, list)]  # fmt: skip
        if not others:
            raise ExportError(
                f"{refused[path]}, and no other MoE block has an input amax for {kind}: there is "
                "no scale to fall back on. Pass --calibrate N, or --weight-only"
            )
        out[path] = [max(others)] * experts
        notes.append(f"{refused[path]}; {ALLOW_FLAG}: every expert's input scale uses the "
                     f"model's largest {kind} amax, {max(others):.6g}")  # fmt: skip
    return notes


def refuse_mixed_experts(spec: LlamaSpec, recipes: Mapping[str, str]) -> None:
    """Raises ExportError when an MoE block's gate_up and down experts are not both BF16 or both
    quantized: every server builds one fused MoE layer per block with one quantization method
    (vLLM compressed-tensors `CompressedTensorsMoEMethod.get_moe_method`: "All MoE projections
    need to have same quantization scheme"; its ModelOpt config and SGLang exclude the fused
    layer as a whole)."""
    for i in spec.moe_layers():
        names = {k: recipes[f"layers.{i}.mlp.experts.{k}"] for k in ("gate_up", "down")}
        if (names["gate_up"] == "bf16") != (names["down"] == "bf16"):
            raise ExportError(
                f"layer {i}'s experts mix BF16 and FP4 (experts.gate_up {names['gate_up']!r}, "
                f"experts.down {names['down']!r}); servers build one MoE layer per block with one "
                "quantization scheme (vLLM refuses mixed ones). Train both with the same "
                "precision (precision.overrides)"
            )
