"""A run: `run(cfg)` trains (or resumes) one; `evaluate_run(run_dir)` evaluates it.

A run directory holds `config.yaml` (the resolved config), `metrics.jsonl`, `tokenizer/`,
`checkpoints/<step>/` (orbax, see docs/checkpoint-schema.md) and `tensorboard/`. Calling `run` again
with the same `output_dir` resumes from the newest readable checkpoint (see `nvfp4_train.training.resume`);
SIGTERM/SIGINT stop it after the current step with a checkpoint (`nvfp4_train.training.stop`). The state
lives on the `mesh:` device mesh (`nvfp4_train.mesh.sharding`), across processes when the CLI joined a
multi-process run (`nvfp4_train.mesh.distributed`). The steps themselves run in
`nvfp4_train.training.loop.TrainingLoop`.

Example:
    >>> summary = run(config_from_dict({"output_dir": "runs/x", "train": {"steps": 10}}))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import jax

from nvfp4_ops import get_recipe
from nvfp4_train.checkpoint.checkpoints import Checkpoints
from nvfp4_train.checkpoint.run_dir import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    METRICS_FILE,
    TOKENIZER_DIR,
    make_run_dir,
    run_lock,
)
from nvfp4_train.config.loader import to_yaml
from nvfp4_train.config.run_config import Config, config_from_dict, read_config_file, upgraded
from nvfp4_train.data import make_datasets
from nvfp4_train.errors import ConfigError, RunError
from nvfp4_train.mesh.sharding import bytes_per_device, make_mesh
from nvfp4_train.model.attention import attention_capability, run_attention, unfused_attention
from nvfp4_train.observe.metrics import MetricsFile, format_row
from nvfp4_train.precision import attention_check
from nvfp4_train.precision.backend_check import backend_line, te_context, trusted_backend
from nvfp4_train.precision.policy import (
    export_recipe_names,
    layer_recipes,
    precision_phases,
    run_layout,
)
from nvfp4_train.precision.schedule import phase_index
from nvfp4_train.training.loop import RunSummary, TrainingLoop
from nvfp4_train.training.resume import abstract_state, restore_newest_readable, resume_or_init
from nvfp4_train.training.step import (
    count_params,
    make_eval_step,
    model_graphdef,
    model_spec,
    with_vocab_size,
)
from nvfp4_train.training.stop import stop_requests
from nvfp4_train.training.validation import eval_batches, evaluate


def _datasets(cfg: Config) -> Any:
    """The data in global order: every process iterates the same global batches and places only
    the rows its devices hold (`global_batch`), so a run's numerics do not depend on how many
    processes share it."""
    return make_datasets(
        cfg.data, seq_len=cfg.train.seq_len, batch_size=cfg.train.batch_size, seed=cfg.train.seed
    )


def _with_data(cfg: Config) -> tuple[Config, Any]:
    """(cfg with `model.vocab_size` filled from the data, the data): the prologue of training
    and of evaluation."""
    datasets = _datasets(cfg)
    return with_vocab_size(cfg, datasets.vocab_size), datasets


def _memory_line(mesh: Any, state: Any) -> str:
    mib = 1 / 2**20
    shape = ", ".join(f"{k}={v}" for k, v in mesh.shape.items())
    return (
        f"mesh: {shape} over {mesh.size} devices ({jax.process_count()} processes); per device: "
        f"parameters {bytes_per_device(state.params) * mib:.2f} MiB, optimizer state "
        f"{bytes_per_device(state.opt_state) * mib:.2f} MiB"
    )


def _sayer(stream: TextIO) -> Callable[[str], None]:
    def say(text: str) -> None:
        print(text, file=stream, flush=True)

    return say


def _checkpoints(cfg: Config, run_dir: Path) -> Checkpoints:
    return Checkpoints(
        run_dir / CHECKPOINT_DIR,
        keep=cfg.checkpoint.keep,
        keep_period=cfg.checkpoint.keep_period,
        async_save=cfg.checkpoint.async_save,
        layout=run_layout(cfg),
    )


def attention_text(cfg: Config, platform: str) -> str:
    """`model.attention=<configured> -> <what runs at train.seq_len here>`.

    Raises:
        ConfigError: the configured implementation cannot run on `platform` (one line).
    """
    model = cfg.model
    chosen = _chosen_attention(cfg, platform)
    block = f" (attention_block={model.attention_block})" if chosen == "chunked" else ""
    return f"model.attention={model.attention} -> {chosen}{block}"


def _chosen_attention(cfg: Config, platform: str) -> str:
    """The implementation `model.attention` stands for at `train.seq_len` on `platform`.

    Raises:
        ConfigError: it cannot run there (one line).
    """
    model = cfg.model
    chosen = run_attention(cfg, platform)
    ok, why = attention_capability(chosen, platform=platform, dtype=model.compute_dtype,
                                   head_dim=model.resolved_head_dim)  # fmt: skip
    if not ok:
        raise ConfigError(f"model.attention={model.attention!r} is not available here: {why}")
    return chosen


def _with_trusted_attention(cfg: Config, platform: str, say: Callable[[str], None]) -> Config:
    """`cfg`, or with `model.attention` replaced by what "auto" picks without fused kernels if
    the chosen kernel (`attention_check.CHECKED`) disagrees with "naive" here or crashes while
    checked (`precision.verify_backend`: "warn" continues, "strict" stops, "off" skips).

    Raises:
        RunError: under "strict", the kernel failed its check.
    """
    chosen, mode = _chosen_attention(cfg, platform), cfg.precision.verify_backend
    if chosen not in attention_check.CHECKED or mode == "off":
        return cfg
    m = cfg.model
    report = attention_check.verify_attention(
        chosen, dtype=m.compute_dtype, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
        head_dim=m.resolved_head_dim, max_documents=m.attention_max_documents,
    )  # fmt: skip
    say(f"attention check: {chosen} {report.summary()}")
    if report.ok:
        return cfg
    if mode == "strict":
        raise RunError(
            f"attention {chosen!r} failed its check against naive attention on this machine "
            f"({report.summary()}); precision.verify_backend=strict stops here"
        )
    fallback = unfused_attention(cfg.train.seq_len)
    say(f"WARNING: attention {chosen!r} is NOT used (it failed its check); this run uses "
        f"{fallback!r} (set model.attention to choose another)")  # fmt: skip
    return dataclasses.replace(cfg, model=dataclasses.replace(m, attention=fallback))


def _with_trusted_backend(cfg: Config, say: Callable[[str], None]) -> Config:
    """`cfg` with the backends that disagree with "emulated" here, or crash while checked, left
    out (`backend_check`); the `ops backend:` line (after the check) names them and why, and
    the attention implementation."""
    cfg = _with_trusted_attention(cfg, jax.default_backend(), say)
    attention = attention_text(cfg, jax.default_backend())
    phases = precision_phases(cfg.model, cfg.precision, cfg.train.steps)
    names = {n for phase in phases for gemms in phase.names.values() for n in gemms}
    choice = trusted_backend(cfg.precision, names, say)
    if any(get_recipe(n).quantized for n in names):
        say(f"{backend_line(cfg.precision.backend, choice.dropped)}; {attention}")
    else:
        say(f"ops backend: {attention}")
    if choice.backend == cfg.precision.backend:
        return cfg
    precision = dataclasses.replace(cfg.precision, backend=choice.backend)
    return dataclasses.replace(cfg, precision=precision)


def run(cfg: Config, *, stream: TextIO | None = None) -> RunSummary:
    """Trains `cfg` for `train.steps` steps in `cfg.output_dir`, resuming from its checkpoints.

    Args:
        cfg: the resolved config.
        stream: where progress and messages go (default: stdout).

    Returns:
        A `RunSummary` of the run.

    Raises:
        ConfigError: the config does not fit the data or the checkpoint in `output_dir`.
    """
    stream = sys.stdout if stream is None else stream
    run_dir = make_run_dir(Path(cfg.output_dir))
    with _exclusive(run_dir):
        return _run(cfg, run_dir, stream)


def _exclusive(run_dir: Path):
    """The run directory's lock (process 0 of a multi-process run takes it for all)."""
    return run_lock(run_dir) if jax.process_index() == 0 else contextlib.nullcontext()


