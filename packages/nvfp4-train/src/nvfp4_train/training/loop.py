"""One training session: the step loop.

`TrainingLoop(cfg, graphdef, datasets, ckpts, say, mesh, state).train(...)` runs steps
`start + 1 .. train.steps` of a state already restored or initialised (`training.run` sets that
up): each step asks `training.cadence.due` what else happens (metrics row, evaluation,
checkpoint, telemetry probe) and runs the train step of its precision phase, compiled when the
run first reaches it (`training.phases`). The metrics window and its rows are
`training.window`, divergence and quantization health `training.watch`, what a checkpoint holds
besides the state `training.saving`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import jax
import numpy as np
from jax.experimental import multihost_utils

from nvfp4_train.checkpoint.checkpoints import Checkpoints
from nvfp4_train.checkpoint.run_dir import CONFIG_FILE, METRICS_FILE, TENSORBOARD_DIR
from nvfp4_train.config.run_config import Config
from nvfp4_train.errors import RunError
from nvfp4_train.mesh.sharding import global_batch
from nvfp4_train.model.blocks.attention import document_bound, too_many_documents
from nvfp4_train.observe.metrics import RunOutputs, format_row
from nvfp4_train.precision.schedule import phase_index
from nvfp4_train.tasks import Task
from nvfp4_train.training.cadence import Due, due
from nvfp4_train.training.downstream import TaskScorer
from nvfp4_train.training.phases import CompiledPhases, Phase
from nvfp4_train.training.saving import CheckpointWriter
from nvfp4_train.training.step import step_key
from nvfp4_train.training.stop import StopRequest
from nvfp4_train.training.validation import eval_batches, evaluate, reference_tokens
from nvfp4_train.training.watch import Watch
from nvfp4_train.training.window import MetricsWindow


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


def _agreed(flag: bool) -> bool:
    """True on every process when it is True on any (one process may get the signal first)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.max(multihost_utils.process_allgather(np.int32(flag))))


