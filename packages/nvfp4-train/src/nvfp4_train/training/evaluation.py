"""`evaluate_run(run_dir)`: the validation loss of a run's newest checkpoint, with the forward
the run used at that step, the quantized forward an export reproduces, or that forward in BF16."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import jax

from nvfp4_ops import get_recipe
from nvfp4_train.checkpoint.run_dir import CHECKPOINT_DIR, METRICS_FILE
from nvfp4_train.config.run_config import Config
from nvfp4_train.errors import ConfigError, RunError
from nvfp4_train.model.blocks.attention import document_bound, too_many_documents
from nvfp4_train.observe.metrics import MetricsFile, format_row
from nvfp4_train.precision.policy import export_recipe_names, layer_recipes, precision_phases
from nvfp4_train.precision.schedule import phase_index
from nvfp4_train.training.resume import abstract_state, restore_newest_readable
from nvfp4_train.training.session import (
    exclusive,
    load_run_config,
    run_checkpoints,
    sayer,
    with_data,
)
from nvfp4_train.training.step import make_eval_step, model_graphdef, model_spec
from nvfp4_train.training.trusted import with_document_bound
from nvfp4_train.training.validation import eval_batches, evaluate

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
    stream = sys.stdout if stream is None else stream
    with opened_run(run_dir, forward) as (cfg, datasets, run_dir):
        return _evaluate(cfg, datasets, run_dir, forward, stream)


@contextlib.contextmanager
def opened_run(run_dir: str | Path, forward: str) -> Iterator[tuple[Config, Any, Path]]:
    """A run directory opened for evaluation, as `evaluate_run` and `downstream.run_scorer` do:
    `forward` checked, the run's config loaded, its lock held while the context lasts; yields
    (the config with `model.vocab_size` filled, its datasets, the run directory as a Path).

    Raises:
        ConfigError: `run_dir` is not a run directory, or has no checkpoint.
        ValueError: `forward` is not one of `EVAL_FORWARDS`.
    """
    if forward not in EVAL_FORWARDS:
        raise ValueError(f"forward must be one of {EVAL_FORWARDS}, got {forward!r}")
    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir)
    with exclusive(run_dir):
        if not (run_dir / CHECKPOINT_DIR).is_dir():
            raise ConfigError(f"{str(run_dir)!r} has no checkpoint to evaluate")
        cfg, datasets = with_data(cfg)
        yield cfg, datasets, run_dir


def eval_graphdef(cfg: Config, graphdef: Any, forward: str, step: int) -> Any:
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


def newest_state(cfg: Config, run_dir: Path, stream: TextIO) -> tuple[Any, Any]:
    """(the base model's graphdef, the restored newest readable checkpoint) of a run
    directory (`cfg`: its config with `model.vocab_size` filled; inside its lock).

    Raises:
        ConfigError: no checkpoint, or none readable.
    """
    if not (run_dir / CHECKPOINT_DIR).is_dir():
        raise ConfigError(f"{str(run_dir)!r} has no checkpoint to evaluate")
    with run_checkpoints(cfg, run_dir) as ckpts:
        if ckpts.latest_step() is None:
            raise ConfigError(f"{str(run_dir)!r} has no checkpoint to evaluate")
        graphdef, abstract = abstract_state(cfg)
        restored = restore_newest_readable(
            cfg, run_dir, ckpts, abstract, sayer(stream), set_aside=False
        )
    if restored is None:
        raise ConfigError(f"{str(run_dir)!r} has no readable checkpoint to evaluate")
    return graphdef, restored


def _evaluate(
    cfg: Config, datasets: Any, run_dir: Path, forward: str, stream: TextIO
) -> dict[str, Any]:
    """`evaluate_run` inside the run directory's lock."""
    cfg = with_document_bound(cfg, datasets, sayer(stream))
    batches = eval_batches(cfg, datasets)
    if not batches:
        raise ConfigError(f"{str(run_dir)!r}: the config holds out no validation data")
    bound = document_bound(cfg, jax.default_backend())
    for i, batch in enumerate(batches if bound and "segment_ids" in batches[0] else ()):
        problem = too_many_documents(batch["segment_ids"], bound, f"validation batch {i}")
        if problem:  # te would give those tokens output 0: a wrong loss, silently
            raise RunError(problem)
    graphdef, restored = newest_state(cfg, run_dir, stream)
    latest = restored.step
    eval_model = eval_graphdef(cfg, graphdef, forward, latest)
    eval_step = jax.jit(make_eval_step(eval_model, seed=cfg.train.seed))
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
