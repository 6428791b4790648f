"""`export_onnx`: a training checkpoint -> one .onnx file (see `onnx_graph` for the graph)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from nvfp4_export.checkpoint import read_checkpoint, resolve_checkpoint
from nvfp4_export.errors import ExportError
from nvfp4_export.hf_files import dense_tensors
from nvfp4_export.linears import export_linear
from nvfp4_export.model_spec import spec_from_config
from nvfp4_export.onnx_graph import FORMS, build_onnx, save_onnx
from nvfp4_export.output_dir import atomic_file, check_file_target
from nvfp4_export.policy import linear_recipes


def export_onnx(
    checkpoint: str | Path,
    out_path: str | Path,
    *,
    form: str = "portable",
    step: int | None = None,
    overwrite: bool = False,
    integrity_check: bool = True,
    log: Callable[[str], None] = lambda _: None,
) -> Path:
    """Writes the checkpoint's decoder as ONNX with packed FP4 weights.

    Args:
        checkpoint: a run directory, its checkpoints/ directory or one step directory.
        out_path: the .onnx file to create (written beside it first, renamed at the end).
        form: "portable" (opset 18, onnxruntime CPU) or "dq" (opset 23 DequantizeLinear FLOAT4E2M1).
        step: the checkpoint step (default: the newest).
        overwrite: replace an existing file.
        integrity_check: compare the checkpoint with its `integrity` item, which must exist
            (False: use it as found, with a warning).
        log: receives warnings (what of the checkpoint could not be checked).

    Raises:
        ExportError: bad checkpoint, form or output path; onnx not installed.
    """
    if form not in FORMS:
        raise ExportError(f"--form must be one of {sorted(FORMS)}, got {form!r}")
    try:
        import onnx  # noqa: F401
    except ImportError as err:
        raise ExportError(
            "ONNX export needs the 'onnx' package: pip install 'nvfp4-export[onnx]'"
        ) from err
    ref = resolve_checkpoint(checkpoint, step)
    out_path = check_file_target(Path(out_path), overwrite, source=ref)  # fail before the work
    ckpt = read_checkpoint(ref, integrity_check=integrity_check)
    for note in ckpt.notes:
        log("warning: " + note)
    spec = spec_from_config(ckpt.config, ckpt.params)
    if spec.hybrid:
        raise ExportError(
            "ONNX export of hybrid Mamba-2 models (nemotron_h) is not implemented; export it "
            "with `nvfp4-export hf` (ModelOpt, compressed-tensors or bf16)"
        )
    if spec.num_experts:
        raise ExportError(
            f"ONNX export of Mixture-of-Experts models ({spec.architecture}) is not implemented; "
            "export it with `nvfp4-export hf` (ModelOpt or compressed-tensors)"
        )
    recipes = linear_recipes(spec, ckpt.config, ckpt.quant_stats)
    linears = []
    for path in spec.linear_paths():
        linears += export_linear(spec, path, ckpt.params[f"{path}.kernel"], recipes[path], None)
    model = build_onnx(spec, linears, dense_tensors(spec, ckpt.params), form)
    with atomic_file(out_path, overwrite=overwrite, source=ref) as tmp:
        save_onnx(model, tmp)
    return out_path
