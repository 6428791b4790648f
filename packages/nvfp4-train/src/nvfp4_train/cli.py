"""The `nvfp4-train` command line.

    nvfp4-train run CONFIG.yaml [key=value ...]          train (or resume) a run
    nvfp4-train show-config CONFIG.yaml [key=value ...]  print the fully resolved config and
        [--memory] [--devices N]                         its precision schedule (and what
                                                         one device holds, what FSDP gathers)
    nvfp4-train prepare-data INPUT ... --tokenizer T -o DIR  tokenize parquet/JSONL/text
                                                         into token shards (resumable)
    nvfp4-train eval RUN_DIR                             validation loss of the newest checkpoint
    nvfp4-train eval RUN_DIR --tasks FILE ... [--bf16]   downstream tasks (multiple choice,
        [-o results.json] [--batch-size N]               rolling log-likelihood) with the
                                                         newest checkpoint (docs/eval.md)
    nvfp4-train plot RUN_DIR [RUN_DIR ...] [-o out.png]  loss curves of runs on one PNG
                                                         (default: RUN_DIR/loss.png)
    nvfp4-train plot --quant RUN_DIR [-o quant.png] [--stat rel_error]
                                                         quantization telemetry heat maps
                                                         (default: RUN_DIR/quant.png)
    nvfp4-train plot --experts RUN_DIR [-o experts.png]  expert load of an MoE run over steps
                                                         (default: RUN_DIR/experts.png)

A user mistake (one of the project's user-error types, `USER_ERRORS`: bad config, bad data,
wrong run directory; or an `OSError` naming a file) prints one `error:` line and exits 2; a run
that cannot go on (`RunError`) prints one and exits 1 (see `nvfp4_train.errors`). Any other
exception is a bug and keeps its traceback. Set NVFP4_TRAIN_DEBUG=1 to see the traceback of the
one-line errors too.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from nvfp4_train.config.loader import to_yaml
from nvfp4_train.config.run_config import load_config
from nvfp4_train.errors import ConfigError, DataError, RunError
from nvfp4_train.model.hf.config import HFConfigError
from nvfp4_train.prepare_cli import add_parser as add_prepare_parser

EXIT_USAGE = 2
EXIT_FAILED = 1
DEBUG_ENV = "NVFP4_TRAIN_DEBUG"
USER_ERRORS = (ConfigError, DataError, HFConfigError)
"""The project's user-mistake types: one `error:` line and exit 2 (as is an `OSError`)."""

_OVERRIDES_HELP = "dotted overrides, e.g. train.steps=50 model.num_layers=4 precision.recipe=bf16"


