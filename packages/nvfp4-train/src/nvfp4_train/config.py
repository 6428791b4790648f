"""The run configuration: a typed, frozen dataclass tree and its YAML loader.

`Config` gathers one section per concern (`model`, `precision`, `optimizer`, `data`, `train`,
`checkpoint`, `logging`, `mesh`, `distributed`). The loader builds the tree generically from the dataclass type hints, so a
section only has to declare typed, defaulted fields and validate values in `__post_init__`. A
field whose name cannot be a YAML key as it is (a Python keyword) names its key in its metadata:
`from_: int = dataclasses.field(default=0, metadata={"config_key": "from"})` (`config_key`).
Loading never touches the file system beyond reading the YAML (and, with `model.init_from`, that
model's `config.json`: `nvfp4_train.hf_config`), and never initialises a runtime.

Example:
    >>> cfg = config_from_dict({"train": {"steps": 20}}, overrides=["precision.recipe=bf16"])
    >>> (cfg.train.steps, cfg.precision.recipe)
    (20, 'bf16')
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import reprlib
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from nvfp4_train.data import DataConfig
from nvfp4_train.distributed import DistributedConfig
from nvfp4_train.errors import ConfigError
from nvfp4_train.health import QuantHealthConfig
from nvfp4_train.hf_config import HFConfigError, fill_data_section, fill_model_section
from nvfp4_train.model import ModelConfig
from nvfp4_train.optim import OptimizerConfig
from nvfp4_train.policy import PrecisionConfig
from nvfp4_train.sharding import MeshConfig


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

    def __post_init__(self) -> None:
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

    def __post_init__(self) -> None:
        if not self.output_dir:
            raise ValueError("output_dir must be a directory path, got ''")
        if self.train.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"train.seq_len must be <= model.max_seq_len={self.model.max_seq_len}, "
                f"got {self.train.seq_len}"
            )


# ----------------------------------------------------------------------------- generic loader


def config_key(field: dataclasses.Field) -> str:
    """The YAML key of a dataclass field: its `metadata["config_key"]`, else its name."""
    return field.metadata.get("config_key", field.name)


def _describe(tp: Any) -> str:
    """A readable name for a type hint: `int`, `tuple[int, ...]`, `one of 'a', 'b'`."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    args = typing.get_args(tp)
    if origin in (tuple, list) and args and dataclasses.is_dataclass(args[0]):
        return "a list of mappings"
    return getattr(tp, "__name__", None) if origin is None else str(tp).replace("typing.", "")


MAX_SHOWN = 200
"""Longest repr of a user's value shown in an error message (a value can be huge: YAML aliases)."""


