"""The step functions of a run config, wired as `nvfp4_train.training.loop.TrainingLoop` wires them, for
tests that drive the steps directly."""

from __future__ import annotations

from nvfp4_train.observe.telemetry import make_quant_probe
from nvfp4_train.optim.optimizer import make_optimizer
from nvfp4_train.training.resume import run_train_step
from nvfp4_train.training.step import init_state, make_eval_step, model_spec


def run_optimizer(cfg):
    """The run's optimizer: `make_optimizer` of the `optimizer` section over `train.steps`."""
    return make_optimizer(cfg.optimizer, cfg.train.steps)


def initial(cfg, optimizer=None):
    """(graphdef, step-0 state) of `cfg`, with the run's optimizer unless one is given."""
    optimizer = run_optimizer(cfg) if optimizer is None else optimizer
    return init_state(model_spec(cfg), optimizer, seed=cfg.train.seed)


def train_step_of(cfg, graphdef, optimizer=None):
    """The (unjitted) train step of `cfg` on `graphdef`, with the run's optimizer by default."""
    return run_train_step(cfg, graphdef, optimizer)


def eval_step_of(cfg, graphdef):
    """The (unjitted) eval step of `cfg` on `graphdef`."""
    return make_eval_step(graphdef, seed=cfg.train.seed)


def probe_of(cfg, graphdef):
    """The (unjitted) quantization probe of `cfg` on `graphdef`."""
    return make_quant_probe(graphdef, cfg.model, grad_accum_steps=cfg.train.grad_accum_steps)