def _parser() -> argparse.ArgumentParser:
    """The `nvfp4-train` parser: one subcommand per task, in the order `--help` lists them."""
    parser = argparse.ArgumentParser(
        prog="nvfp4-train",
        description="Pretrain Llama-style models in JAX with the NVFP4 precision policy.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run_parser(sub)
    _add_show_config_parser(sub)
    add_prepare_parser(sub)
    _add_eval_parser(sub)
    _add_plot_parser(sub)
    return parser


def _add_run_parser(sub: argparse._SubParsersAction) -> None:
    """`nvfp4-train run CONFIG [key=value ...]`."""
    run = sub.add_parser("run", help="train a run (resumes if output_dir has a checkpoint)")
    run.add_argument("config", type=Path, help="the YAML config file")
    run.add_argument("overrides", nargs="*", metavar="key=value", help=_OVERRIDES_HELP)


def _add_show_config_parser(sub: argparse._SubParsersAction) -> None:
    """`nvfp4-train show-config CONFIG [key=value ...] [--memory] [--devices N]`."""
    show = sub.add_parser(
        "show-config",
        help="print the fully resolved config as YAML, then its precision schedule (the preset "
        "of each linear and GEMM per phase) as YAML comments",
    )
    show.add_argument("config", type=Path, help="the YAML config file")
    show.add_argument("overrides", nargs="*", metavar="key=value", help=_OVERRIDES_HELP)
    show.add_argument(
        "--memory", action="store_true",
        help="also print what one device holds (parameters, optimizer state, gradients, "
        "estimated activations) as YAML comments",
    )  # fmt: skip
    show.add_argument(
        "--devices", type=int, default=None, metavar="N",
        help="devices of the run for --memory (default: the devices here)",
    )  # fmt: skip


def _add_eval_parser(sub: argparse._SubParsersAction) -> None:
    """`nvfp4-train eval RUN_DIR`: validation loss, or downstream tasks with --tasks."""
    evaluate = sub.add_parser("eval", help="evaluate a run's newest checkpoint on validation data")
    evaluate.add_argument("run_dir", type=Path, help="a run directory (a run's output_dir)")
    evaluate.add_argument(
        "--forward", choices=("run", "quantized", "bf16"), default="run",
        help="run: the forward the run trained with at that step (default); quantized: the "
        "recipes' quantized forward; bf16: the quantized linears' forward GEMMs in BF16",
    )  # fmt: skip
    evaluate.add_argument("--bf16", action="store_true", help="the same as --forward bf16")
    evaluate.add_argument(
        "--tasks", nargs="+", type=Path, default=None, metavar="FILE",
        help="score these task files (JSONL, lm-evaluation-harness YAML, BIG-bench task.json, "
        "text) instead of the validation loss (docs/eval.md)",
    )  # fmt: skip
    evaluate.add_argument(
        "-o", "--output", type=Path, default=None,
        help="with --tasks: write the results as JSON here (an existing file is not overwritten)",
    )  # fmt: skip
    evaluate.add_argument(
        "--batch-size", type=int, default=None, help="with --tasks: rows per scoring batch (8)"
    )


def _add_plot_parser(sub: argparse._SubParsersAction) -> None:
    """`nvfp4-train plot RUN_DIR ...`: loss curves, or one run's --quant or --experts plots."""
    plot = sub.add_parser(
        "plot",
        help="draw the loss curves of runs on one PNG, or (--quant) a run's telemetry, or "
        "(--experts) an MoE run's expert load",
    )
    plot.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR")
    plot.add_argument(
        "-o", "--output", type=Path, default=None,
        help="the figure (any format matplotlib writes: .png, .pdf, .svg, ...; default: loss.png, "
        "quant.png or experts.png, in the first RUN_DIR); an existing file is not overwritten "
        "unless this command wrote it",
    )  # fmt: skip
    plot.add_argument(
        "--smoothing", type=float, default=0.6, help="EMA weight of the train loss, in [0, 1)"
    )
    kind = plot.add_mutually_exclusive_group()
    kind.add_argument(
        "--quant", action="store_true",
        help="heat maps (linear x step, one panel per GEMM operand) of ONE run's quantization "
        "telemetry (logging.quant_stats_every > 0)",
    )  # fmt: skip
    kind.add_argument(
        "--experts", action="store_true",
        help="ONE Mixture-of-Experts run's expert load: each expert's share of the assignments "
        "per block and step, max/mean load and dropped fraction",
    )  # fmt: skip
    plot.add_argument(
        "--stat", default="rel_error",
        help="the statistic --quant draws: amax, underflow, saturation or rel_error",
    )  # fmt: skip


def _run(args: argparse.Namespace) -> int:
    from nvfp4_train.mesh.distributed import initialize_from
    from nvfp4_train.training.determinism import apply_to_environment
    from nvfp4_train.training.run import run

    cfg = load_config(args.config, args.overrides)
    line = apply_to_environment(cfg, os.environ)  # XLA_FLAGS: before JAX starts its backend
    if line:
        print(line, flush=True)
    initialize_from(cfg.distributed, os.environ)  # before JAX touches a device
    run(cfg)
    return 0


def _show_config(args: argparse.Namespace) -> int:
    from nvfp4_train.model.config import linear_paths
    from nvfp4_train.precision.policy import precision_phases
    from nvfp4_train.precision.schedule import format_schedule

    cfg = load_config(args.config, args.overrides)
    phases = precision_phases(cfg.model, cfg.precision, cfg.train.steps)
    sys.stdout.write(to_yaml(cfg))
    sys.stdout.write(format_schedule(phases, linear_paths(cfg.model)))
    if args.memory or args.devices is not None:
        import jax

        from nvfp4_train.training.comms import format_gathers
        from nvfp4_train.training.memory import (
            estimate_memory,
            format_attention_choices,
            format_estimate,
        )

        devices = args.devices if args.devices is not None else jax.device_count()
        if devices < 1:
            raise ConfigError(f"--devices must be >= 1, got {devices}")
        estimate = estimate_memory(cfg, devices)
        sys.stdout.write(format_estimate(estimate))
        sys.stdout.write(format_attention_choices(estimate, cfg))
        sys.stdout.write(format_gathers(cfg, devices))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from nvfp4_train.training.downstream import evaluate_run_tasks
    from nvfp4_train.training.evaluation import evaluate_run

    if args.bf16 and args.forward not in ("run", "bf16"):
        raise ConfigError(f"--bf16 contradicts --forward {args.forward}")
    forward = "bf16" if args.bf16 else args.forward
    if args.tasks is None:
        if args.output is not None or args.batch_size is not None:
            flag = "-o/--output" if args.output is not None else "--batch-size"
            raise ConfigError(f"{flag} needs --tasks (the validation loss goes to metrics.jsonl)")
        evaluate_run(args.run_dir, forward=forward)
        return 0
    evaluate_run_tasks(
        args.run_dir,
        args.tasks,
        forward=forward,
        batch_size=8 if args.batch_size is None else args.batch_size,
        output=args.output,
    )
    return 0


def _plot(args: argparse.Namespace) -> int:
    from nvfp4_train.observe.output_files import check_figure_output
    from nvfp4_train.observe.plot import plot_quant, plot_runs
    from nvfp4_train.observe.plot_experts import plot_experts

    flag = "--quant" if args.quant else "--experts" if args.experts else None
    if flag and len(args.run_dirs) != 1:
        names = " ".join(str(d) for d in args.run_dirs)
        raise ConfigError(f"plot {flag} takes one RUN_DIR, got {len(args.run_dirs)}: {names}")
    name = {"--quant": "quant.png", "--experts": "experts.png"}.get(flag, "loss.png")
    if args.output is not None:  # before anything is read or drawn
        check_figure_output(args.output)
    output = args.output or args.run_dirs[0] / name
    if args.quant:
        path = plot_quant(args.run_dirs[0], output, stat=args.stat)
    elif args.experts:
        path = plot_experts(args.run_dirs[0], output)
    else:
        path = plot_runs(args.run_dirs, output, smoothing=args.smoothing)
    print(f"wrote {path}")
    return 0


def _prepare_data(args: argparse.Namespace) -> int:
    from nvfp4_train.prepare_cli import run_prepare

    return run_prepare(args)


_COMMANDS = {
    "run": _run,
    "show-config": _show_config,
    "prepare-data": _prepare_data,
    "eval": _eval,
    "plot": _plot,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (0 ok, 1 run failed, 2 user error).

    Example:
        >>> main(["show-config", "examples/configs/tiny.yaml", "train.steps=10"])  # doctest: +SKIP
    """
    args = _parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except RunError as e:
        if os.environ.get(DEBUG_ENV):
            raise
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except (*USER_ERRORS, OSError) as e:
        if os.environ.get(DEBUG_ENV):
            raise
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(
            "interrupted; rerun the same command to resume (a run from its last checkpoint, "
            "prepare-data from its last shard)",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
