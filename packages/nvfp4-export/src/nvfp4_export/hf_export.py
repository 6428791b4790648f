"""`export_hf`: a training checkpoint -> a Hugging Face model directory in one FP4 layout."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nvfp4_export.calibrate import amax_from_stats, calibrate, calibration_tokens
from nvfp4_export.checkpoint import (
    QUANT_STATS_ITEM,
    Checkpoint,
    read_checkpoint,
    resolve_checkpoint,
)
from nvfp4_export.errors import ExportError
from nvfp4_export.expert_scales import refuse_mixed_experts, resolve_expert_amax
from nvfp4_export.exported_linear import ExportedLinear
from nvfp4_export.formats import BF16, FORMATS, MODELOPT, calibrated_input
from nvfp4_export.hf_files import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    HF_QUANT_CONFIG_FILE,
    copy_tokenizer,
    dense_parts,
    dense_slots,
    generation_config,
    hf_config,
    special_token_ids,
)
from nvfp4_export.json_files import write_json
from nvfp4_export.layouts import (
    LayoutPlan,
    hf_quant_config,
    linear_tensors,
    plan_layout,
    quantization_config,
)
from nvfp4_export.linears import export_linear, planned_linear
from nvfp4_export.manifest import CHECKPOINT_CHECKED, seal
from nvfp4_export.model_spec import (
    LlamaSpec,
    dense_entries,
    moe_dense_entries,
    spec_from_config,
)
from nvfp4_export.output_dir import atomic_output, check_target
from nvfp4_export.policy import linear_recipes, weight_format
from nvfp4_export.reload import PROVENANCE_FILE, weights_from_checkpoint
from nvfp4_export.servers import check_servers
from nvfp4_export.shard_writer import ShardWriter, TensorSlot

DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """What `export_hf` wrote.

    Attributes:
        out_dir: the export directory.
        step: the checkpoint step exported.
        plan: layout, FP4 format, W4A4 or weight-only, excluded modules.
        amax_source: where input scales came from: "quant_stats", "calibration" or None.
        calibration: with --calibrate: {"sequences": used, "requested": asked,
            "tokens_per_sequence": L, "from": "calibration-text" or "reference"}; else None.
        servers: the servers the export was checked for (`servers.SERVERS` names).
        files: files written (relative names).
        total_bytes: bytes of the weight files.
        seconds: wall time of the export.
        notes: messages for the user (e.g. why the export is weight-only).
    """

    out_dir: Path
    step: int
    plan: LayoutPlan
    amax_source: str | None
    servers: tuple[str, ...]
    files: tuple[str, ...]
    total_bytes: int
    seconds: float
    notes: tuple[str, ...]
    calibration: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class InputAmax:
    """Activation amax per quantized linear path, where it came from ("quant_stats",
    "calibration" or None), the calibration's facts (`ExportResult.calibration`) and notes."""

    amax: dict[str, float]
    source: str | None
    calibration: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()


def _calibrated(ckpt, spec, recipes, n: int, text: Path | None, log) -> InputAmax:
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


def _input_amax(ckpt, spec, recipes, calibrate_n: int | None, calibration_text, log,
                allow_uncalibrated: bool = False) -> InputAmax:  # fmt: skip
    if calibrate_n is not None:
        found = _calibrated(ckpt, spec, recipes, calibrate_n, calibration_text, log)
    else:
        stats = amax_from_stats(ckpt.quant_stats, spec.linear_paths())
        found = InputAmax(stats, QUANT_STATS_ITEM if stats else None)
    if not (spec.num_experts and found.amax):
        return found
    amax, notes = resolve_expert_amax(spec, recipes, found.amax,
                                      allow_uncalibrated=allow_uncalibrated)  # fmt: skip
    return dataclasses.replace(found, amax=amax, notes=found.notes + notes)


