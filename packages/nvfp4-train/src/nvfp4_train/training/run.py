"""A run: `run(cfg)` trains (or resumes) one.

A run directory holds `config.yaml` (the resolved config), `metrics.jsonl`, `tokenizer/`,
`checkpoints/<step>/` (orbax, see docs/checkpoint-schema.md) and `tensorboard/`. Calling `run`
again with the same `output_dir` resumes from the newest readable checkpoint (see
`training.resume`); SIGTERM/SIGINT stop it after the current step with a checkpoint
(`training.stop`). Before the first step the run checks what it can trust on this machine
(`training.trusted`). The state lives on the `mesh:` device mesh (`mesh.sharding`), across
processes when the CLI joined a multi-process run (`mesh.distributed`). The steps themselves run
in `training.loop.TrainingLoop`; `training.evaluation.evaluate_run` evaluates a run directory.

Example:
    >>> summary = run(config_from_dict({"output_dir": "runs/x", "train": {"steps": 10}}))  # doctest: +SKIP
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TextIO

import jax

from nvfp4_train.checkpoint.run_dir import CONFIG_FILE, METRICS_FILE, TOKENIZER_DIR, run_directory
from nvfp4_train.config.loader import to_yaml
from nvfp4_train.config.run_config import Config
from nvfp4_train.mesh.sharding import (
    attention_heads_note,
    bytes_per_device,
    check_expert_split,
    check_tensor_split,
    make_mesh,
)
from nvfp4_train.model.structure import moe_blocks_note
from nvfp4_train.training.comms import check_gather_tiles
from nvfp4_train.training.device_memory import check_memory_fits
from nvfp4_train.training.downstream import load_tasks
from nvfp4_train.training.loop import RunSummary, TrainingLoop
from nvfp4_train.training.resume import resume_or_init
from nvfp4_train.training.session import exclusive, run_checkpoints, sayer, with_data
from nvfp4_train.training.step import count_params
from nvfp4_train.training.stop import stop_requests
from nvfp4_train.training.trusted import run_context, with_document_bound, with_trusted_backend


def _memory_line(mesh: Any, state: Any) -> str:
    mib = 1 / 2**20
    shape = ", ".join(f"{k}={v}" for k, v in mesh.shape.items())
    return (
        f"mesh: {shape} over {mesh.size} devices ({jax.process_count()} processes); per device: "
        f"parameters {bytes_per_device(state.params) * mib:.2f} MiB, optimizer state "
        f"{bytes_per_device(state.opt_state) * mib:.2f} MiB"
    )


def _model_line(cfg: Config, state: Any) -> str:
    """The start-up line that says what is trained (and which blocks are MoE, if any)."""
    moe = moe_blocks_note(cfg.model)
    return (
        f"model: {count_params(state.params):,} parameters, {cfg.model.num_layers} layers, "
        f"vocab {cfg.model.vocab_size}{'; ' + moe if moe else ''}; "
        f"precision.recipe={cfg.precision.recipe}"
    )


def run(cfg: Config, *, stream: TextIO | None = None) -> RunSummary:
    """Trains `cfg` for `train.steps` steps in `cfg.output_dir`, resuming from its checkpoints.

    Args:
        cfg: the resolved config.
        stream: where progress and messages go (default: stdout).

    Returns:
        A `RunSummary` of the run.

    Raises:
        ConfigError: the config does not fit the data or the checkpoint in `output_dir`, or
            its memory estimate does not fit a device (`training.device_memory`).
        TaskError: a file of `eval.tasks` that cannot be read (before anything is written).
    """
    stream = sys.stdout if stream is None else stream
    cfg, datasets = with_data(cfg)  # data, task and mesh errors before anything is written
    tasks = load_tasks(cfg.eval.tasks)
    mesh = make_mesh(cfg.mesh, jax.devices())
    check_expert_split(cfg.model.moe.num_experts, mesh.shape["expert"])
    check_tensor_split(cfg.model, mesh.shape["tensor"])
    check_gather_tiles(cfg, mesh.size)
    check_memory_fits(cfg, jax.devices(), jax.local_device_count())  # before compiling, writing
    with run_directory(Path(cfg.output_dir)) as run_dir, exclusive(run_dir):
        return _run(cfg, datasets, tasks, mesh, run_dir, stream)


def _run(
    cfg: Config, datasets: Any, tasks: list, mesh: Any, run_dir: Path, stream: TextIO
) -> RunSummary:
    """`run` inside the run directory's lock."""
    say = sayer(stream)
    iterator = datasets.train_iterator()
    written = cfg  # config.yaml keeps precision.backend and the document bound as configured
    say(f"run directory: {run_dir.resolve()}")
    cfg = with_document_bound(cfg, datasets, say)
    cfg = with_trusted_backend(cfg, say, mesh)
    note = attention_heads_note(dict(mesh.shape), cfg.model.num_heads, cfg.model.num_kv_heads)
    if note:
        say(note)
    for line in (w for task in tasks for w in task.warnings()):
        say(line)
    with run_context(cfg, mesh), run_checkpoints(cfg, run_dir) as ckpts:
        graphdef, state, start = resume_or_init(
            cfg, run_dir, ckpts, iterator, run_dir / METRICS_FILE, say, mesh
        )
        if jax.process_index() == 0:
            (run_dir / CONFIG_FILE).write_text(to_yaml(written))
            datasets.tokenizer.save(run_dir / TOKENIZER_DIR)
        say(_model_line(cfg, state))
        say(_memory_line(mesh, state))
        say(datasets.documents)
        if start >= cfg.train.steps:
            say(f"already trained to step {start} (train.steps={cfg.train.steps}); nothing to do")
            return RunSummary(run_dir, start, start, None, None)
        loop = TrainingLoop(cfg, graphdef, datasets, ckpts, say, mesh, state, tasks=tasks)
        with stop_requests() as stop:
            return loop.train(state, iterator, run_dir, start, stream, stop)


__all__ = ["RunSummary", "run"]