class TrainingLoop:
    """One training session from `start` to `train.steps`."""

    def __init__(self, cfg: Config, graphdef: Any, datasets: Any, ckpts: Checkpoints, say, mesh,
                 state, *, tasks: Sequence[Task] = ()) -> None:  # fmt: skip
        self.cfg, self.ckpts, self.say, self.mesh = cfg, ckpts, say, mesh
        state_sh = jax.tree.map(lambda x: x.sharding, state)
        self.phases = CompiledPhases(cfg, graphdef, mesh, state_sh, say)
        self.schedule = self.phases.schedule
        self.max_documents = document_bound(cfg, jax.default_backend())
        host_batches = eval_batches(cfg, datasets)
        if self.max_documents:  # validation reaches te as training does
            for i, batch in enumerate(host_batches):
                self._check_documents(batch, f"validation batch {i}")
        self.val_batches = [global_batch(b, self.phases.batch_sh) for b in host_batches]
        self.tasks = None
        if tasks:  # `eval.tasks`, read by `run` before anything was written
            self.tasks = TaskScorer(tasks, datasets.tokenizer,
                                    seq_len=cfg.model.max_seq_len, batch_size=cfg.eval.batch_size,
                                    seed=cfg.train.seed)  # fmt: skip
        self.writer = CheckpointWriter(cfg, ckpts, self.phases, reference_tokens(cfg, datasets))
        self.watch = Watch(cfg, ckpts)
        quantized = any(r.quantized for p in self.schedule for r in p.recipes.values())
        self.window = MetricsWindow(cfg, devices=mesh.size, quantized=quantized,
                                    tokens_by_source=datasets.tokens_by_source)  # fmt: skip

    def _probe(self, phase: Phase, state: Any, batch: Any, step: int) -> tuple[Any, float]:
        """(telemetry of step `step`, seconds it took): what the step is about to quantize (its
        params, batch and SR key)."""
        jax.block_until_ready(state.params)  # the steps before it are step time
        t0 = time.perf_counter()
        quant = phase.probe(state.params, batch, step_key(self.cfg.train.seed, step - 1))
        quant = jax.block_until_ready(quant)  # done before the step donates the params
        return quant, time.perf_counter() - t0

    def _write_row(self, outputs: RunOutputs, phase: Phase, step: int, state: Any,
                   evaluate_now: bool) -> dict[str, Any]:  # fmt: skip
        """Writes (and returns) the metrics row of the window ending at `step`, with `val_loss`
        and the `eval.tasks` metrics (`task/<name>/<metric>`) when `evaluate_now` (not counted as
        step time); stops a diverged run."""
        row, host = self.window.row(step)
        if evaluate_now and self.val_batches:
            row["val_loss"] = evaluate(phase.eval, state.params, self.val_batches)
        if evaluate_now and self.tasks is not None:  # the forward of the step's phase
            recipes = self.schedule[phase_index(self.schedule, step)].recipes
            row |= self.tasks.row(self.phases.graphdef(recipes), state.params)
        outputs.write(row)
        self.watch.check_divergence(host, step)
        return row

    def _next_batch(self, iterator: Any) -> Any:
        """The next batch, on the mesh; checked against `model.attention_max_documents` when
        the run's attention needs that bound (te: documents beyond it would not be attended).

        Raises:
            RunError: a row holds more documents than the bound.
        """
        host = next(iterator)
        if self.max_documents:
            self._check_documents(host, "a batch")
        return global_batch(host, self.phases.batch_sh)

    def _check_documents(self, host: dict[str, np.ndarray], batch: str) -> None:
        """Raises RunError if a row of `host` holds more documents than the run's te bound."""
        if "segment_ids" in host:
            problem = too_many_documents(np.asarray(host["segment_ids"]), self.max_documents, batch)
            if problem:
                raise RunError(problem)

    def _due(self, step: int) -> Due:
        cfg = self.cfg
        validation = bool(self.val_batches) or self.tasks is not None
        return due(step, cfg.train, cfg.checkpoint, cfg.logging, validation=validation)

    def train(
        self, state, iterator, run_dir: Path, start: int, stream: TextIO, stop: StopRequest
    ) -> RunSummary:
        """Runs steps `start + 1 .. train.steps`, writing rows and checkpoints as `due` says.

        After a stop signal the current step finishes, its metrics row and a checkpoint are
        written, and the run returns early with `stopped_by` set.
        """
        phases, window = self.phases, self.window
        batch = self._next_batch(iterator)
        index = phase_index(self.schedule, start)
        phase, step_fn = phases.phase(index), phases.compiled_train(index, state, batch)
        phases.announce(start, index)
        outputs = _outputs(self.cfg, run_dir, start, stream)
        rows, step = [], start
        window.restart()
        try:
            for step in range(start + 1, self.cfg.train.steps + 1):
                batch = batch if step == start + 1 else self._next_batch(iterator)
                now = self._due(step)
                if now.probe:  # the probe does not count as step time
                    quant, probe_seconds = self._probe(phase, state, batch, step)
                    window.exclude(probe_seconds)
                state, step_metrics = step_fn(state, batch)
                window.add(step_metrics)
                if now.probe:
                    self.watch.report_quant(outputs, step, quant)
                if phase_index(self.schedule, step) != index:  # a new precision phase
                    jax.block_until_ready(state)  # so that only the compile is left out
                    t0, index = time.perf_counter(), phase_index(self.schedule, step)
                    phase = phases.phase(index)
                    if step < self.cfg.train.steps:  # else only its validation is left
                        step_fn = phases.compiled_train(index, state, batch)
                    phases.announce(step, index)
                    window.exclude(time.perf_counter() - t0)
                stopping = _agreed(stop.signal is not None)
                if stopping or now.row:
                    rows.append(self._write_row(outputs, phase, step, state, now.evaluate))
                else:
                    outputs.progress.update(step)
                if stopping or now.checkpoint:
                    self.writer.save(step, state, iterator)
                if stopping:
                    break
                if not window:  # evaluation and checkpointing do not count as step time
                    window.restart()
        finally:
            outputs.close()
        return self._finish(rows, run_dir, start, step, stop)

    def _finish(self, rows: list, run_dir: Path, start: int, step: int, stop) -> RunSummary:
        """Waits for the checkpoints, says how the run ended and summarises it."""
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


def _outputs(cfg: Config, run_dir: Path, start: int, stream: TextIO) -> RunOutputs:
    return RunOutputs(
        cfg.logging, total_steps=cfg.train.steps, start=start,
        metrics_path=run_dir / METRICS_FILE, tensorboard_dir=run_dir / TENSORBOARD_DIR,
        stream=stream, primary=jax.process_index() == 0,
    )  # fmt: skip
