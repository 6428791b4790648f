"""nvfp4_train: pretrain Llama-style models in JAX with the NVFP4 precision policy.

Command line: `nvfp4-train run CONFIG.yaml [key=value ...]` (see the package README).

The public names below are imported from their modules when first used, so `import nvfp4_train`
loads neither JAX nor the trainer (the command line and tools that need one name pay for that
name's modules only).

Example:
    >>> from nvfp4_train import load_config, run
    >>> cfg = load_config("examples/configs/tiny.yaml", ["train.steps=20"])  # doctest: +SKIP
    >>> summary = run(cfg)  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CheckpointConfig": "nvfp4_train.config.run_config",
    "Checkpoints": "nvfp4_train.checkpoint.checkpoints",
    "Config": "nvfp4_train.config.run_config",
    "ConfigError": "nvfp4_train.errors",
    "DataConfig": "nvfp4_train.data",
    "DistributedConfig": "nvfp4_train.mesh.distributed",
    "EvalConfig": "nvfp4_train.tasks.config",
    "LoggingConfig": "nvfp4_train.config.run_config",
    "LossScalingConfig": "nvfp4_train.optim.loss_scaling",
    "MeshConfig": "nvfp4_train.mesh.sharding",
    "ModelConfig": "nvfp4_train.model.config",
    "ModelSpec": "nvfp4_train.training.step",
    "OptimizerConfig": "nvfp4_train.optim.optimizer",
    "PrecisionConfig": "nvfp4_train.precision.policy",
    "PrecisionPhase": "nvfp4_train.precision.schedule",
    "Restored": "nvfp4_train.checkpoint.items",
    "RunSummary": "nvfp4_train.training.loop",
    "ScheduleRule": "nvfp4_train.precision.schedule",
    "TrainConfig": "nvfp4_train.config.run_config",
    "abstract_state": "nvfp4_train.training.resume",
    "capture_linear_operands": "nvfp4_train.observe.telemetry",
    "config_from_dict": "nvfp4_train.config.run_config",
    "evaluate_run": "nvfp4_train.training.evaluation",
    "evaluate_run_tasks": "nvfp4_train.training.downstream",
    "format_schedule": "nvfp4_train.precision.schedule",
    "init_state": "nvfp4_train.training.step",
    "initial_state": "nvfp4_train.training.resume",
    "load_config": "nvfp4_train.config.run_config",
    "load_run_config": "nvfp4_train.training.session",
    "load_task": "nvfp4_train.tasks",
    "make_datasets": "nvfp4_train.data",
    "make_mesh": "nvfp4_train.mesh.sharding",
    "model_spec": "nvfp4_train.training.step",
    "plot_runs": "nvfp4_train.observe.plot",
    "precision_phases": "nvfp4_train.precision.policy",
    "run": "nvfp4_train.training.run",
    "score_task": "nvfp4_train.tasks",
    "to_dict": "nvfp4_train.config.loader",
    "to_yaml": "nvfp4_train.config.loader",
    "with_vocab_size": "nvfp4_train.training.step",
}
"""Public name -> the module that defines it."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'nvfp4_train' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
