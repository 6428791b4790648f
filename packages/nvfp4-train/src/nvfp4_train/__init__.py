"""nvfp4_train: pretrain Llama-style models in JAX with the NVFP4 precision policy.

Command line: `nvfp4-train run CONFIG.yaml [key=value ...]` (see the package README).

Example:
    >>> from nvfp4_train import load_config, run
    >>> cfg = load_config("examples/configs/tiny.yaml", ["train.steps=20"])  # doctest: +SKIP
    >>> summary = run(cfg)  # doctest: +SKIP
"""

from nvfp4_train.checkpoint.checkpoints import Checkpoints, Restored
from nvfp4_train.config.loader import to_dict, to_yaml
from nvfp4_train.config.run_config import (
    CheckpointConfig,
    Config,
    LoggingConfig,
    TrainConfig,
    config_from_dict,
    load_config,
)
from nvfp4_train.data import DataConfig, make_datasets
from nvfp4_train.errors import ConfigError
from nvfp4_train.mesh.distributed import DistributedConfig
from nvfp4_train.mesh.sharding import MeshConfig, make_mesh
from nvfp4_train.model.config import ModelConfig
from nvfp4_train.observe.plot import plot_runs
from nvfp4_train.observe.telemetry import capture_linear_operands
from nvfp4_train.optim.loss_scaling import LossScalingConfig
from nvfp4_train.optim.optimizer import OptimizerConfig
from nvfp4_train.precision.policy import PrecisionConfig, precision_phases
from nvfp4_train.precision.schedule import PrecisionPhase, ScheduleRule, format_schedule
from nvfp4_train.training.resume import abstract_state, initial_state
from nvfp4_train.training.run import RunSummary, evaluate_run, load_run_config, run
from nvfp4_train.training.step import ModelSpec, init_state, model_spec, with_vocab_size

__all__ = [
    "CheckpointConfig",
    "Checkpoints",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "LoggingConfig",
    "LossScalingConfig",
    "MeshConfig",
    "ModelSpec",
    "ModelConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "PrecisionPhase",
    "Restored",
    "RunSummary",
    "ScheduleRule",
    "TrainConfig",
    "abstract_state",
    "capture_linear_operands",
    "config_from_dict",
    "evaluate_run",
    "format_schedule",
    "init_state",
    "initial_state",
    "load_config",
    "load_run_config",
    "make_datasets",
    "make_mesh",
    "model_spec",
    "plot_runs",
    "precision_phases",
    "run",
    "to_dict",
    "to_yaml",
    "with_vocab_size",
]
