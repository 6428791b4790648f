"""The run configuration: a typed, frozen dataclass tree and how it is read.

`Config` gathers one section per concern (`model`, `precision`, `optimizer`, `data`, `train`,
`checkpoint`, `logging`, `mesh`, `distributed`, `eval`). `nvfp4_train.config.loader` builds the tree
generically from the dataclass type hints, so a section only has to declare typed, defaulted fields
and validate values in `__post_init__`. Keys that moved between versions (`MOVED_KEYS`) are refused
in a user's config with their new place, and moved in a run directory's saved one (`upgraded`).
Loading never touches the file system beyond reading the YAML (and, with `model.init_from`, that
model's `config.json`: `nvfp4_train.model.hf.config`), and never initialises a runtime.

Example:
    >>> cfg = config_from_dict({"train": {"steps": 20}}, overrides=["precision.recipe=bf16"])
    >>> (cfg.train.steps, cfg.precision.recipe)
    (20, 'bf16')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

from nvfp4_train.config.loader import apply_overrides, build, read_yaml
from nvfp4_train.data import DataConfig
from nvfp4_train.errors import ConfigError
from nvfp4_train.mesh.distributed import DistributedConfig
from nvfp4_train.mesh.sharding import MeshConfig, check_expert_split, check_tensor_split
from nvfp4_train.model.config import ModelConfig
from nvfp4_train.model.hf.config import HFConfigError, fill_data_section, fill_model_section
from nvfp4_train.observe.health import QuantHealthConfig
from nvfp4_train.optim.optimizer import OptimizerConfig
from nvfp4_train.precision.policy import PrecisionConfig
from nvfp4_train.tasks.config import EvalConfig


def _check_min(section: str, name: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ValueError(f"{section}.{name} must be >= {minimum}, got {value}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training loop.

    Attributes:
        steps: optimizer steps to run in total (a resumed run stops at this step too).
        seed: seeds parameter init, data shuffling and the stochastic-rounding keys.
        batch_size: sequences per optimizer step (split into `grad_accum_steps` microbatches).
        seq_len: tokens per sequence.
        grad_accum_steps: microbatches per optimizer step; must divide `batch_size`.
        eval_every: validation-loss interval in steps (0: only at the end).
        eval_batches: validation batches per evaluation (None: all `data.validation_batches`).
        log_every: interval in steps of metrics rows, TensorBoard points and log lines.
        stop_after_nonfinite: stop the run (exit 1) after this many consecutive steps whose
            update was skipped as non-finite or whose loss is not finite (0: never). Checked at
            every metrics row, so up to `log_every` steps after the fact; the run's checkpoints
            are kept as they are.
        memory_check: refuse, before compiling or writing anything, a run whose per-device
            memory estimate (`show-config --memory`) exceeds what a device holds (a GPU's memory
            limit, a CPU device's share of the host RAM); false: try anyway.
        deterministic: XLA's deterministic GPU ops (`--xla_gpu_deterministic_ops=true`, added
            to XLA_FLAGS by `nvfp4-train run` before JAX starts): true, false, or "auto" (on
            when the run checkpoints before its last step: `training.determinism`).
    """

    steps: int = 300
    seed: int = 0
    batch_size: int = 16
    seq_len: int = 128
    grad_accum_steps: int = 1
    eval_every: int = 100
    eval_batches: int | None = None
    log_every: int = 10
    stop_after_nonfinite: int = 10
    memory_check: bool = True
    deterministic: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        if not (isinstance(self.deterministic, bool) or self.deterministic == "auto"):
            raise ValueError(
                f"train.deterministic must be true, false or 'auto', got {self.deterministic!r}"
            )
        for name, minimum in (("steps", 1), ("batch_size", 1), ("seq_len", 2)):
            _check_min("train", name, getattr(self, name), minimum)
        _check_min("train", "stop_after_nonfinite", self.stop_after_nonfinite, 0)
        for name, minimum in (("grad_accum_steps", 1), ("log_every", 1), ("eval_every", 0)):
            _check_min("train", name, getattr(self, name), minimum)
        if self.eval_batches is not None:
            _check_min("train", "eval_batches", self.eval_batches, 1)
        if self.batch_size % self.grad_accum_steps:
            raise ValueError(
                "train.batch_size must be a multiple of train.grad_accum_steps, got "
                f"batch_size={self.batch_size}, grad_accum_steps={self.grad_accum_steps}"
            )


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints in `<output_dir>/checkpoints`.

    Attributes:
        every_steps: checkpoint interval in steps (0: only at the end); the last step is always saved.
        keep: how many of the most recent checkpoints to keep.
        keep_period: also keep every checkpoint whose step is a multiple of this (0: off).
        async_save: write checkpoints in a background thread while training continues.
        reference_sequences: how many validation sequences (at most `min(train.seq_len, 64)`
            tokens each) each checkpoint stores with the model's logits on them, as ONE batch,
            in its `reference` item for exporters to verify against (0: no reference item).
    """

    every_steps: int = 500
    keep: int = 3
    keep_period: int = 0
    async_save: bool = False
    reference_sequences: int = 4

    def __post_init__(self) -> None:
        _check_min("checkpoint", "every_steps", self.every_steps, 0)
        _check_min("checkpoint", "keep", self.keep, 1)
        _check_min("checkpoint", "keep_period", self.keep_period, 0)
        _check_min("checkpoint", "reference_sequences", self.reference_sequences, 0)


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """What the run reports besides `metrics.jsonl` (always written).

    Attributes:
        tensorboard: write TensorBoard event files to `<output_dir>/tensorboard`.
        progress: "rich" progress bar, "plain" log lines, or "auto" (rich on a terminal).
        quant_stats_every: interval in steps of the quantization telemetry (0: off): per
            quantized linear and GEMM operand, amax, block-scale underflow, saturation and
            relative error, as `{"step", "quant"}` rows and `quant/...` TensorBoard scalars
            (see docs/telemetry.md). Each probe costs about one extra forward + backward pass
            of one microbatch plus the re-quantization of every operand, about 1.1 train
            steps on examples/configs/small.yaml (so 100: ~1% slower); it never changes the
            training numerics.
        quant_health: the limits above which the telemetry warns (see `QuantHealthConfig`).
    """

    tensorboard: bool = True
    progress: Literal["auto", "rich", "plain"] = "auto"
    quant_stats_every: int = 0
    quant_health: QuantHealthConfig = dataclasses.field(default_factory=QuantHealthConfig)

    def __post_init__(self) -> None:
        _check_min("logging", "quant_stats_every", self.quant_stats_every, 0)
        if self.progress not in ("auto", "rich", "plain"):
            raise ValueError(
                f"logging.progress must be one of 'auto', 'rich', 'plain', got {self.progress!r}"
            )


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole run: where it writes and one section per concern.

    Attributes:
        output_dir: the run directory (created by `run`; rerunning resumes from it).
    """

    output_dir: str = "runs/default"
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        if not self.output_dir:
            raise ValueError("output_dir must be a directory path, got ''")
        if self.train.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"train.seq_len must be <= model.max_seq_len={self.model.max_seq_len}, "
                f"got {self.train.seq_len}"
            )
        check_expert_split(self.model.moe.num_experts, self.mesh.expert)
        check_tensor_split(self.model, self.mesh.tensor)