def _weight_only_fallback(plan: LayoutPlan, weight_only: bool) -> tuple[str, ...]:
    """Refuse, or warn about, a weight-only export nobody asked for.

    Without activation amax (no `quant_stats` in the checkpoint, no --calibrate) an NVFP4 export
    can only be weight-only. ModelOpt's W4A16_NVFP4 is refused by SGLang and by vLLM releases
    whose QUANT_ALGOS lack it, so that is an error unless --weight-only says it is meant;
    compressed-tensors weight-only loads in transformers and vLLM, so that is a warning.

    Raises:
        ExportError: a ModelOpt export would silently become W4A16_NVFP4.
    """
    if not calibrated_input(plan.fmt) or plan.w4a4 or weight_only:
        return ()
    why = (
        f"the checkpoint has no {QUANT_STATS_ITEM}.activation_amax for every "
        f"{FORMATS[plan.fmt].label} linear and --calibrate was not given, so there are no input "
        "scales"
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


def _refuse_per_token_w4a4(plan: LayoutPlan, recipes: dict[str, str]) -> None:
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


def _provenance(ckpt: Checkpoint, spec: LlamaSpec, recipes, inputs, plan, servers, checked) -> dict:
    amax, source = inputs.amax, inputs.source
    return {
        "producer": "nvfp4-export 0.1.0",
        "source": str(ckpt.ref.step_dir),
        "step": ckpt.ref.step,
        "layout": plan.layout,
        "format": plan.fmt,
        "w4a4": plan.w4a4,
        "excluded": list(plan.excluded),
        "spec": dataclasses.asdict(spec),
        "recipes": recipes,
        "recipes_from": QUANT_STATS_ITEM if (ckpt.quant_stats or {}).get("recipes") else "config",
        "input_amax": amax if plan.w4a4 else {},
        "input_amax_from": source if plan.w4a4 else None,
        "servers": list(servers),
        "calibration": inputs.calibration if plan.w4a4 else None,
        CHECKPOINT_CHECKED: {"parameters": checked, "config": checked and not ckpt.notes},
    }


@dataclasses.dataclass(frozen=True)
class ExportProgress:
    """Where a running export stands (passed to `export_hf`'s `progress` after each tensor).

    Attributes:
        tensors_done / tensors_total: checkpoint tensors handled / to handle.
        bytes_done / bytes_total: float32 checkpoint bytes of those tensors.
    """

    tensors_done: int
    tensors_total: int
    bytes_done: int
    bytes_total: int


def _weight_slots(spec: LlamaSpec, shapes, planned: list[ExportedLinear], plan) -> list[TensorSlot]:
    """Every weight-file tensor in file-assignment order: dense ones, then the linears'."""
    slots = dense_slots(spec, shapes)
    for m in planned:
        slots += [
            TensorSlot(n, a.dtype, tuple(a.shape)) for n, a in linear_tensors(m, plan).items()
        ]
    return slots


def _stream_weights(writer: ShardWriter, ckpt, spec, recipes, amax, plan, progress) -> None:
    """Reads each checkpoint tensor once (a reader thread runs ahead within `read_ahead`'s byte
    budget), converts it and writes its HF tensors."""
    dense = {t.param: t for t in dense_entries(spec)}
    kernels = {f"{path}.kernel": path for path in spec.linear_paths()}
    names = [*dense, *kernels]
    total = sum(ckpt.params.nbytes(n) for n in names)
    done = 0
    for k, (name, value) in enumerate(ckpt.params.read_ahead(names), start=1):
        if name in dense:
            tensors = dense_parts(spec, dense[name], value)
        else:
            path = kernels[name]
            linears = export_linear(spec, path, value, recipes[path], amax.get(path))
            tensors = {n: a for m in linears for n, a in linear_tensors(m, plan).items()}
        for tensor_name, array in tensors.items():
            writer.write(tensor_name, array)
        done += ckpt.params.nbytes(name)
        del value, tensors
        progress(ExportProgress(k, len(names), done, total))


def _write_dir(out, ckpt, spec, slots, stream, plan, provenance, max_shard_bytes) -> list[str]:
    with ShardWriter(out, slots, max_shard_bytes) as writer:
        stream(writer)
    files = list(writer.files)
    bos, eos = special_token_ids(ckpt.tokenizer_dir)
    config = hf_config(spec, eos_token_id=eos, bos_token_id=bos)
    if plan.fmt != BF16:
        config["quantization_config"] = quantization_config(plan)
    write_json(out / CONFIG_FILE, config)
    write_json(out / GENERATION_CONFIG_FILE, generation_config(eos_token_id=eos, bos_token_id=bos))
    files += [CONFIG_FILE, GENERATION_CONFIG_FILE]
    modelopt = hf_quant_config(plan) if plan.fmt != BF16 else None
    if modelopt is not None:
        write_json(out / HF_QUANT_CONFIG_FILE, modelopt)
        files.append(HF_QUANT_CONFIG_FILE)
    files += copy_tokenizer(ckpt.tokenizer_dir, out)
    write_json(out / PROVENANCE_FILE, seal(provenance, out, files))  # last: it hashes the others
    return files + [PROVENANCE_FILE]


def export_hf(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    layout: str,
    weight_only: bool = False,
    step: int | None = None,
    overwrite: bool = False,
    calibrate_n: int | None = None,
    calibration_text: str | Path | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    servers: Sequence[str] | None = None,
    allow_dropped_tensors: bool = False,
    integrity_check: bool = True,
    allow_uncalibrated_experts: bool = False,
    log: Callable[[str], None] = lambda _: None,
    progress: Callable[[ExportProgress], None] = lambda _: None,
) -> ExportResult:
    """Exports a training checkpoint as a Hugging Face Llama directory in `layout`.

    Args:
        checkpoint: a run directory, its checkpoints/ directory or one step directory.
        out_dir: the directory to create (written beside it first, renamed at the end).
        layout: "modelopt" or "compressed-tensors" (MXFP4 runs: compressed-tensors only).
        weight_only: write no input scales even when activation amax is available.
        step: the checkpoint step (default: the newest).
        overwrite: replace an existing `out_dir`.
        calibrate_n: run a calibration pass over this many sequences (>= 1) for the input
            scales; None (the default) runs none.
        calibration_text: a text file to draw calibration sequences from.
        max_shard_bytes: split weights into shards of at most this size (plus an index).
        servers: the servers the export is for (`servers.SERVERS`: "vllm", "sglang",
            "tensorrt-llm", "transformers"); default every server that loads the layout and mode.
        allow_dropped_tensors: export even when one of `servers` would drop a trained tensor (a
            Qwen 3 `o_proj` bias in vLLM), with a warning in `notes`, instead of refusing.
        integrity_check: compare the checkpoint's parameters, config and quant_stats with the
            checksums of its `integrity` item, which must exist. False exports it as found on
            disk, with a warning in `notes`.
        allow_uncalibrated_experts: an MoE block whose experts have no input amax for a
            projection takes the model's largest amax of that projection (warned) instead of
            being refused (`expert_scales`).
        log: receives progress messages and notes.
        progress: called with an `ExportProgress` after each checkpoint tensor is written.

    Raises:
        ExportError: bad checkpoint, layout, dimensions or output path; a model whose
            architecture cannot hold its biases and norms; a ModelOpt export without input
            scales that was not asked to be weight-only; a named server that does not load the
            layout or mode, or one that would drop a trained tensor (nothing is left behind).

    Example:
        >>> export_hf("runs/tiny", "runs/tiny-hf", layout="compressed-tensors")  # doctest: +SKIP
    """
    start = time.perf_counter()
    out_dir = Path(out_dir)
    plan_layout(layout, [], weight_only=weight_only)  # validates the layout name early
    if calibrate_n is not None and calibrate_n < 1:
        raise ExportError(f"--calibrate must be >= 1 sequences, got {calibrate_n}")
    if calibration_text is not None and calibrate_n is None:
        raise ExportError("--calibration-text needs --calibrate N (the number of sequences)")
    ref = resolve_checkpoint(checkpoint, step)
    out_dir = check_target(out_dir, overwrite, source=ref)  # before any work: fail fast
    ckpt = read_checkpoint(ref, integrity_check=integrity_check)
    spec = spec_from_config(ckpt.config, ckpt.params)
    recipes = linear_recipes(spec, ckpt.config, ckpt.quant_stats)
    refuse_mixed_experts(spec, recipes)
    text = None if calibration_text is None else Path(calibration_text)
    inputs = (
        InputAmax({}, None)
        if weight_only
        else _input_amax(ckpt, spec, recipes, calibrate_n, text, log, allow_uncalibrated_experts)
    )
    amax = inputs.amax
    log(f"read step {ckpt.ref.step} of {ckpt.ref.step_dir}; quantizing {len(recipes)} linears")
    shapes = ckpt.params.shapes
    planned: list[ExportedLinear] = []
    for path in spec.linear_paths():
        in_features = shapes[f"{path}.kernel"][-2]
        planned += planned_linear(spec, path, in_features, recipes[path], amax.get(path))
    routers = tuple(t.hf_name.removesuffix(".weight") for i in spec.moe_layers()
                    for t in moe_dense_entries(spec, i))  # fmt: skip
    plan = plan_layout(layout, planned, weight_only=weight_only, always_bf16=routers)
    _refuse_per_token_w4a4(plan, recipes)
    notes = ckpt.notes + inputs.notes + _weight_only_fallback(plan, weight_only)  # before writing
    targets, dropped = check_servers(spec, plan, servers, allow_dropped=allow_dropped_tensors)
    notes += dropped
    provenance = _provenance(ckpt, spec, recipes, inputs, plan, targets, integrity_check)
    slots = _weight_slots(spec, shapes, planned, plan)
    stream = functools.partial(
        _stream_weights, ckpt=ckpt, spec=spec, recipes=recipes, amax=amax, plan=plan,
        progress=progress,
    )  # fmt: skip
    with atomic_output(out_dir, overwrite=overwrite, source=ref) as tmp:
        files = _write_dir(tmp, ckpt, spec, slots, stream, plan, provenance, max_shard_bytes)
    total = sum((out_dir / f).stat().st_size for f in files if f.endswith(".safetensors"))
    for note in notes:
        log("warning: " + note)
    return ExportResult(
        out_dir, ckpt.ref.step, plan, inputs.source if plan.w4a4 else None, targets, tuple(files),
        total, time.perf_counter() - start, notes, inputs.calibration if plan.w4a4 else None,
    )  # fmt: skip
