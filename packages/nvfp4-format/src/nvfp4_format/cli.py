"""The ``nvfp4-format`` command: ``nvfp4-format inspect PATH [PATH ...] [--json]``.

Each PATH is a ``.safetensors`` file or a checkpoint directory (all shards named by its
``model.safetensors.index.json``, else every ``model*.safetensors`` in it, inspected as one
checkpoint). Exit status: 0 inspected, no problems; 1 inspected, consistency problems found
(listed in the output); 2 bad input (a one-line error on stderr).

Example:
    $ nvfp4-format inspect exported/ --json | python -m json.tool
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Sequence

from nvfp4_format.checkpoint_report import CheckpointReport, inspect_checkpoint

__all__ = ["main", "render_json", "render_text"]

EXIT_OK, EXIT_PROBLEMS, EXIT_BAD_INPUT = 0, 1, 2
JSON_FORMAT_VERSION = 1


def _finite_or_none(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_none(v) for v in value]
    return value


def render_json(reports: Sequence[CheckpointReport]) -> str:
    """One JSON document for all inspected checkpoints (keys: see the package README)."""
    document = {
        "format_version": JSON_FORMAT_VERSION,
        "checkpoints": [dataclasses.asdict(r) for r in reports],
    }
    return json.dumps(_finite_or_none(document), indent=2, allow_nan=False)


def _si_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _num(x: float | None, fmt: str = ".3g") -> str:
    return "-" if x is None else format(x, fmt)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        padded = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(padded).rstrip()

    return [line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]


def _quantized_rows(report: CheckpointReport) -> list[list[str]]:
    rows = []
    for q in report.quantized:
        scales = q.block_scales
        scale_range = "-" if scales is None else f"{_num(scales.min_nonzero)}..{_num(scales.max)}"
        rows.append(
            [
                q.module,
                q.layout,
                "x".join(str(d) for d in q.shape),
                f"{q.bits_per_element:.3f}",
                scale_range,
                "-" if scales is None else f"{scales.zero_fraction:.1%}",
                _num(q.global_decode_scale),
                f"{q.codes.zero_fraction:.1%}",
                f"{q.codes.saturated_fraction:.1%}",
                _si_bytes(q.storage_bytes),
                f"{q.storage_bytes / q.bf16_bytes:.1%}" if q.bf16_bytes else "-",
            ]
        )
    return rows


_QUANTIZED_HEADERS = (
    "module",
    "layout",
    "shape",
    "bits/el",
    "block scales min>0..max",
    "zero scales",
    "global dec",
    "zero codes",
    "sat codes",
    "bytes",
    "vs BF16",
)


def _summary_lines(report: CheckpointReport) -> list[str]:
    t = report.totals
    declared = ", ".join(report.declared_layouts) or "none"
    sources = f" (from {', '.join(report.declared_sources)})" if report.declared_sources else ""
    share = t.quantized_params / t.total_params if t.total_params else 0.0
    return [
        f"files: {len(report.files)}, {_si_bytes(t.file_bytes)} on disk",
        f"declared layout: {declared}{sources}",
        f"found layout: {', '.join(report.found_layouts) or 'none'}",
        f"quantized params: {t.quantized_params} of {t.total_params} ({share:.1%})",
        f"tensor bytes: {t.tensor_bytes} vs all-BF16 {t.bf16_bytes} "
        f"(ratio {_num(t.size_ratio_vs_bf16, '.4f')})",
    ]


def render_text(report: CheckpointReport) -> str:
    """An aligned plain-text report of one checkpoint."""
    lines = [f"== {report.path}"] + _summary_lines(report)
    if report.quantized:
        lines += ["", "quantized tensors:"]
        lines += _table(_QUANTIZED_HEADERS, _quantized_rows(report), right=set(range(3, 11)))
    if report.unquantized:
        rows = [
            [u.name, u.dtype, "x".join(map(str, u.shape)) or "scalar", _si_bytes(u.nbytes)]
            for u in report.unquantized
        ]
        lines += ["", "unquantized tensors:"]
        lines += _table(("name", "dtype", "shape", "bytes"), rows, right={3})
    problems = [f"{q.module}: {p}" for q in report.quantized for p in q.problems]
    lines += [""] + [f"PROBLEM: {p}" for p in problems] + [f"WARNING: {w}" for w in report.warnings]
    return "\n".join(lines).rstrip() + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nvfp4-format", description="Tools for NVFP4 / MXFP4 checkpoints."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser(
        "inspect",
        help="report the FP4-quantized tensors of safetensors checkpoints",
        description="Detect NVFP4 (ModelOpt, compressed-tensors) and MXFP4 tensors and "
        "report shapes, bits per element, scale ranges, zero/saturated codes and size vs BF16. "
        "Exit 0: ok, 1: consistency problems found, 2: bad input.",
    )
    inspect.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="a .safetensors file or a checkpoint directory (all its shards)",
    )
    inspect.add_argument("--json", action="store_true", help="print one JSON document")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        reports = [inspect_checkpoint(p) for p in args.paths]
    except (ValueError, OSError) as e:
        print(f"nvfp4-format: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    text = render_json(reports) + "\n" if args.json else "\n".join(map(render_text, reports))
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. `| head`: stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    has_problems = any(q.problems for r in reports for q in r.quantized)
    return EXIT_PROBLEMS if has_problems else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
