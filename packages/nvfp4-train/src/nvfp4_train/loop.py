"""One training session: the compiled step functions of each precision phase and the step loop.

`TrainingLoop(cfg, graphdef, datasets, ckpts, say, mesh, state).train(...)` runs steps
`start + 1 .. train.steps` of a state already restored or initialised (`nvfp4_train.run` sets
that up): each step asks `nvfp4_train.cadence.due` what else happens (metrics row, evaluation,
checkpoint, telemetry probe) and runs the train step of its precision phase
(`policy.precision_phases`: the late BF16 forward of `precision.bf16_forward_from`, the windows of
`precision.schedule`), compiled when the run first reaches it: phases with the same recipes share
one `Phase`, so a run compiles one train step per distinct table of recipes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from nvfp4_ops import Recipe, get_recipe
from nvfp4_train.attention import document_bound, too_many_documents
from nvfp4_train.cadence import Due, due
from nvfp4_train.checkpoint import Checkpoints
from nvfp4_train.config import Config
from nvfp4_train.config_loader import to_dict
from nvfp4_train.errors import RunError
from nvfp4_train.flops import Throughput, device_peak, train_flops_per_token
from nvfp4_train.health import make_health_tracker
from nvfp4_train.metrics import RunOutputs, format_row, quant_row, summarize_window
from nvfp4_train.model_config import linear_paths
from nvfp4_train.optim import make_optimizer
from nvfp4_train.policy import bf16_forward_start, precision_phases
from nvfp4_train.resume import run_train_step
from nvfp4_train.run_dir import CONFIG_FILE, METRICS_FILE, TENSORBOARD_DIR
from nvfp4_train.schedule import forward_weight_names, phase_changes, phase_index
from nvfp4_train.sharding import batch_sharding, global_batch, host_value
from nvfp4_train.step import (
    flat_amax,
    forward,
    make_eval_step,
    model_graphdef,
    model_spec,
    step_key,
)
from nvfp4_train.stop import StopRequest
from nvfp4_train.telemetry import make_quant_probe
from nvfp4_train.validation import eval_batches, evaluate, reference_tokens


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


class Phase(NamedTuple):
    """The step functions of one table of recipes (of one or more precision phases), jitted with
    the state's shardings (compiled when first called)."""

    train: Callable
    eval: Callable
    probe: Callable


