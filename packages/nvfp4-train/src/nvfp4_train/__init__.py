"""nvfp4_train: pretrain Llama-style models in JAX with the NVFP4 precision policy.

Command line: `nvfp4-train run CONFIG.yaml [key=value ...]` (see the package README).

Example:
    >>> from nvfp4_train import load_config, run
    >>> cfg = load_config("examples/configs/tiny.yaml", ["train.steps=20"])  # doctest: +SKIP
    >>> summary = run(cfg)  # doctest: +SKIP
"""

from nvfp4_train.checkpoint import Checkpoints, Restored
from nvfp4_train.config import (
    CheckpointConfig,
    Config,
    LoggingConfig,
    TrainConfig,
    config_from_dict,
    load_config,
)
from nvfp4_train.config_loader import to_dict, to_yaml
from nvfp4_train.data import DataConfig, make_datasets
from nvfp4_train.distributed import DistributedConfig
from nvfp4_train.errors import ConfigError
from nvfp4_train.loss_scaling import LossScalingConfig
from nvfp4_train.model_config import ModelConfig
from nvfp4_train.optim import OptimizerConfig
from nvfp4_train.plot import plot_runs
from nvfp4_train.policy import PrecisionConfig, precision_phases
from nvfp4_train.resume import abstract_state, initial_state
from nvfp4_train.run import RunSummary, evaluate_run, load_run_config, run
from nvfp4_train.schedule import PrecisionPhase, ScheduleRule, format_schedule
from nvfp4_train.sharding import MeshConfig, make_mesh
from nvfp4_train.step import ModelSpec, init_state, model_spec, with_vocab_size
from nvfp4_train.telemetry import capture_linear_operands

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