def _run(cfg: Config, run_dir: Path, stream: TextIO) -> RunSummary:
    """`run` inside the run directory's lock."""
    say = _sayer(stream)
    cfg, datasets = _with_data(cfg)
    iterator = datasets.train_iterator()
    mesh = make_mesh(cfg.mesh, jax.devices())  # ConfigError if it does not fit the devices
    written = cfg  # config.yaml keeps precision.backend as configured
    say(f"run directory: {run_dir.resolve()}")
    cfg = _with_trusted_backend(cfg, say)
    te_mesh = te_context(cfg.precision.backend, mesh, data="data", fsdp="fsdp")
    with te_mesh, _checkpoints(cfg, run_dir) as ckpts:
        graphdef, state, start = resume_or_init(
            cfg, run_dir, ckpts, iterator, run_dir / METRICS_FILE, say, mesh
        )
        if jax.process_index() == 0:
            (run_dir / CONFIG_FILE).write_text(to_yaml(written))
            datasets.tokenizer.save(run_dir / TOKENIZER_DIR)
        say(
            f"model: {count_params(state.params):,} parameters, {cfg.model.num_layers} layers, "
            f"vocab {cfg.model.vocab_size}; precision.recipe={cfg.precision.recipe}"
        )
        say(_memory_line(mesh, state))
        say(datasets.documents)
        if start >= cfg.train.steps:
            say(f"already trained to step {start} (train.steps={cfg.train.steps}); nothing to do")
            return RunSummary(run_dir, start, start, None, None)
        loop = TrainingLoop(cfg, graphdef, datasets, ckpts, say, mesh, state)
        with stop_requests() as stop:
            return loop.train(state, iterator, run_dir, start, stream, stop)


