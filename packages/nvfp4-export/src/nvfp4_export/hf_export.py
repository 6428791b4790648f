"""`export_hf`: a training checkpoint -> a Hugging Face model directory in one layout (an FP4
one, or "bf16": the master weights unquantized)."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nvfp4_export.checkpoint import (
    QUANT_STATS_ITEM,
    Checkpoint,
    CheckpointRef,
    read_checkpoint,
    resolve_checkpoint,
)
from nvfp4_export.errors import ExportError
from nvfp4_export.expert_scales import refuse_mixed_experts
from nvfp4_export.exported_linear import ExportedLinear
from nvfp4_export.formats import BF16, BF16_LAYOUT, stored_recipes
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
from nvfp4_export.hybrid_names import conv1d_modules
from nvfp4_export.input_scales import (
    InputAmax,
    input_amax,
    refuse_per_token_w4a4,
    refuse_unscaled_standins,
    weight_only_fallback,
)
from nvfp4_export.json_files import write_json
from nvfp4_export.layouts import (
    LayoutPlan,
    hf_quant_config,
    linear_tensors,
    plan_layout,
    quantization_config,
    refuse_bf16_options,
)
from nvfp4_export.linears import layout_linear, planned_linear
from nvfp4_export.manifest import CHECKPOINT_CHECKED, STANDINS, seal
from nvfp4_export.model_spec import (
    LlamaSpec,
    dense_entries,
    moe_dense_entries,
    spec_from_config,
)
from nvfp4_export.output_dir import atomic_output, check_target
from nvfp4_export.policy import linear_recipes
from nvfp4_export.reload import PROVENANCE_FILE
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
        standins: training linear -> the weight error its stand-in adds (an MXFP8 linear stored
            as FP8 per tensor in ModelOpt: max |FP8 - MXFP8| / max |MXFP8|); empty for none.
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
    standins: dict[str, float] = dataclasses.field(default_factory=dict)


def _provenance(ckpt: Checkpoint, spec: LlamaSpec, recipes, inputs, plan, servers, checked) -> dict:
    amax, source = inputs.amax, inputs.source
    return {
        "producer": "nvfp4-export 0.1.0",
        "source": str(ckpt.ref.step_dir),
        "step": ckpt.ref.step,
        "layout": plan.layout,
        "format": plan.fmt,
        "formats": list(plan.formats),
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


def _stream_weights(writer: ShardWriter, ckpt, spec, recipes, amax, plan, progress) -> dict:
    """Reads each checkpoint tensor once (a reader thread runs ahead within `read_ahead`'s byte
    budget), converts it and writes its HF tensors; returns the stand-ins' added errors
    (`ExportResult.standins`)."""
    dense = {t.param: t for t in dense_entries(spec)}
    kernels = {f"{path}.kernel": path for path in spec.linear_paths()}
    names = [*dense, *kernels]
    total = sum(ckpt.params.nbytes(n) for n in names)
    done, standins = 0, {}
    for k, (name, value) in enumerate(ckpt.params.read_ahead(names), start=1):
        if name in dense:
            tensors = dense_parts(spec, dense[name], value)
        else:
            path = kernels[name]
            linears = layout_linear(spec, path, value, recipes[path], amax.get(path), plan.layout)
            tensors = {n: a for m in linears for n, a in linear_tensors(m, plan).items()}
            errors = [m.standin_error for m in linears if m.standin_error is not None]
            standins |= {path: errors[0]} if errors else {}
        for tensor_name, array in tensors.items():
            writer.write(tensor_name, array)
        done += ckpt.params.nbytes(name)
        del value, tensors
        progress(ExportProgress(k, len(names), done, total))
    return standins


def _write_dir(out, ckpt, spec, slots, stream, plan, provenance, max_shard_bytes):
    """Writes every file of the export into `out`; returns (files, stand-ins' errors)."""
    with ShardWriter(out, slots, max_shard_bytes) as writer:
        standins = stream(writer)
    provenance = {**provenance, STANDINS: standins}
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
    return files + [PROVENANCE_FILE], standins


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
        layout: "modelopt" or "compressed-tensors" (MXFP4 runs: compressed-tensors only), or
            "bf16": every linear's master weight rounded to bfloat16, no quantization (which
            takes none of `weight_only`, `calibrate_n`, `calibration_text`).
        weight_only: write no input scales even when activation amax is available.
        step: the checkpoint step (default: the newest); overwrite: replace an existing `out_dir`.
        calibrate_n, calibration_text: run a calibration pass over this many sequences (>= 1;
            None, the default: none) for the input scales, drawn from that text file when given.
        max_shard_bytes: split weights into shards of at most this size (plus an index).
        servers: the servers the export is for (`servers.SERVERS`: "vllm", "sglang",
            "tensorrt-llm", "transformers"); default every server that loads the layout and mode.
        allow_dropped_tensors: export even when one of `servers` would drop a trained tensor (a
            Qwen 3 `o_proj` bias in vLLM), with a warning in `notes`, instead of refusing.
        integrity_check: compare the checkpoint's parameters, config and quant_stats with the
            checksums of its `integrity` item, which must exist; False: as found, with a note.
        allow_uncalibrated_experts: an MoE block whose experts have no input amax for a
            projection takes the model's largest amax of it (warned) instead of being refused.
        log, progress: receive messages and notes / an `ExportProgress` after each tensor.

    Raises:
        ExportError: bad checkpoint, layout, dimensions or output path; an architecture that
            cannot hold its biases and norms; a ModelOpt export without input scales not asked
            to be weight-only; a named server that does not load the layout or mode, or would
            drop a trained tensor (nothing is left behind).

    Example:
        >>> export_hf("runs/tiny", "runs/tiny-hf", layout="compressed-tensors")  # doctest: +SKIP
    """
    start = time.perf_counter()
    job = _prepare_export(
        checkpoint, out_dir, layout, weight_only, step, overwrite, calibrate_n, calibration_text,
        servers, allow_dropped_tensors, integrity_check, allow_uncalibrated_experts, log,
    )  # fmt: skip
    files, standins = _write_export(job, overwrite, max_shard_bytes, progress)
    return _finish(job, files, start, log, standins)


@dataclasses.dataclass(frozen=True)
class _ExportJob:
    """What an export writes, decided (and every refusal made) before its first byte is written.

    `recipes` are the ones its linears are stored with (`formats.stored_recipes`; the manifest
    keeps the trained ones); `notes` are the warnings for the user; `targets` the servers it was
    checked for.
    """

    ref: CheckpointRef
    out_dir: Path
    ckpt: Checkpoint
    spec: LlamaSpec
    recipes: dict[str, str]
    inputs: InputAmax
    planned: list[ExportedLinear]
    plan: LayoutPlan
    notes: tuple[str, ...]
    targets: tuple[str, ...]
    provenance: dict


def _prepare_export(
    checkpoint: str | Path,
    out_dir: str | Path,
    layout: str,
    weight_only: bool,
    step: int | None,
    overwrite: bool,
    calibrate_n: int | None,
    calibration_text: str | Path | None,
    servers: Sequence[str] | None,
    allow_dropped_tensors: bool,
    integrity_check: bool,
    allow_uncalibrated_experts: bool,
    log: Callable[[str], None],
) -> _ExportJob:
    """`export_hf` up to writing: check the request and the target, read the checkpoint, take the
    input amax (calibrating if asked), plan the linears and the layout, check the servers."""
    out_dir = Path(out_dir)
    plan_layout(layout, [], weight_only=weight_only)  # validates the layout name early
    refuse_bf16_options(layout, weight_only=weight_only, calibrate_n=calibrate_n,
                        calibration_text=calibration_text)  # fmt: skip
    if calibrate_n is not None and calibrate_n < 1:
        raise ExportError(f"--calibrate must be >= 1 sequences, got {calibrate_n}")
    if calibration_text is not None and calibrate_n is None:
        raise ExportError("--calibration-text needs --calibrate N (the number of sequences)")
    ref = resolve_checkpoint(checkpoint, step)
    out_dir = check_target(out_dir, overwrite, source=ref)  # before any work: fail fast
    ckpt = read_checkpoint(ref, integrity_check=integrity_check)
    spec = spec_from_config(ckpt.config, ckpt.params)
    recipes = linear_recipes(spec, ckpt.config, ckpt.quant_stats)
    stored = stored_recipes(layout, recipes)  # "bf16" for every linear of the bf16 layout
    refuse_mixed_experts(spec, stored)
    text = None if calibration_text is None else Path(calibration_text)
    inputs = (
        InputAmax({}, None)
        if weight_only or layout == BF16_LAYOUT
        else input_amax(ckpt, spec, recipes, calibrate_n, text, log, allow_uncalibrated_experts)
    )
    log(f"read step {ckpt.ref.step} of {ckpt.ref.step_dir}; exporting {len(recipes)} linears")
    planned, plan = _plan_linears(
        spec, ckpt.params.shapes, stored, inputs.amax, layout, weight_only
    )
    refuse_per_token_w4a4(plan, stored)
    refuse_unscaled_standins(plan)
    notes = ckpt.notes + inputs.notes + weight_only_fallback(plan, weight_only)  # before writing
    targets, dropped = check_servers(spec, plan, servers, allow_dropped=allow_dropped_tensors)
    notes += dropped
    provenance = _provenance(ckpt, spec, recipes, inputs, plan, targets, integrity_check)
    return _ExportJob(
        ref, out_dir, ckpt, spec, stored, inputs, planned, plan, notes, targets, provenance
    )


def _plan_linears(
    spec: LlamaSpec,
    shapes,
    recipes: dict[str, str],
    amax: dict[str, float],
    layout: str,
    weight_only: bool,
) -> tuple[list[ExportedLinear], LayoutPlan]:
    """Every exported linear (shapes and formats, nothing quantized yet) and the layout plan; the
    MoE routers stay BF16 and the Mamba convs are listed as excluded."""
    planned: list[ExportedLinear] = []
    for path in spec.linear_paths():
        in_features = shapes[f"{path}.kernel"][-2]
        planned += planned_linear(spec, path, in_features, recipes[path], amax.get(path), layout)
    never = tuple(t.hf_name.removesuffix(".weight") for i in spec.moe_layers()
                  for t in moe_dense_entries(spec, i))  # fmt: skip
    never += conv1d_modules(spec) if spec.hybrid else ()
    return planned, plan_layout(layout, planned, weight_only=weight_only, always_bf16=never)


def _write_export(
    job: _ExportJob, overwrite: bool, max_shard_bytes: int, progress: Callable
) -> tuple[list[str], dict[str, float]]:
    """Writes the directory beside `job.out_dir` and renames it into place; returns its files
    and the stand-ins' added errors."""
    slots = _weight_slots(job.spec, job.ckpt.params.shapes, job.planned, job.plan)
    stream = functools.partial(
        _stream_weights, ckpt=job.ckpt, spec=job.spec, recipes=job.recipes,
        amax=job.inputs.amax, plan=job.plan, progress=progress,
    )  # fmt: skip
    with atomic_output(job.out_dir, overwrite=overwrite, source=job.ref) as tmp:
        return _write_dir(
            tmp, job.ckpt, job.spec, slots, stream, job.plan, job.provenance, max_shard_bytes
        )


def _finish(job: _ExportJob, files: list[str], start: float, log, standins) -> ExportResult:
    """Logs the notes as warnings, each stand-in's added error, and says what was written."""
    out_dir, plan, inputs = job.out_dir, job.plan, job.inputs
    total = sum((out_dir / f).stat().st_size for f in files if f.endswith(".safetensors"))
    for note in job.notes:
        log("warning: " + note)
    for path, error in standins.items():
        log(f"note: {path} (trained MXFP8) is stored as FP8 per tensor, the nearest format the "
            f"ModelOpt readers load: added weight error max |FP8 - MXFP8| / max |MXFP8| = "
            f"{error:.3g} (--layout compressed-tensors stores it as trained)")  # fmt: skip
    return ExportResult(
        out_dir, job.ckpt.ref.step, plan, inputs.source if plan.w4a4 else None, job.targets,
        tuple(files), total, time.perf_counter() - start, job.notes,
        inputs.calibration if plan.w4a4 else None, dict(standins),
    )  # fmt: skip