MOVED_KEYS = {
    "precision.loss_scaling": "optimizer.loss_scaling.mode",
    "precision.initial_loss_scale": "optimizer.loss_scaling.initial_scale",
    "precision.loss_scale_growth_interval": "optimizer.loss_scaling.growth_interval",
    "precision.skip_nonfinite": "optimizer.loss_scaling.skip_nonfinite",
}
"""Keys of earlier versions -> where they are now. A config that sets one is refused with the
new key (`config_from_dict`); a run directory's saved config is moved (`upgraded`)."""


ADDED_KEYS = {"model.attention": "naive", "data.document_mask": False}
"""Keys earlier versions did not have -> the value that computes as they did. A saved config
without one gets it (`upgraded`): an old run resumes and evaluates as it trained (a new config
without the key takes the field's default)."""


def _parent(mapping: Any, dotted: str, *, create: bool = False) -> tuple[Any, str]:
    """(the mapping holding the last part of `dotted`, or None; that part)."""
    *parents, leaf = dotted.split(".")
    node = mapping
    for part in parents:
        if not isinstance(node, dict):
            return None, leaf
        node = node.setdefault(part, {}) if create else node.get(part)
    return (node if isinstance(node, dict) else None), leaf


def _refuse_moved(mapping: dict[str, Any]) -> None:
    for old, new in MOVED_KEYS.items():
        node, leaf = _parent(mapping, old)
        if node is not None and leaf in node:
            raise ConfigError(
                f"config key {old!r} moved to {new!r}: write `{new}={node[leaf]!r}` instead"
            )


def upgraded(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """A saved config (a run directory's `config.yaml`, a checkpoint's `config` item) written by
    an earlier version, with its `MOVED_KEYS` at their new places (a new key already set wins).

    Example:
        >>> upgraded({"precision": {"recipe": "nvfp4", "loss_scaling": "dynamic"}})
        {'precision': {'recipe': 'nvfp4'}, 'optimizer': {'loss_scaling': {'mode': 'dynamic'}}}
    """
    result = apply_overrides(mapping, ())  # a deep copy
    for old, new in MOVED_KEYS.items():
        node, leaf = _parent(result, old)
        if node is None or leaf not in node:
            continue
        value = node.pop(leaf)
        target, new_leaf = _parent(result, new, create=True)
        if target is not None:
            target.setdefault(new_leaf, value)
    for added, value in ADDED_KEYS.items():
        node, leaf = _parent(result, added)
        if node is not None:
            node.setdefault(leaf, value)
    return result


def config_from_dict(mapping: Mapping[str, Any] | None, overrides: Iterable[str] = ()) -> Config:
    """Builds a `Config` from a plain mapping (as read from YAML) plus dotted overrides.

    Raises:
        ConfigError: not a mapping, an unknown or moved key (`MOVED_KEYS`), a wrong value.
    """
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"a config must be a YAML mapping, got {type(mapping).__name__}")
    merged = apply_overrides(mapping, overrides)
    _refuse_moved(merged)
    model = merged.get("model")
    if (
        isinstance(model, Mapping)
        and isinstance(model.get("init_from"), str)
        and model["init_from"]
    ):
        try:
            merged["model"] = fill_model_section(model)
            data = merged.get("data", {})
            if isinstance(data, Mapping):
                merged["data"] = fill_data_section(data, model["init_from"])
        except HFConfigError as e:
            raise ConfigError(str(e)) from None
    return build(Config, merged)


def read_config_file(path: str | Path) -> Any:
    """The plain data of a YAML config file (`read_yaml`: a safe load).

    Raises:
        ConfigError: the file is missing or unreadable, or is not YAML.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(path)!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (byte {e.start}); is it a config?"
        ) from None
    try:
        return read_yaml(text)
    except ConfigError as e:
        raise ConfigError(f"config file {str(path)!r}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> Config:
    """Reads a YAML config file (`read_config_file`) and builds the `Config` with overrides.

    Raises:
        ConfigError: the file is missing, is not YAML, or its content is not a valid config.
    """
    return config_from_dict(read_config_file(path), overrides)