def load_run_config(run_dir: str | Path, overrides: Sequence[str] = ()) -> Config:
    """The resolved config a run directory was trained with (its `config.yaml`; one written by
    an earlier version is read with its moved keys at their new places: `config.upgraded`)."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{str(run_dir)!r} is not a run directory: it has no {CONFIG_FILE}")
    saved = read_config_file(path)
    return config_from_dict(upgraded(saved) if isinstance(saved, dict) else saved, overrides)


EVAL_FORWARDS = ("run", "quantized", "bf16")


def evaluate_run(
    run_dir: str | Path, *, forward: str = "run", stream: TextIO | None = None
) -> dict[str, Any]:
    """Evaluates the newest checkpoint of `run_dir` on its validation split.

    Prints the result and appends a row `{"step", "val_loss", "source": "eval"}` (plus
    `"forward"` unless it is "run") to `metrics.jsonl`.

    Args:
        run_dir: a run directory.
        forward: "run": the forward the run trained with at that step (its precision phase:
            the BF16 forward from `precision.bf16_forward_from` on, a `precision.schedule`'s
            windows); "quantized": the quantized forward of the presets the checkpoint lists in
            `quant_stats.recipes` (what an export reproduces); "bf16": those with their forward
            GEMMs in BF16 (their backward is irrelevant here), e.g. to see what a late switch
            to BF16 owes to BF16 evaluation alone.
        stream: where the result line goes (default: stdout).

    Raises:
        ConfigError: `run_dir` is not a run directory, has no checkpoint, or no validation data.
        ValueError: `forward` is not one of `EVAL_FORWARDS`.
    """
    if forward not in EVAL_FORWARDS:
        raise ValueError(f"forward must be one of {EVAL_FORWARDS}, got {forward!r}")
    stream = sys.stdout if stream is None else stream
    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir)
    with _exclusive(run_dir):
        return _evaluate(cfg, run_dir, forward, stream)


def _eval_graphdef(cfg: Config, graphdef: Any, forward: str, step: int) -> Any:
    """The model `evaluate_run` validates a checkpoint of `step` with (see its `forward`);
    `graphdef` is the base model's."""
    phases = precision_phases(cfg.model, cfg.precision, cfg.train.steps)
    if forward == "run":
        recipes = phases[phase_index(phases, step)].recipes
    else:
        exported = export_recipe_names(cfg.model, cfg.precision, cfg.train.steps)
        recipes = {path: get_recipe(name) for path, name in exported.items()}
        if forward == "bf16":
            recipes = {path: recipe.with_bf16_fprop() for path, recipe in recipes.items()}
    if recipes == layer_recipes(cfg.model, cfg.precision):
        return graphdef
    return model_graphdef(model_spec(cfg), recipes)


def _evaluate(cfg: Config, run_dir: Path, forward: str, stream: TextIO) -> dict[str, Any]:
    """`evaluate_run` inside the run directory's lock."""
    if not (run_dir / CHECKPOINT_DIR).is_dir():
        raise ConfigError(f"{str(run_dir)!r} has no checkpoint to evaluate")
    cfg, datasets = _with_data(cfg)
    batches = eval_batches(cfg, datasets)
    if not batches:
        raise ConfigError(f"{str(run_dir)!r}: the config holds out no validation data")
    with _checkpoints(cfg, run_dir) as ckpts:
        latest = ckpts.latest_step()
        if latest is None:
            raise ConfigError(f"{str(run_dir)!r} has no checkpoint to evaluate")
        graphdef, abstract = abstract_state(cfg)
        restored = restore_newest_readable(
            cfg, run_dir, ckpts, abstract, _sayer(stream), set_aside=False
        )
    if restored is None:
        raise ConfigError(f"{str(run_dir)!r} has no readable checkpoint to evaluate")
    latest = restored.step
    eval_graphdef = _eval_graphdef(cfg, graphdef, forward, latest)
    eval_step = jax.jit(make_eval_step(eval_graphdef, seed=cfg.train.seed))
    row = {
        "step": latest,
        "val_loss": evaluate(eval_step, restored.state.params, batches),
        "source": "eval",
    }
    if forward != "run":
        row["forward"] = forward
    metrics = MetricsFile(run_dir / METRICS_FILE)
    metrics.append(row)
    metrics.close()
    print(format_row(row), file=stream, flush=True)
    return row


__all__ = ["RunSummary", "evaluate", "evaluate_run", "load_run_config", "run"]
