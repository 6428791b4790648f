"""Starting a run: fresh, or from the newest READABLE checkpoint of its run directory.

A checkpoint that cannot be read (files missing or truncated, a save that never finished but left
an integer-named directory) is reported, renamed to `<step>.unreadable` so it is never picked or
overwritten, and the previous one is tried. A checkpoint of a different model, precision or
loss-scaling config, or one whose optimizer state has another structure (clipping on or off), is
refused with the differing keys before anything is restored (`check_same_model`), so a changed
config never makes good checkpoints look unreadable.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from nvfp4_train.checkpoint.checkpoints import Checkpoints
from nvfp4_train.checkpoint.items import Restored
from nvfp4_train.config.loader import to_dict
from nvfp4_train.config.run_config import Config, upgraded
from nvfp4_train.data.iterator_state import restore_iterator_state
from nvfp4_train.errors import ConfigError
from nvfp4_train.mesh.sharding import tree_shardings
from nvfp4_train.model.hf.weights import load_hf_params, unused_lines
from nvfp4_train.observe.metrics import truncate_metrics
from nvfp4_train.optim.optimizer import make_optimizer, make_schedule
from nvfp4_train.training.step import init_state, make_train_step, model_spec, state_from_params


def initial_state(cfg: Config) -> tuple[Any, Any]:
    """(graphdef, step-0 TrainState) of a run config (`model.vocab_size` set): `step.init_state`
    of its `step.model_spec`, its optimizer (`optimizer` section, `train.steps`) and `train.seed`."""
    optimizer = make_optimizer(cfg.optimizer, cfg.train.steps)
    return init_state(model_spec(cfg), optimizer, seed=cfg.train.seed)


def run_train_step(cfg: Config, graphdef: Any, optimizer: Any = None, mesh: Mesh | None = None):
    """The (unjitted) train step of a run config on `graphdef`: `step.make_train_step` with the
    config's learning-rate schedule, `train.seed` and `train.grad_accum_steps`, and its optimizer
    (`optimizer` section, `train.steps`) unless one is given."""
    steps = cfg.train.steps
    optimizer = make_optimizer(cfg.optimizer, steps) if optimizer is None else optimizer
    return make_train_step(
        graphdef, optimizer, make_schedule(cfg.optimizer, steps), seed=cfg.train.seed,
        grad_accum_steps=cfg.train.grad_accum_steps, mesh=mesh, moe=cfg.model.moe,
    )  # fmt: skip


def abstract_state(cfg: Config) -> tuple[Any, Any]:
    """(graphdef, TrainState of ShapeDtypeStructs) without materialising the parameters."""
    graphdefs = []

    def init() -> Any:
        graphdef, state = initial_state(cfg)
        graphdefs.append(graphdef)
        return state

    abstract = jax.eval_shape(init)
    return graphdefs[0], abstract


IMPLEMENTATION_KEYS = {
    "model": ("scan_layers", "remat", "init_from", "attention", "attention_block", "moe.dispatch"),
    "precision": ("backend", "verify_backend", "gather"),
}
"""Keys that say how a run computes, not what it computes: a run may resume on other ones
(another machine, another backend, stacked blocks or not, another remat policy, another weight
gather or expert-parallel token exchange (same bits): checkpoints are
per layer; the model directory a run started from, which may have moved), so they are not
compared; a dotted key is one of a nested section."""

COMPARED_SECTIONS = ("model", "precision", "optimizer.loss_scaling")
"""The sections a resumed run must share with its checkpoint: what the model is, how it is
quantized, and the loss scaling and skip-step whose state the optimizer state holds."""


def _section(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def _pop(tree: dict[str, Any], dotted: str) -> None:
    """Removes the key `dotted` (`moe.dispatch`: a nested one) from `tree`, if there."""
    *parents, key = dotted.split(".")
    for part in parents:
        tree = tree.get(part)
        if not isinstance(tree, dict):
            return
    tree.pop(key, None)


def _differing(mine: dict[str, Any], old: dict[str, Any], prefix: str) -> list[str]:
    """The dotted keys whose values differ, nested sections (`model.moe`) key by key."""
    keys = []
    for key, value in mine.items():
        other = old.get(key)
        if isinstance(value, dict) and isinstance(other, dict):
            keys += _differing(value, other, f"{prefix}.{key}")
        elif other != value:
            keys.append(f"{prefix}.{key}")
    return keys


def check_same_model(cfg: Config, saved: dict[str, Any], run_dir: Path) -> None:
    """Raises ConfigError naming every key of `COMPARED_SECTIONS` that differs from `saved`.

    `saved` written by an earlier version is read with its moved keys at their new places
    (`config.upgraded`). A key or section missing from `saved` (written before it existed)
    counts as its default value; `IMPLEMENTATION_KEYS` are not compared.
    """
    new, saved = to_dict(cfg), upgraded(saved)
    for section in COMPARED_SECTIONS:
        mine, old = _section(new, section), _section(saved, section)
        if isinstance(old, dict) or old is None:
            default = functools.reduce(getattr, section.split("."), cfg)
            old = {**to_dict(type(default)()), **(old or {})}
        for key in IMPLEMENTATION_KEYS.get(section, ()):
            _pop(mine, key)
            if isinstance(old, dict):
                _pop(old, key)
        if old != mine:
            keys = _differing(mine, old or {}, section)
            raise ConfigError(
                f"output_dir {str(run_dir)!r} holds a checkpoint of a different run "
                f"({', '.join(keys)} differ); choose a new output_dir to start fresh"
            )
    clip_now = cfg.optimizer.grad_clip_norm
    clip_then = _section(saved, "optimizer.grad_clip_norm")
    clip_then = type(cfg.optimizer)().grad_clip_norm if clip_then is None else clip_then
    if (clip_now == 0) != (clip_then == 0):
        raise ConfigError(
            f"output_dir {str(run_dir)!r} holds a checkpoint trained with "
            f"optimizer.grad_clip_norm={clip_then}, and {clip_now} turns clipping "
            f"{'off' if clip_now == 0 else 'on'}, which changes the optimizer state; keep it "
            f"{'0' if clip_then == 0 else '> 0'} to resume, or choose a new output_dir"
        )


def restore_newest_readable(
    cfg: Config,
    run_dir: Path,
    ckpts: Checkpoints,
    abstract: Any,
    say: Callable[[str], None],
    *,
    set_aside: bool = True,
) -> Restored | None:
    """The newest checkpoint that restores, setting aside (and reporting) unreadable newer ones.

    Raises:
        ConfigError: the newest readable checkpoint is of a different model or precision.
    """
    for step in reversed(ckpts.all_steps()):
        try:
            saved_config = ckpts.read_config(step)
        except Exception as e:  # noqa: BLE001 - any failure to read means "unreadable"
            _report_unreadable(ckpts, step, e, say, set_aside)
            continue
        check_same_model(cfg, saved_config, run_dir)
        try:
            return ckpts.restore(step, abstract)
        except Exception as e:  # noqa: BLE001
            _report_unreadable(ckpts, step, e, say, set_aside)
    return None


def _report_unreadable(ckpts, step: int, error: Exception, say, set_aside: bool) -> None:
    reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    where = ckpts.directory / str(step)
    if set_aside:
        moved = ckpts.set_aside(step)
        say(f"warning: checkpoint {where} is unreadable ({reason}); moved it to {moved.name}")
    else:
        say(f"warning: checkpoint {where} is unreadable ({reason}); skipping it")
    say("trying the previous checkpoint")


def _imported_state(cfg: Config, abstract: Any, shardings: Any, say: Callable[[str], None]) -> Any:
    """The step-0 state of a run starting from the Hugging Face weights in `model.init_from`,
    read straight into `shardings`."""
    start = time.perf_counter()
    params, unused = load_hf_params(
        cfg.model.init_from, cfg.model, abstract.params, shardings.params
    )
    optimizer = make_optimizer(cfg.optimizer, cfg.train.steps)
    to_state = jax.jit(
        lambda p: state_from_params(cfg.model, p, optimizer),
        out_shardings=shardings,
        donate_argnums=0,
    )
    state = to_state(params)
    say(
        f"initialised from {cfg.model.init_from} ({cfg.model.architecture}) in "
        f"{time.perf_counter() - start:.1f} s"
    )
    for line in unused_lines(unused):
        say(line)
    return state


def resume_or_init(
    cfg: Config,
    run_dir: Path,
    ckpts: Checkpoints,
    iterator: Any,
    metrics_path: Path,
    say: Callable[[str], None],
    mesh: Mesh,
) -> tuple[Any, Any, int]:
    """(graphdef, state, start_step): the newest readable checkpoint restored, or a fresh state,
    placed on `mesh` by the sharding rules (`nvfp4_train.mesh.sharding.tree_shardings`).

    On resume the data iterator is set to the checkpoint's position and `metrics_path` rows written
    after the checkpoint's step are dropped.
    """
    graphdef, abstract = abstract_state(cfg)
    shardings = tree_shardings(abstract, abstract.params, mesh)
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    restored = restore_newest_readable(cfg, run_dir, ckpts, target, say)
    if restored is None and cfg.model.init_from:
        return graphdef, _imported_state(cfg, abstract, shardings, say), 0
    if restored is None:  # initialised in place, already sharded
        state = jax.jit(lambda: initial_state(cfg)[1], out_shardings=shardings)()
        return graphdef, state, 0
    restored_state = jax.device_put(restored.state, shardings)
    restore_iterator_state(iterator, restored.data_iter_state)  # names a changed data setting
    dropped = truncate_metrics(metrics_path, restored.step) if jax.process_index() == 0 else 0
    say(f"resumed from {ckpts.directory / str(restored.step)} (step {restored.step})")
    if dropped:
        say(
            f"dropped {dropped} metrics rows written after step {restored.step} by the interrupted run"
        )
    return graphdef, restored_state, restored.step