def shown(value: Any) -> str:
    """`repr(value)`, cut to `MAX_SHOWN` characters."""
    cut = reprlib.Repr()
    cut.maxstring = cut.maxother = MAX_SHOWN
    text = cut.repr(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


def _wrong_type(key: str, tp: Any, value: Any) -> ConfigError:
    return ConfigError(
        f"{key}: expected {_describe(tp)}, got {shown(value)} ({type(value).__name__})"
    )


def _finite(key: str, value: float) -> float:
    if not math.isfinite(value):
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    return value


def _convert_scalar(tp: type, value: Any, key: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return _finite(key, float(value))
        if isinstance(value, str):  # YAML 1.1 reads `3e-4` as a string
            try:
                number = float(value)
            except ValueError:
                number = None
            if number is not None:
                return _finite(key, number)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is Any or isinstance(value, tp):
        return value
    raise _wrong_type(key, tp, value)


def _convert(tp: Any, value: Any, key: str) -> Any:
    """Checks `value` (from YAML) against the type hint `tp` and converts it (lists to tuples)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise _wrong_type(key, tp, value)
        return build(tp, value, prefix=key)
    if origin is Literal:
        if value not in args or isinstance(value, bool) != any(isinstance(a, bool) for a in args):
            raise _wrong_type(key, tp, value)
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, key)
            except ConfigError:
                continue
        raise _wrong_type(key, tp, value)
    if origin in (tuple, list, Sequence):
        if not isinstance(value, list | tuple):
            raise _wrong_type(key, tp, value)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(value):
                raise _wrong_type(key, tp, value)
            items = [
                _convert(a, v, f"{key}[{i}]")
                for i, (a, v) in enumerate(zip(args, value, strict=True))
            ]
        else:
            item_tp = args[0] if args else Any
            items = [_convert(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return list(items) if origin is list else tuple(items)
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise _wrong_type(key, tp, value)
        key_tp, val_tp = args if args else (Any, Any)
        return {
            _convert(key_tp, k, f"{key}.{k}"): _convert(val_tp, v, f"{key}.{k}")
            for k, v in value.items()
        }
    return _convert_scalar(tp, value, key)


def _unknown_key(cls: type, key: str, dotted: str) -> ConfigError:
    allowed = [config_key(f) for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(
        f"unknown config key {shown(dotted)}{hint}; allowed keys: {', '.join(allowed)}"
    )


def build(cls: type, mapping: Mapping[str, Any], prefix: str = "") -> Any:
    """Builds the frozen dataclass `cls` from a plain mapping, checking keys and types.

    Args:
        cls: a dataclass type whose fields have type hints (resolvable by `typing.get_type_hints`).
        mapping: values from YAML; missing keys take the field defaults.
        prefix: the dotted path of `cls` inside the whole config, for error messages.

    Returns:
        An instance of `cls`.

    Raises:
        ConfigError: an unknown key, a value of the wrong type, or a value the section rejects.
    """
    hints = typing.get_type_hints(cls)
    fields = {config_key(f): f.name for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in mapping.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            raise _unknown_key(cls, str(key), dotted)
        kwargs[fields[key]] = _convert(hints[fields[key]], value, dotted)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        text = str(e) if prefix in str(e) else f"{prefix or 'config'}: {e}"
        if len(text) > 4 * MAX_SHOWN:  # a section's message quoting a huge value
            text = text[: 4 * MAX_SHOWN] + "... (message cut)"
        raise ConfigError(text) from None


MAX_NODES = 100_000
"""Values a config may hold once its YAML aliases are expanded: plenty for any config, few enough
to refuse an alias bomb (a few hundred bytes of nested aliases standing for billions of values)."""


class _Loader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses duplicate keys."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                line = key_node.start_mark.line + 1
                raise ConfigError(f"duplicate key {shown(key)} at line {line} of the YAML")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many values `node` stands for once aliases are expanded (each node counted once)."""
    if id(node) not in sizes:
        sizes[id(node)] = 1  # a cycle counts once (recursive YAML)
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        sizes[id(node)] = 1 + sum(_expanded_size(c, sizes) for c in children)
    return sizes[id(node)]


def read_yaml(text: str) -> Any:
    """YAML data as `yaml.safe_load` reads it, refusing duplicate keys and alias bombs.

    Raises:
        ConfigError: duplicate keys, more than `MAX_NODES` values, nesting too deep for Python.
        yaml.YAMLError: not YAML.
    """
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_size(node, {})
        if size > MAX_NODES:
            raise ConfigError(
                f"the YAML stands for {size:,} values once its aliases (*name) are expanded, "
                f"more than {MAX_NODES:,}; refusing it (an alias bomb?)"
            )
        return loader.construct_document(node)
    except RecursionError:
        raise ConfigError("the YAML is nested too deeply to read") from None
    finally:
        loader.dispose()


def parse_override(text: str) -> tuple[list[str], Any]:
    """Splits `a.b.c=value` into (['a', 'b', 'c'], value); the value is parsed as YAML.

    Raises:
        ConfigError: no `=`, an empty key or key part, or a value that is not valid YAML.
    """
    key, sep, raw = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(p.strip() for p in parts):
        raise ConfigError(f"override must look like section.key=value, got {shown(text)}")
    try:
        value = read_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {shown(text)}: the value is not valid YAML ({e})") from None
    return [p.strip() for p in parts], value


def apply_overrides(mapping: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Returns a deep copy of `mapping` with each `dotted.key=value` override set in it."""
    result = _deep_copy(mapping)
    for text in overrides:
        parts, value = parse_override(text)
        node = result
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(f"override {shown(text)}: {where!r} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return result


def _deep_copy(mapping: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in mapping.items()}


def config_from_dict(mapping: Mapping[str, Any] | None, overrides: Iterable[str] = ()) -> Config:
    """Builds a `Config` from a plain mapping (as read from YAML) plus dotted overrides."""
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"a config must be a YAML mapping, got {type(mapping).__name__}")
    merged = apply_overrides(mapping, overrides)
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


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> Config:
    """Reads a YAML config file (`read_yaml`: a safe load) and builds the `Config` with overrides.

    Raises:
        ConfigError: the file is missing, is not YAML, or its content is not a valid config.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(path)!r}: {e.strerror}") from None
    try:
        mapping = read_yaml(text)
    except ConfigError as e:
        raise ConfigError(f"config file {str(path)!r}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    return config_from_dict(mapping, overrides)


def to_dict(cfg: Any) -> Any:
    """The config tree as plain YAML/JSON-ready data (tuples become lists)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {config_key(f): to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple | list):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, Mapping):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def to_yaml(cfg: Any) -> str:
    """The config tree as a YAML document, in field order; `load_config` reads it back."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)