class TrainingLoop:
    """One training session from `start` to `train.steps` (compiled steps and helpers)."""

    def __init__(self, cfg: Config, graphdef: Any, datasets: Any, ckpts: Checkpoints, say, mesh,
                 state) -> None:  # fmt: skip
        self.cfg, self.ckpts, self.say, self.mesh = cfg, ckpts, say, mesh
        self.optimizer = make_optimizer(cfg.optimizer, cfg.train.steps)
        self.spec = model_spec(cfg)
        self.state_sh = jax.tree.map(lambda x: x.sharding, state)
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.batch_sh = batch_sharding(mesh, cfg.train.batch_size)
        self.schedule = precision_phases(cfg.model, cfg.precision, cfg.train.steps)
        self.paths = linear_paths(cfg.model)
        self.throughput = Throughput(
            flops_per_token=train_flops_per_token(cfg.model, seq_len=cfg.train.seq_len),
            devices=mesh.size,
            peak=device_peak(jax.devices()[0].device_kind),
            quantized=any(r.quantized for p in self.schedule for r in p.recipes.values()),
        )
        self._graphdefs = {self._key(self.spec.recipes): graphdef}
        self._phases: dict[tuple, Phase] = {}
        self._compiled: dict[tuple, Callable] = {}
        self.health = make_health_tracker(cfg.logging.quant_health)
        self.health_state = self.health.init()
        self.val_batches = [global_batch(b, self.batch_sh) for b in eval_batches(cfg, datasets)]
        self.streak = (0, 0)  # (how many, first step) of the latest consecutive non-finite steps
        self.max_documents = document_bound(cfg, jax.default_backend())
        self.config_dict = to_dict(cfg)
        self.recipes = forward_weight_names(self.schedule, cfg.train.steps)
        self.reference_tokens = reference_tokens(cfg, datasets)
        self.tokens_by_source = datasets.tokens_by_source  # {} without data.mixture
        seed = cfg.train.seed
        exported = self._graphdef({p: get_recipe(n) for p, n in self.recipes.items()})
        self.forward = jax.jit(
            lambda p, t: forward(exported, p, t, jax.random.key(seed)),
            in_shardings=(self.state_sh.params, self.replicated),
            out_shardings=self.replicated,
        )

    def _key(self, recipes: dict[str, Recipe]) -> tuple[Recipe, ...]:
        return tuple(recipes[p] for p in self.paths)

    def _graphdef(self, recipes: dict[str, Recipe]) -> Any:
        """The model graphdef with `recipes` (one per distinct table)."""
        key = self._key(recipes)
        if key not in self._graphdefs:
            self._graphdefs[key] = model_graphdef(self.spec, recipes)
        return self._graphdefs[key]

    def phase(self, index: int) -> Phase:
        """The jitted steps of precision phase `index` (shared by phases with equal recipes)."""
        recipes = self.schedule[index].recipes
        key = self._key(recipes)
        if key not in self._phases:
            self._phases[key] = self._jitted(self._graphdef(recipes))
        return self._phases[key]

    def _jitted(self, graphdef: Any) -> Phase:
        """The jitted steps of `graphdef` with the state's shardings."""
        train, mesh, state_sh = self.cfg.train, self.mesh, self.state_sh
        step = run_train_step(self.cfg, graphdef, self.optimizer, mesh)
        probe = make_quant_probe(
            graphdef, self.cfg.model, grad_accum_steps=train.grad_accum_steps, mesh=mesh
        )
        return Phase(
            train=jax.jit(
                step,
                in_shardings=(state_sh, self.batch_sh),
                out_shardings=(state_sh, self.replicated),
                donate_argnums=0,
            ),
            eval=jax.jit(
                make_eval_step(graphdef, seed=train.seed, mesh=mesh),
                in_shardings=(state_sh.params, self.batch_sh),
                out_shardings=self.replicated,
            ),
            probe=jax.jit(probe, out_shardings=self.replicated),
        )

    def _compile(self, index: int, state: Any, batch: Any) -> Callable:
        """Phase `index`'s train step compiled for `state` and `batch` (once per distinct table
        of recipes); says how long compiling took."""
        key = self._key(self.schedule[index].recipes)
        if key not in self._compiled:
            t0 = time.perf_counter()
            self._compiled[key] = self.phase(index).train.lower(state, batch).compile()
            self.say(f"compiled the train step in {time.perf_counter() - t0:.1f}s")
        return self._compiled[key]

    def _announce(self, completed: int, index: int) -> None:
        """Says which precision phase the steps after `completed` run in, when it is not the
        first (with only `precision.bf16_forward_from`: that the forward runs in BF16)."""
        precision, phase = self.cfg.precision, self.schedule[index]
        if not precision.schedule:
            switch = bf16_forward_start(precision, self.cfg.train.steps)
            if switch is not None and completed >= switch and phase.start >= switch:
                what = "now run" if completed == switch else f"run (since step {switch})"
                self.say(
                    f"step {completed}: forward GEMMs of the quantized linears {what} in BF16 "
                    f"(precision.bf16_forward_from={precision.bf16_forward_from})"
                )
            return
        if index == 0:
            return
        since = "starts" if completed == phase.start else f"runs since step {phase.start}"
        changes = phase_changes(self.schedule[index - 1], phase, self.paths)
        self.say(
            f"step {completed}: precision phase {index + 1} of {len(self.schedule)}, completed "
            f"steps {phase.label}, {since}: {changes}"
        )

    def save(self, step: int, state: Any, iterator: Any) -> None:
        """Writes the checkpoint of `step` with its quant_stats and reference items.

        `quant_stats["recipes"]` holds `schedule.forward_weight_names` (the presets an export
        quantizes the weights as) and the reference logits come from their quantized forward,
        also after a `precision.bf16_forward_from` switch or a schedule's BF16 Fprop.
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

    def _report_quant(self, outputs: RunOutputs, step: int, quant: Any) -> None:
        """Writes the telemetry row of `step` and prints the health warnings it raises."""
        row = quant_row(step, jax.tree.map(host_value, quant))
        outputs.write_quant(row)
        self.health_state, lines = self.health.update(self.health_state, row["quant"], step=step)
        for line in lines:
            outputs.progress.message(line)

    def _probe(self, phase: Phase, state: Any, batch: Any, step: int) -> tuple[Any, float]:
        """(telemetry of step `step`, seconds it took): what the step is about to quantize (its
        params, batch and SR key)."""
        jax.block_until_ready(state.params)  # the steps before it are step time
        t0 = time.perf_counter()
        quant = phase.probe(state.params, batch, step_key(self.cfg.train.seed, step - 1))
        quant = jax.block_until_ready(quant)  # done before the step donates the params
        return quant, time.perf_counter() - t0

    def _write_row(self, outputs: RunOutputs, phase: Phase, step: int, window: list,
                   started: float, state: Any, evaluate_now: bool) -> dict[str, Any]:  # fmt: skip
        """Writes (and returns) the metrics row of the steps of `window` ending at `step`, with
        `val_loss` when `evaluate_now`; stops a diverged run.

        The window's time runs from `started` until its last step's metrics are on the host:
        steps are dispatched asynchronously, so the loop reaches this row long before the
        device has run them (timed at dispatch, tiny.yaml on CPU showed 10x its real tokens/s).
        """
        host = [jax.tree.map(host_value, m) for m in window]  # waits for them
        seconds = time.perf_counter() - started
        tokens = self.cfg.train.batch_size * self.cfg.train.seq_len * len(host)
        row = summarize_window(
            host, step=step, seconds=seconds, tokens=tokens,
            skipped_total=int(host[-1]["skipped_total"]),
        )  # fmt: skip
        row |= self.throughput.fields(row["tokens_per_s"])
        if by_source := self.tokens_by_source(step):
            row["tokens_by_source"] = by_source
        if self.cfg.optimizer.loss_scaling.mode != "none":
            row["loss_scale"] = float(host[-1]["loss_scale"])
        if evaluate_now:
            row["val_loss"] = evaluate(phase.eval, state.params, self.val_batches)
        outputs.write(row)
        self._check_divergence(host, step)
        return row

    def _next_batch(self, iterator: Any) -> Any:
        """The next batch, on the mesh; checked against `model.attention_max_documents` when
        the run's attention needs that bound (te: documents beyond it would not be attended).

        Raises:
            RunError: a row holds more documents than the bound.
        """
        host = next(iterator)
        if self.max_documents and "segment_ids" in host:
            problem = too_many_documents(np.asarray(host["segment_ids"]), self.max_documents)
            if problem:
                raise RunError(problem)
        return global_batch(host, self.batch_sh)

    def _due(self, step: int) -> Due:
        cfg = self.cfg
        return due(step, cfg.train, cfg.checkpoint, cfg.logging, validation=bool(self.val_batches))

    def train(
        self, state, iterator, run_dir: Path, start: int, stream: TextIO, stop: StopRequest
    ) -> RunSummary:
        """Runs steps `start + 1 .. train.steps`, writing rows and checkpoints as `due` says.

        After a stop signal the current step finishes, its metrics row and a checkpoint are
        written, and the run returns early with `stopped_by` set.
        """
        batch = self._next_batch(iterator)
        index = phase_index(self.schedule, start)
        phase, step_fn = self.phase(index), self._compile(index, state, batch)
        self._announce(start, index)
        outputs = _outputs(self.cfg, run_dir, start, stream)
        window, rows, step, t_window = [], [], start, time.perf_counter()
        try:
            for step in range(start + 1, self.cfg.train.steps + 1):
                batch = batch if step == start + 1 else self._next_batch(iterator)
                now = self._due(step)
                quant, probe_seconds = (
                    self._probe(phase, state, batch, step) if now.probe else (None, 0.0)
                )
                t_window += probe_seconds  # the probe does not count as step time
                state, step_metrics = step_fn(state, batch)
                window.append(step_metrics)
                if quant is not None:
                    self._report_quant(outputs, step, quant)
                if phase_index(self.schedule, step) != index:  # a new precision phase
                    jax.block_until_ready(state)  # so that only the compile is left out
                    t0, index = time.perf_counter(), phase_index(self.schedule, step)
                    phase = self.phase(index)
                    if step < self.cfg.train.steps:  # else only its validation is left
                        step_fn = self._compile(index, state, batch)
                    self._announce(step, index)
                    t_window += time.perf_counter() - t0
                stopping = _agreed(stop.signal is not None)
                if stopping or now.row:
                    rows.append(
                        self._write_row(outputs, phase, step, window, t_window, state, now.evaluate)
                    )
                    window = []
                else:
                    outputs.progress.update(step)
                if stopping or now.checkpoint:
                    self.save(step, state, iterator)
                if stopping:
                    break
                if not window:  # evaluation and checkpointing do not count as step time
                    t_window = time.perf_counter()
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
