"""`nvfp4-export`: hf, onnx and verify subcommands (the only place that prints or exits)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence

from nvfp4_export.errors import ExportError
from nvfp4_export.formats import BF16_LAYOUT
from nvfp4_export.hf_export import DEFAULT_MAX_SHARD_BYTES, ExportProgress, export_hf
from nvfp4_export.layouts import LAYOUTS
from nvfp4_export.onnx_graph import FORMS
from nvfp4_export.servers import SERVERS

NO_CHECK_HELP = (
    "use a checkpoint without its integrity check (one without an 'integrity' item, or one "
    "whose config was edited on purpose); warns that nothing was checked"
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nvfp4-export", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    hf = sub.add_parser(
        "hf", help="a Hugging Face model directory (ModelOpt, compressed-tensors or plain BF16)"
    )
    hf.add_argument("checkpoint", help="run directory, its checkpoints/ or one checkpoints/<step>/")
    hf.add_argument("out_dir")
    hf.add_argument("--layout", required=True, choices=LAYOUTS)
    hf.add_argument("--weight-only", action="store_true",
                    help="no input scales (W4A16; not for --layout bf16)")  # fmt: skip
    hf.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    hf.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR")
    hf.add_argument(
        "--calibrate",
        type=int,
        default=None,
        metavar="N",
        help="input scales from N >= 1 sequences",
    )
    hf.add_argument("--calibration-text", default=None, help="text file for --calibrate sequences")
    hf.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES)
    hf.add_argument("--server", action="append", choices=SERVERS, dest="servers", default=None,
                    help="a server the export is for (repeat for several; default: every server "
                    "that loads the layout and mode)")  # fmt: skip
    hf.add_argument("--allow-dropped-tensors", action="store_true",
                    help="export even if a server would drop a trained tensor (warns)")  # fmt: skip
    hf.add_argument("--no-integrity-check", action="store_true", help=NO_CHECK_HELP)
    hf.add_argument("--allow-uncalibrated-experts", action="store_true",
                    help="an MoE block whose experts have no input amax for a projection takes "
                    "the model's largest amax of that projection (warns) instead of refusing")  # fmt: skip
    hf.add_argument("--no-progress", action="store_true",
                    help="no progress bar (there is none when stderr is not a terminal)")  # fmt: skip
    ox = sub.add_parser("onnx", help="an ONNX decoder with packed FP4 weights")
    ox.add_argument("checkpoint")
    ox.add_argument("out_file")
    ox.add_argument("--form", choices=tuple(FORMS), default="portable",
                    help="portable: opset 18, runs on onnxruntime CPU; dq: opset 23 DequantizeLinear(FLOAT4E2M1)")  # fmt: skip
    ox.add_argument("--step", type=int, default=None)
    ox.add_argument("--overwrite", action="store_true")
    ox.add_argument("--no-integrity-check", action="store_true", help=NO_CHECK_HELP)
    vf = sub.add_parser("verify", help="check an export and compare its logits with the run")
    vf.add_argument("export", help="an export directory or .onnx file")
    vf.add_argument("--against", default=None, help="the run (or checkpoint) it was exported from")
    vf.add_argument(
        "--sequences", type=int, default=4, help="sequences compared without a reference item"
    )
    vf.add_argument("--no-integrity-check", action="store_true", help=NO_CHECK_HELP)
    return p


@contextlib.contextmanager
def _progress_bar(enabled: bool) -> Iterator[Callable[[ExportProgress], None]]:
    """A rich progress bar on stderr (tensors, checkpoint bytes, ETA), or a no-op callback."""
    if not enabled:
        yield lambda _: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,  # fmt: skip
        TransferSpeedColumn,
    )

    columns = (TextColumn("exporting"), BarColumn(), TextColumn("{task.description} tensors"),
               DownloadColumn(), TransferSpeedColumn(), TextColumn("ETA"), TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("0/?", total=None)

        def update(p: ExportProgress) -> None:
            bar.update(task, completed=p.bytes_done, total=p.bytes_total,
                       description=f"{p.tensors_done}/{p.tensors_total}")  # fmt: skip

        yield update


def _hf(args: argparse.Namespace) -> int:
    show = not args.no_progress and sys.stderr.isatty()
    with _progress_bar(show) as progress:
        result = export_hf(
            args.checkpoint, args.out_dir, layout=args.layout, weight_only=args.weight_only,
            step=args.step, overwrite=args.overwrite, calibrate_n=args.calibrate,
            calibration_text=args.calibration_text, max_shard_bytes=args.max_shard_bytes,
            servers=args.servers, allow_dropped_tensors=args.allow_dropped_tensors,
            integrity_check=not args.no_integrity_check,
            allow_uncalibrated_experts=args.allow_uncalibrated_experts,
            log=lambda m: print(m, file=sys.stderr), progress=progress,
        )  # fmt: skip
    plan = result.plan
    mode = "W4A4" if plan.w4a4 else "weight-only" if plan.layout != BF16_LAYOUT else "unquantized"
    if result.calibration:
        mode += f", input scales from {result.calibration['sequences']} calibration sequences"
    print(
        f"wrote {result.out_dir} ({plan.layout}, {plan.fmt}, {mode}; step {result.step}; "
        f"{result.total_bytes / 1e6:.2f} MB of weights; {len(plan.excluded)} modules kept in BF16; "
        f"for {', '.join(result.servers)}; {result.seconds:.1f} s)"
    )
    return 0


def _onnx(args: argparse.Namespace) -> int:
    from nvfp4_export.onnx_export import export_onnx

    path = export_onnx(
        args.checkpoint, args.out_file, form=args.form, step=args.step, overwrite=args.overwrite,
        integrity_check=not args.no_integrity_check, log=lambda m: print(m, file=sys.stderr),
    )  # fmt: skip
    print(f"wrote {path} ({args.form})")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from nvfp4_export.verify import render, verify

    report = verify(
        args.export, against=args.against, sequences=args.sequences,
        integrity_check=not args.no_integrity_check,
    )  # fmt: skip
    print(render(report))
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (0 ok, 1 verification failed, 2 bad input)."""
    args = _parser().parse_args(argv)
    try:
        return {"hf": _hf, "onnx": _onnx, "verify": _verify}[args.command](args)
    except ExportError as err:
        print(f"nvfp4-export: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
