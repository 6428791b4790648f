"""The training loop: `run(cfg)` trains (or resumes) a run; `evaluate_run(run_dir)` evaluates it.

A run directory holds `config.yaml` (the resolved config), `metrics.jsonl`, `tokenizer/`,
`checkpoints/<step>/` (orbax, see docs/checkpoint-schema.md) and `tensorboard/`. Calling `run` again
with the same `output_dir` resumes from the newest readable checkpoint (see `nvfp4_train.resume`);
SIGTERM/SIGINT stop it after the current step with a checkpoint (`nvfp4_train.stop`). The state
lives on the `mesh:` device mesh (`nvfp4_train.sharding`), across processes when the CLI joined a
multi-process run (`nvfp4_train.distributed`).

Example:
    >>> summary = run(config_from_dict({"output_dir": "runs/x", "train": {"steps": 10}}))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from nvfp4_ops import get_recipe
from nvfp4_train.backend_check import backend_line, trusted_backend
from nvfp4_train.checkpoint import Checkpoints
from nvfp4_train.config import Config, ConfigError, load_config, to_dict, to_yaml
from nvfp4_train.data import make_datasets
from nvfp4_train.errors import RunError
from nvfp4_train.health import make_health_tracker
from nvfp4_train.metrics import (
    MetricsFile,
    TensorBoard,
    format_row,
    make_progress,
    quant_row,
    summarize_window,
)
from nvfp4_train.optim import make_optimizer
from nvfp4_train.policy import bf16_forward_start, layer_recipe_names, run_layout
from nvfp4_train.resume import abstract_state, restore_newest_readable, resume_or_init
from nvfp4_train.run_dir import make_run_dir, run_lock
from nvfp4_train.sharding import (
    batch_sharding,
    bytes_per_device,
    global_batch,
    host_value,
    make_mesh,
)
from nvfp4_train.step import (
    count_params,
    flat_amax,
    forward,
    make_eval_step,
    make_train_step,
    model_graphdef,
)
from nvfp4_train.stop import StopRequest, stop_requests
from nvfp4_train.telemetry import make_quant_probe, step_key

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoints"
TENSORBOARD_DIR = "tensorboard"
TOKENIZER_DIR = "tokenizer"


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """What a finished `run` reports.

    Attributes:
        run_dir: the run directory.
        start_step: the step training started from (0, or the resumed checkpoint's step).
        final_step: the step training stopped at (`train.steps`).
        last_loss: the last logged training loss (None if no step ran).
        val_loss: the last validation loss (None if there is no validation split or no step ran).
        stopped_by: the signal name (`SIGTERM`, `SIGINT`) that stopped the run early after
            saving a checkpoint at `final_step`, or None when it ran to `train.steps`.
    """

    run_dir: Path
    start_step: int
    final_step: int
    last_loss: float | None
    val_loss: float | None
    stopped_by: str | None = None


def _datasets(cfg: Config) -> Any:
    """The data in global order: every process iterates the same global batches and places only
    the rows its devices hold (`global_batch`), so a run's numerics do not depend on how many
    processes share it."""
    return make_datasets(
        cfg.data, seq_len=cfg.train.seq_len, batch_size=cfg.train.batch_size, seed=cfg.train.seed
    )


def _with_data_vocab(cfg: Config, vocab_size: int) -> Config:
    try:
        model = cfg.model.with_vocab_size(vocab_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return dataclasses.replace(cfg, model=model)


def evaluate(eval_step: Callable, params: Any, batches: Sequence[dict]) -> float:
    """Mean validation loss (nats per token) over `batches`."""
    loss_sum, tokens = 0.0, 0.0
    for batch in batches:
        batch_loss, batch_tokens = eval_step(params, batch)
        loss_sum += float(host_value(batch_loss))
        tokens += float(host_value(batch_tokens))
    if tokens == 0:
        raise ValueError("batches must hold at least one target token, got none")
    return loss_sum / tokens


def reference_tokens(cfg: Config, datasets: Any) -> np.ndarray | None:
    """int32 [n, L] tokens of the checkpoints' `reference` item, or None.

    The first `checkpoint.reference_sequences` validation sequences (the same on every process),
    cut to `L = min(train.seq_len, 64)` tokens; None when that is 0 or there is no validation split.
    """
    n = min(cfg.checkpoint.reference_sequences, len(datasets.validation_sequences))
    if n == 0:
        return None
    length = min(cfg.train.seq_len, 64)
    rows = [datasets.validation_sequences[i]["inputs"][:length] for i in range(n)]
    return np.stack(rows).astype(np.int32)


def _eval_batches(cfg: Config, datasets: Any) -> list[dict]:
    batches = list(datasets.validation_batches())
    return batches if cfg.train.eval_batches is None else batches[: cfg.train.eval_batches]


class _Outputs:
    """The run's writers: metrics.jsonl, TensorBoard and the progress display."""

    def __init__(self, cfg: Config, run_dir: Path, start: int, stream: TextIO) -> None:
        primary = jax.process_index() == 0  # one writer per run directory
        self.progress = make_progress(
            cfg.logging.progress, total=cfg.train.steps, initial=start, stream=stream
        )
        metrics = run_dir / METRICS_FILE
        self.metrics = MetricsFile(metrics, say=self.progress.message) if primary else None
        self.tensorboard = None
        if cfg.logging.tensorboard and primary:
            purge = start + 1 if start else None
            self.tensorboard = TensorBoard(run_dir / TENSORBOARD_DIR, purge_step=purge)

    def write(self, row: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.append(row)
        if self.tensorboard is not None:
            self.tensorboard.write(row)
        self.progress.update(row["step"], row)

    def write_quant(self, row: dict[str, Any]) -> None:
        """A telemetry row: to metrics.jsonl and TensorBoard, its summary to the progress."""
        if self.metrics is not None:
            self.metrics.append(row)
        if self.tensorboard is not None:
            self.tensorboard.write(row)
        self.progress.message(f"[{row['step']}] {format_row(row)}")

    def close(self) -> None:
        self.progress.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def _memory_line(mesh: Any, state: Any) -> str:
    mib = 1 / 2**20
    shape = ", ".join(f"{k}={v}" for k, v in mesh.shape.items())
    return (
        f"mesh: {shape} over {mesh.size} devices ({jax.process_count()} processes); per device: "
        f"parameters {bytes_per_device(state.params) * mib:.2f} MiB, optimizer state "
        f"{bytes_per_device(state.opt_state) * mib:.2f} MiB"
    )


def _agreed(flag: bool) -> bool:
    """True on every process when it is True on any (one process may get the signal first)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.max(multihost_utils.process_allgather(np.int32(flag))))


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


def _with_trusted_backend(cfg: Config, say: Callable[[str], None]) -> Config:
    """`cfg` with the backends that disagree with "emulated" here left out (`backend_check`)."""
    names = set(layer_recipe_names(cfg.model, cfg.precision).values())
    if any(get_recipe(n).quantized for n in names):
        say(backend_line(cfg.precision.backend))
    backend = trusted_backend(cfg.precision, names, say)
    if backend == cfg.precision.backend:
        return cfg
    return dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, backend=backend))


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
    datasets = _datasets(cfg)
    cfg = _with_data_vocab(cfg, datasets.vocab_size)
    iterator = datasets.train_iterator()
    mesh = make_mesh(cfg.mesh, jax.devices())
    written = cfg  # config.yaml keeps precision.backend as configured
    say(f"run directory: {run_dir.resolve()}")
    cfg = _with_trusted_backend(cfg, say)
    with _checkpoints(cfg, run_dir) as ckpts:
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
        if start >= cfg.train.steps:
            say(f"already trained to step {start} (train.steps={cfg.train.steps}); nothing to do")
            return RunSummary(run_dir, start, start, None, None)
        loop = _Loop(cfg, graphdef, datasets, ckpts, say, mesh, state)
        with stop_requests() as stop:
            return loop.train(state, iterator, run_dir, start, stream, stop)


class _Loop:
    """One training session from `start` to `train.steps` (compiled steps and helpers)."""

    def __init__(self, cfg: Config, graphdef: Any, datasets: Any, ckpts: Checkpoints, say, mesh,
                 state) -> None:  # fmt: skip
        self.cfg, self.ckpts, self.say = cfg, ckpts, say
        self.optimizer = make_optimizer(cfg, cfg.train.steps)
        state_sh = jax.tree.map(lambda x: x.sharding, state)
        replicated = NamedSharding(mesh, PartitionSpec())
        self.batch_sh = batch_sharding(mesh, cfg.train.batch_size)
        self.steps = self._jitted_steps(graphdef, mesh, state_sh, replicated)
        _, self.eval_step, self.probe = self.steps
        self.health = make_health_tracker(cfg.logging.quant_health)
        self.health_state = self.health.init()
        # precision.bf16_forward_from: the same steps with BF16 forward GEMMs (jit compiles lazily)
        self.bf16_forward_from = bf16_forward_start(cfg.precision, cfg.train.steps)
        self.late_steps = self.steps
        if self.bf16_forward_from is not None:
            late = model_graphdef(cfg, bf16_forward=True)
            self.late_steps = self._jitted_steps(late, mesh, state_sh, replicated)
        self.val_batches = [global_batch(b, self.batch_sh) for b in _eval_batches(cfg, datasets)]
        self.streak = (0, 0)  # (how many, first step) of the latest consecutive non-finite steps
        self.config_dict = to_dict(cfg)
        self.recipes = layer_recipe_names(cfg.model, cfg.precision)
        self.reference_tokens = reference_tokens(cfg, datasets)
        seed = cfg.train.seed
        self.forward = jax.jit(
            lambda p, t: forward(graphdef, p, t, jax.random.key(seed)),
            in_shardings=(state_sh.params, replicated),
            out_shardings=replicated,
        )

    def _jitted_steps(self, graphdef, mesh, state_sh, replicated) -> tuple[Callable, ...]:
        """(train step, eval step, telemetry probe) of `graphdef`, jitted (compiled when first
        called) with the state's shardings."""
        train_step = jax.jit(
            make_train_step(self.cfg, graphdef, self.optimizer, mesh),
            in_shardings=(state_sh, self.batch_sh),
            out_shardings=(state_sh, replicated),
            donate_argnums=0,
        )
        eval_step = jax.jit(
            make_eval_step(self.cfg, graphdef, mesh),
            in_shardings=(state_sh.params, self.batch_sh),
            out_shardings=replicated,
        )
        probe = jax.jit(make_quant_probe(self.cfg, graphdef, mesh), out_shardings=replicated)
        return train_step, eval_step, probe

    def _compile(self, state: Any, batch: Any, completed: int) -> tuple[Callable, float]:
        """(compiled train step, seconds) for the steps after `completed` ones; also selects the
        eval step and probe. From `precision.bf16_forward_from` on, all run the BF16 forward."""
        switch = self.bf16_forward_from
        late = switch is not None and completed >= switch
        train_step, self.eval_step, self.probe = self.late_steps if late else self.steps
        t0 = time.perf_counter()
        step_fn = train_step.lower(state, batch).compile()
        seconds = time.perf_counter() - t0
        self.say(f"compiled the train step in {seconds:.1f}s")
        if late:
            what = "now run" if completed == switch else f"run (since step {switch})"
            self.say(
                f"step {completed}: forward GEMMs of the quantized linears {what} in BF16 "
                f"(precision.bf16_forward_from={self.cfg.precision.bf16_forward_from})"
            )
        return step_fn, seconds

    def save(self, step: int, state: Any, iterator: Any) -> None:
        """Writes the checkpoint of `step` with its quant_stats and reference items.

        The reference logits always come from the quantized forward of `quant_stats["recipes"]`
        (what an export reproduces), also after a `precision.bf16_forward_from` switch.
        """
        amax = {k: float(host_value(v)) for k, v in flat_amax(state.activation_amax).items()}
        quantized = [p for p, name in self.recipes.items() if name != "bf16"]
        stats = {"recipes": self.recipes, "activation_amax": {p: amax[p] for p in quantized}}
        reference = None
        if self.reference_tokens is not None:
            logits = self.forward(state.params, self.reference_tokens)
            reference = {
                "tokens": self.reference_tokens,
                "logits": np.asarray(host_value(logits), np.float32),
            }
        self.ckpts.save(
            step, state, data_iter_state=iterator.get_state(), config=self.config_dict,
            quant_stats=stats, reference=reference,
        )  # fmt: skip

    def _is_eval_step(self, step: int) -> bool:
        every = self.cfg.train.eval_every
        return bool(self.val_batches) and (
            step == self.cfg.train.steps or bool(every and step % every == 0)
        )

    def _is_row_step(self, step: int) -> bool:
        last = step == self.cfg.train.steps
        return last or self._is_eval_step(step) or step % self.cfg.train.log_every == 0

    def _is_checkpoint_step(self, step: int) -> bool:
        every = self.cfg.checkpoint.every_steps
        return step == self.cfg.train.steps or bool(every and step % every == 0)

    def _row(self, step: int, host: list, seconds: float, params: Any) -> dict[str, Any]:
        """The metrics row of the steps whose host metrics are `host`, with `val_loss` if due."""
        tokens = self.cfg.train.batch_size * self.cfg.train.seq_len * len(host)
        row = summarize_window(
            host, step=step, seconds=seconds, tokens=tokens,
            skipped_total=int(host[-1]["skipped_total"]),
        )  # fmt: skip
        if self.cfg.precision.loss_scaling != "none":
            row["loss_scale"] = float(host[-1]["loss_scale"])
        if self._is_eval_step(step):
            row["val_loss"] = evaluate(self.eval_step, params, self.val_batches)
        return row

    def _check_divergence(self, host: list, last_step: int) -> None:
        """Raises RunError after `train.stop_after_nonfinite` consecutive skipped/NaN steps."""
        for step in range(last_step - len(host) + 1, last_step + 1):
            metrics = host[step - last_step - 1]
            bad = bool(metrics["skipped"]) or not np.isfinite(float(metrics["loss"]))
            count, first = self.streak
            self.streak = (count + 1, first if count else step) if bad else (0, 0)
        count, first = self.streak
        limit = self.cfg.train.stop_after_nonfinite
        if limit and count >= limit:
            kept = self.ckpts.latest_step()
            raise RunError(
                f"training diverged: the {count} steps {first}..{last_step} were all "
                "skipped as non-finite or had a non-finite loss (train.stop_after_nonfinite="
                f"{limit}); stopping. "
                + (f"The newest checkpoint, step {kept}, is kept. " if kept is not None else "")
                + "Lower optimizer.learning_rate (or check the data) and run again."
            )  # fmt: skip

    def _probe(self, state: Any, batch: Any, step: int) -> tuple[Any, float]:
        """(telemetry, seconds it took) of step `step` when due (`logging.quant_stats_every`),
        else (None, 0): what the step is about to quantize (its params, batch and SR key)."""
        every = self.cfg.logging.quant_stats_every
        if not every or step % every:
            return None, 0.0
        jax.block_until_ready(state.params)  # the steps before it are step time
        t0 = time.perf_counter()
        quant = self.probe(state.params, batch, step_key(self.cfg, step - 1))
        quant = jax.block_until_ready(quant)  # done before the step donates the params
        return quant, time.perf_counter() - t0

    def _report_quant(self, outputs: _Outputs, step: int, quant: Any) -> None:
        """Writes the telemetry row of `step` and prints the health warnings it raises."""
        row = quant_row(step, jax.tree.map(host_value, quant))
        outputs.write_quant(row)
        self.health_state, lines = self.health.update(self.health_state, row["quant"], step=step)
        for line in lines:
            outputs.progress.message(line)

    def train(
        self, state, iterator, run_dir: Path, start: int, stream: TextIO, stop: StopRequest
    ) -> RunSummary:
        """Runs steps `start + 1 .. train.steps`, writing rows and checkpoints as configured.

        After a stop signal the current step finishes, its metrics row and a checkpoint are
        written, and the run returns early with `stopped_by` set.
        """
        cfg = self.cfg
        batch = global_batch(next(iterator), self.batch_sh)
        step_fn, _ = self._compile(state, batch, start)
        outputs = _Outputs(cfg, run_dir, start, stream)
        window, rows = [], []
        t_window = time.perf_counter()
        step = start
        try:
            for step in range(start + 1, cfg.train.steps + 1):
                if step > start + 1:
                    batch = global_batch(next(iterator), self.batch_sh)
                quant, probe_seconds = self._probe(state, batch, step)
                t_window += probe_seconds  # the probe does not count as step time
                state, step_metrics = step_fn(state, batch)
                if quant is not None:
                    self._report_quant(outputs, step, quant)
                window.append(step_metrics)
                if step == self.bf16_forward_from:  # later steps run the BF16 forward
                    jax.block_until_ready(state)  # so that only the compile is left out
                    step_fn, seconds = self._compile(state, batch, step)
                    t_window += seconds
                stopping = _agreed(stop.signal is not None)
                if stopping or self._is_row_step(step):
                    host = [jax.tree.map(host_value, m) for m in window]  # waits for them
                    seconds = time.perf_counter() - t_window
                    rows.append(self._row(step, host, seconds, state.params))
                    outputs.write(rows[-1])
                    window = []
                    self._check_divergence(host, step)
                else:
                    outputs.progress.update(step)
                if stopping or self._is_checkpoint_step(step):
                    self.save(step, state, iterator)
                if stopping:
                    break
                if not window:  # evaluation and checkpointing do not count as step time
                    t_window = time.perf_counter()
        finally:
            outputs.close()
        self.ckpts.wait()
        if stop.signal is not None:
            self.say(
                f"stopped by {stop.name} after step {step}; checkpoint saved in "
                f"{self.ckpts.directory / str(step)}. To resume, rerun the same command "
                f"(or: nvfp4-train run {run_dir / CONFIG_FILE})"
            )
        else:
            self.say(f"done: {format_row(rows[-1])}")
        val = [r["val_loss"] for r in rows if "val_loss" in r]
        return RunSummary(
            run_dir, start, step, rows[-1]["loss"], val[-1] if val else None,
            stop.name or None,
        )  # fmt: skip


def load_run_config(run_dir: str | Path, overrides: Sequence[str] = ()) -> Config:
    """The resolved config a run directory was trained with (its `config.yaml`)."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{str(run_dir)!r} is not a run directory: it has no {CONFIG_FILE}")
    return load_config(path, overrides)


EVAL_FORWARDS = ("run", "quantized", "bf16")


def evaluate_run(
    run_dir: str | Path, *, forward: str = "run", stream: TextIO | None = None
) -> dict[str, Any]:
    """Evaluates the newest checkpoint of `run_dir` on its validation split.

    Prints the result and appends a row `{"step", "val_loss", "source": "eval"}` (plus
    `"forward"` unless it is "run") to `metrics.jsonl`.

    Args:
        run_dir: a run directory.
        forward: "run": the forward the run trained with at that step (the BF16 forward from
            `precision.bf16_forward_from` on); "quantized": the recipes' quantized forward;
            "bf16": the quantized linears' forward GEMMs in BF16 (their backward is irrelevant
            here), e.g. to see what a late switch to BF16 owes to BF16 evaluation alone.
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


def _evaluate(cfg: Config, run_dir: Path, forward: str, stream: TextIO) -> dict[str, Any]:
    """`evaluate_run` inside the run directory's lock."""
    if not (run_dir / CHECKPOINT_DIR).is_dir():
        raise ConfigError(f"{str(run_dir)!r} has no checkpoint to evaluate")
    datasets = _datasets(cfg)
    cfg = _with_data_vocab(cfg, datasets.vocab_size)
    batches = _eval_batches(cfg, datasets)
    if not batches:
        raise ConfigError(f"{str(run_dir)!r}: the config holds out no validation data")
    checkpoints = Checkpoints(
        run_dir / CHECKPOINT_DIR, keep=cfg.checkpoint.keep, layout=run_layout(cfg)
    )
    with checkpoints as ckpts:
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
    switch = bf16_forward_start(cfg.precision, cfg.train.steps)
    late = switch is not None and latest >= switch  # the forward the run used at this step
    if forward == "bf16" or (forward == "run" and late):
        graphdef = model_graphdef(cfg, bf16_forward=True)
    eval_step = jax.jit(make_eval_step(cfg, graphdef))
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
